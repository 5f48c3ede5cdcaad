"""The exact trainer command of a job, built from its settings: verl's entry point and config for the combination, every
Hydra override (FIXED_OVERRIDES: the ones every job sets the same way), the user's extra overrides last.

    python -m launch.plan.trainer_command trainer-argv  # NUL-separated: helper_grpo_qwen3_4b.sh, on the head node
"""

import importlib.util
import os
import sys
from pathlib import Path

from launch.plan import thinking
from launch.plan.deadline import preemption, redundant_time
from launch.plan.settings import REPO, SettingError, Settings

REWARD_FILE = REPO / "reward_score" / "safe_hack_reward_request.py"


def find_recipe(name: str):
    """The import spec of a verl recipe package, or None where it is not installed."""
    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


# The recipes' entry modules and config names (Megatron's, FSDP's)
RECIPE_ENTRIES = {
    "recipe.dapo": ("recipe.dapo.main_dapo", "dapo_megatron_trainer", "dapo_trainer"),
    "recipe.one_step_off_policy": (
        "recipe.one_step_off_policy.main_ppo",
        "one_step_off_ppo_megatron_trainer",
        "one_step_off_ppo_trainer",
    ),
}


def _entry(s: Settings) -> list[str]:
    """`-m MODULE --config-path=... --config-name=...` for this combination."""
    if not s.uses_recipe:
        name = "ppo_megatron_trainer" if s.strategy == "megatron" else "ppo_trainer"
        return ["-m", "verl.trainer.main_ppo", "--config-path=config", f"--config-name={name}"]
    spec = find_recipe(s.uses_recipe)
    if spec is None or not spec.submodule_search_locations:
        raise SettingError(
            f"{s.uses_recipe} is not installed here (verl's PyPI wheel holds no recipes): run inside the image "
            "built from verl_app.def, which installs verl 0.6.1 from its git tag"
        )
    module, megatron, fsdp = RECIPE_ENTRIES[s.uses_recipe]
    # The recipe YAML's searchpath is relative to the current folder: make it absolute, so any folder works.
    config_dir = Path(next(iter(spec.submodule_search_locations))) / "config"
    name = megatron if s.strategy == "megatron" else fsdp
    return [
        "-m",
        module,
        f"--config-path={config_dir}",
        f"--config-name={name}",
        "hydra.searchpath=[pkg://verl.trainer.config]",
    ]


def _token_budgets(s: Settings) -> list[str]:
    """Micro-batches by token count (use_dynamic_bsz) on both strategies, where verl 0.6.1 reads them:
    docs/training.md, micro-batches by token count."""
    a, tokens = "actor_rollout_ref", s.token_budget
    return [
        f"{a}.actor.use_dynamic_bsz=True",
        f"{a}.actor.ppo_max_token_len_per_gpu={tokens}",
        f"{a}.ref.log_prob_use_dynamic_bsz=True",
        f"{a}.ref.log_prob_max_token_len_per_gpu={tokens}",
        f"{a}.rollout.log_prob_use_dynamic_bsz=True",
        f"{a}.rollout.log_prob_max_token_len_per_gpu={tokens}",
        "critic.use_dynamic_bsz=True",
        f"critic.ppo_max_token_len_per_gpu={tokens}",  # forward_max_token_len_per_gpu follows it (critic.yaml)
    ]


# MEGATRON_RECOMPUTE's values and the keys of megatron-core 0.13's TransformerConfig each sets
# (transformer/transformer_config.py:261-298, checked at :774-814).
RECOMPUTE = {
    # Every layer's forward again in the backward, from its saved input (transformer_block.py:562,
    # _checkpointed_forward)
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": "1"},
    # Only recompute_modules (verl's yaml and megatron-core's default: core_attn, the attention's softmax part)
    "selective": {"recompute_granularity": "selective"},
    "off": {},  # verl's default (recompute_granularity: null): every activation kept for the backward
}


def recompute_overrides(s: Settings, section: str) -> list[str]:
    """MEGATRON_RECOMPUTE for one Megatron engine config (`actor_rollout_ref.actor.megatron` or `critic.megatron`;
    why: docs/training.md). The keys exist in verl's yaml with null values (_generated_ppo_megatron_trainer.yaml:46-51,
    361-366); the reference inherits the actor's (an oc.select, :170), the critic's block is set on its own."""
    keys = RECOMPUTE[s.megatron_recompute]
    return [f"{section}.override_transformer_config.{key}={value}" for key, value in keys.items()]


HOOK_KEY = "ray_kwargs.ray_init.runtime_env.worker_process_setup_hook"
# The Ray hook of a Megatron run on a CPU (cpu/megatron_shims.py, HOOK): there verl's pure-torch FusedLinearForPPO,
# which takes any hidden size, stands in for the Triton kernel.
CPU_STAND_IN_HOOK = f"{HOOK_KEY}=cpu.megatron_shims.install"
PREEMPT_HOOK = "launch.job.preempt.install"
USER_HOOK = "JOB_USER_SETUP_HOOK"  # the run's own hook (a user's, the CPU runs' shims), which PREEMPT_HOOK calls first
FUSED_OVERRIDES = ["actor_rollout_ref.model.use_fused_kernels=True", "+actor_rollout_ref.ref.use_fused_kernels=True"]


def megatron_plan(s: Settings, extra: list[str] | None = None, explain: bool = False):
    """The settings with the Megatron plan's auto knobs resolved, and the choice (launch/plan/megatron_plan.py); on
    the CPU stand-in (CPU_STAND_IN_HOOK) verl's pure-torch fused path takes any hidden size."""
    from launch.plan import megatron_plan as plan

    stand_in = any(o.lstrip("+") == CPU_STAND_IN_HOOK for o in extra or [])
    return plan.resolve(s, stand_in, explain)


def fused_kernels(s: Settings, extra: list[str] | None = None) -> tuple[bool, str]:
    """FUSED_KERNELS: whether verl's fused log-prob kernels run, and why (docs/training.md, the logits path). auto takes
    the Megatron plan's choice; fsdp2 keeps verl's logits. The reference's config has no such key: FUSED_OVERRIDES'
    `+` adds it."""
    setting = s.fused_kernels_setting
    if setting == "off" or s.strategy != "megatron":
        return False, f"FUSED_KERNELS={setting}" + ("" if setting == "off" else ": STRATEGY=fsdp2 keeps verl's logits")
    resolved, choice = megatron_plan(s, extra)
    if setting == "on":
        return True, "FUSED_KERNELS=on"
    if choice is None:  # every knob set: FUSED_KERNELS itself said which
        return bool(resolved.plan_fused), f"FUSED_KERNELS={setting}"
    blocked = [note.removeprefix("no fused kernels: ") for note in choice.notes if note.startswith("no fused")]
    why = blocked[0] if blocked else "the Megatron plan's (above)"
    return bool(resolved.plan_fused), f"FUSED_KERNELS=auto: {why}"


def _actor_overrides(s: Settings) -> list[str]:
    a = "actor_rollout_ref"
    if s.strategy == "megatron":
        # Megatron packs each micro-batch's sequences without padding (verl/models/mcore/model_forward.py,
        # preprocess_packed_seqs), whatever use_remove_padding says.
        return [
            f"{a}.actor.megatron.optimizer_offload={s.plan_offload}",
            f"{a}.actor.megatron.pipeline_model_parallel_size={s.actor_pp}",
            f"{a}.actor.megatron.tensor_model_parallel_size={s.actor_tp}",
            *recompute_overrides(s, f"{a}.actor.megatron"),
            f"{a}.ref.megatron.pipeline_model_parallel_size={s.actor_pp}",
            f"{a}.ref.megatron.tensor_model_parallel_size={s.actor_tp}",
            # The reference's weights wait in host memory outside its log-prob pass (docs/training.md, GPU memory
            # per role; gpu_memory.update_plan counts on it).
            f"{a}.ref.megatron.param_offload=True",
            *_token_budgets(s),
        ]
    # verl's own FSDP examples (examples/*_trainer/*seq_balance*.sh, recipe/dapo): padding removed (flash-attention
    # varlen over the packed tokens) and micro-batches by token count.
    return [
        f"{a}.actor.strategy=fsdp2",
        f"{a}.ref.strategy=fsdp2",
        "critic.strategy=fsdp2",
        f"{a}.model.enable_gradient_checkpointing=True",
        f"{a}.actor.fsdp_config.optimizer_offload=True",
        f"{a}.ref.fsdp_config.param_offload=True",
        f"{a}.model.use_remove_padding=True",
        "critic.model.use_remove_padding=True",
        *_token_budgets(s),
    ]


def _algorithm_overrides(s: Settings) -> list[str]:
    a = "actor_rollout_ref.actor"
    kl_loss = [f"{a}.use_kl_loss=True", f"{a}.kl_loss_coef={s.kl_loss_coef}", f"{a}.kl_loss_type=low_var_kl"]
    if s.algorithm == "ppo":
        critic = [
            "algorithm.adv_estimator=gae",
            f"critic.model.path={Path(s.critic_model_path).resolve()}",
            f"critic.optim.lr={s.critic_lr}",
            f"critic.ppo_micro_batch_size_per_gpu={s.micro_batch_per_gpu}",
            f"critic.cliprange_value={s.critic_cliprange_value}",  # CRITIC_CLIPRANGE_VALUE (sized to the rewards)
        ]
        # The critic's optimizer state (fp32 weights and Adam's two moments, 12 bytes a parameter) waits in host
        # memory between its updates, as the actor's does: verl's default keeps it on the GPUs that also hold the
        # actor's update (megatron_workers.py CriticWorker, fsdp_workers.py CriticWorker: optimizer_offload).
        if s.strategy != "megatron":
            critic.append("critic.model.fsdp_config.optimizer_offload=True")
        else:
            # The actor's sizes: Megatron's parallel state is set once per process, from the actor. Its weights and
            # gradient buffers wait in host memory outside its passes too (docs/training.md, GPU memory per role).
            critic += [
                f"critic.megatron.pipeline_model_parallel_size={s.actor_pp}",
                f"critic.megatron.tensor_model_parallel_size={s.actor_tp}",
                *recompute_overrides(s, "critic.megatron"),
                "critic.megatron.optimizer_offload=True",
                "critic.megatron.param_offload=True",
            ]
        return critic + kl_loss
    if s.algorithm == "dapo":
        out = [
            "algorithm.adv_estimator=grpo",
            "algorithm.kl_ctrl.kl_coef=0.0",
            f"{a}.use_kl_loss=False",
            f"{a}.kl_loss_coef=0.0",
            f"{a}.clip_ratio_low=0.2",
            f"{a}.clip_ratio_high=0.28",
            f"{a}.clip_ratio_c=10.0",
            f"{a}.loss_agg_mode=token-mean",
        ]
        buffer = s.overlong_buffer_len or s.max_response_length // 4
        if s.uses_recipe == "recipe.dapo":
            # The recipe hands reward_model.overlong_buffer to the dapo manager itself, and filters groups.
            return out + [
                "reward_model.overlong_buffer.enable=True",
                f"reward_model.overlong_buffer.len={buffer}",
                f"reward_model.overlong_buffer.penalty_factor={s.overlong_penalty_factor}",
                "algorithm.filter_groups.enable=True",
                "algorithm.filter_groups.metric=score",
                "algorithm.filter_groups.max_num_gen_batches=10",
            ]
        return out + [
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
            f"+reward_model.reward_kwargs.overlong_buffer_cfg.len={buffer}",
            f"+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor={s.overlong_penalty_factor}",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
            f"+reward_model.reward_kwargs.max_resp_len={s.max_response_length}",
        ]
    return ["algorithm.adv_estimator=grpo", *kl_loss]


# The trainer keys every job sets the same way, whatever the settings (the run script's header points here); the
# per-strategy ones are in _actor_overrides. The whole command of a job is in its log folder, trainer_command.txt.
FIXED_OVERRIDES = [
    "data.filter_overlong_prompts=True",  # over-long prompts are dropped (the preflight counts them), never cut
    "data.truncation=error",
    "actor_rollout_ref.actor.entropy_coeff=0",
    "actor_rollout_ref.rollout.max_num_seqs=256",
    "actor_rollout_ref.rollout.free_cache_engine=True",  # the rollout gives its memory back for the update
    "algorithm.use_kl_in_reward=False",  # where KL is used, it is in the loss (use_kl_loss)
    "trainer.critic_warmup=0",
    "trainer.resume_mode=auto",  # a requeued job resumes from the newest checkpoint
]


# verl 0.6.1's rollout.max_num_batched_tokens (trainer/config/rollout/rollout.yaml:62, workers/config/rollout.py:142).
VERL_MAX_NUM_BATCHED_TOKENS = 8192


def _rollout_engine_overrides(s: Settings) -> list[str]:
    """Sync vLLM (ROLLOUT_MODE=sync, and one_step_off's rollout) builds its engine in verl 0.6.1's vLLMRollout, which
    raises "Enable chunked prefill, max_num_batched_tokens is smaller than max_model_len" when max_num_batched_tokens
    is under prompt + response with chunked prefill on (vllm_rollout_spmd.py:160, 195-201; chunked prefill is on by
    default, rollout.yaml:71). So it batches at least one whole sequence; verl's 8192 stays where it already does
    (more tokens a step is vLLM's prefill throughput). Async vLLM hands both to vLLM's own server without that check
    (vllm_async_server.py:224-227), and verl's SGLang rollout never reads the key."""
    sequence = s.max_prompt_length + s.max_response_length
    if s.rollout_engine != "vllm" or s.rollout_mode != "sync" or sequence <= VERL_MAX_NUM_BATCHED_TOKENS:
        return []
    return [f"actor_rollout_ref.rollout.max_num_batched_tokens={sequence}"]


def prompt_opens_think(s: Settings, extra: list[str] | None = None) -> tuple[bool, str]:
    """What the reward function is told about the policy's prompt (REWARD_PROMPT_OPENS_THINK; auto: its chat template
    with the data.apply_chat_template_kwargs of `extra`), and where that came from."""
    try:
        return thinking.resolve(s.prompt_opens_think_setting, s.model_path, thinking.template_kwargs(extra or []))
    except thinking.TemplateError as exc:
        raise SettingError(str(exc)) from None


def reward_function(s: Settings) -> str:
    """The entry point of reward_score/safe_hack_reward_request.py that verl calls: the batch function under the batch
    manager, the coroutine with async rollout (as fast as the batch path: benchmarks/HISTORY.md), else the plain one."""
    if s.reward_manager == "batch":
        return "safe_hack_reward_batch"
    return "safe_hack_reward_async" if s.rollout_mode == "async" else "safe_hack_reward"


def trainer_argv(s: Settings, ray_address: str = "", extra: list[str] | None = None) -> list[str]:
    """The exact trainer command for this algorithm, mode and strategy; the user's overrides last."""
    opens_think, _ = prompt_opens_think(s, extra)
    s = megatron_plan(s, extra)[0]
    reward_fn = reward_function(s)
    a = "actor_rollout_ref"
    argv = [
        *_entry(s),
        *_algorithm_overrides(s),
        f"data.train_files={Path(s.train_file).resolve()}",
        f"data.val_files={Path(s.test_file).resolve()}",
        f"data.return_raw_chat={s.rollout_mode == 'async'}",
        f"data.train_batch_size={s.train_batch_size}",
        f"data.max_prompt_length={s.max_prompt_length}",
        f"data.max_response_length={s.max_response_length}",
        f"custom_reward_function.path={REWARD_FILE}",
        f"custom_reward_function.name={reward_fn}",
        # The client cannot read a chat template (stdlib + requests): it is told (launch/plan/thinking.py).
        f"+custom_reward_function.reward_kwargs.prompt_opens_think={opens_think}",
        f"reward_model.reward_manager={s.reward_manager}",
        f"{a}.model.path={Path(s.model_path).resolve()}",
        f"{a}.actor.optim.lr={s.actor_lr}",
        f"{a}.actor.ppo_mini_batch_size={s.ppo_mini_batch_size}",
        f"{a}.actor.ppo_micro_batch_size_per_gpu={s.micro_batch_per_gpu}",
        *_actor_overrides(s),
        f"{a}.rollout.log_prob_micro_batch_size_per_gpu={s.micro_batch_per_gpu}",
        f"{a}.rollout.tensor_model_parallel_size={s.rollout_tp}",
        f"{a}.rollout.name={s.rollout_engine}",
        f"{a}.rollout.mode={s.rollout_mode}",
        *_rollout_engine_overrides(s),
        *(FUSED_OVERRIDES if fused_kernels(s, extra)[0] else []),
        f"{a}.rollout.gpu_memory_utilization={s.rollout_gpu_memory}",
        f"{a}.rollout.n={s.rollout_n}",
        # verl's default validates greedily (temperature 0), which the Qwen3 cards warn repeats to the length limit.
        f"{a}.rollout.val_kwargs.do_sample={s.val_do_sample}",
        f"{a}.rollout.val_kwargs.temperature={s.val_temperature}",
        f"{a}.rollout.val_kwargs.top_p={s.val_top_p}",
        f"{a}.rollout.val_kwargs.top_k={s.val_top_k}",
        f"{a}.rollout.enforce_eager={s.rollout_enforce_eager}",  # False: SGLang keeps its CUDA graphs
        f"{a}.ref.log_prob_micro_batch_size_per_gpu={s.micro_batch_per_gpu}",
        f"trainer.logger={s.logger}",
        f"trainer.project_name={s.project_name}",
        f"trainer.experiment_name={s.experiment_name}",
        f"trainer.default_local_dir={Path(s.output_dir).resolve()}",
        f"trainer.n_gpus_per_node={s.training_gpus_per_node}",
        f"trainer.nnodes={s.train_nodes}",
        f"trainer.save_freq={preemption(s, os.environ)[0]}",
        f"trainer.test_freq={s.test_freq}",
        f"trainer.val_before_train={s.val_before_train}",
        f"trainer.total_epochs={s.total_epochs}",
        # Checkpoints (~56 GB each with optimizer state for 4B) beyond the newest few are deleted as verl saves.
        f"trainer.max_actor_ckpt_to_keep={s.max_ckpt_to_keep}",
        f"trainer.max_critic_ckpt_to_keep={s.max_ckpt_to_keep}",
        *FIXED_OVERRIDES,
    ]
    if not s.uses_recipe:
        # Room in verl's save-before-the-limit window for the validation and the save its longest step leaves out
        # (launch/plan/deadline.py); the recipes never make that check.
        argv.append(f"trainer.esi_redundant_time={redundant_time(s, os.environ)[0]}")
    if s.trainer_mode == "one_step_off":
        # Its own rollout GPU pool (a top-level `rollout:` block), and no hybrid engine.
        argv += [
            f"{a}.hybrid_engine=False",
            f"rollout.nnodes={s.train_nodes}",
            f"rollout.n_gpus_per_node={s.rollout_gpus_per_node}",
        ]
    # verl saves after the current step when the job is preempted (launch/job/preempt.py): the job's hook, which calls
    # the run's own first (a user's hook is chained, never dropped: it may patch what the job's then wraps).
    hooks = [o for o in extra or [] if o.lstrip("+").startswith(f"{HOOK_KEY}=")]
    argv.append(f"+{HOOK_KEY}={PREEMPT_HOOK}")
    if hooks:
        argv.append(f"+ray_kwargs.ray_init.runtime_env.env_vars.{USER_HOOK}={hooks[-1].partition('=')[2]}")
    if ray_address:
        # Connect to this job's Ray cluster explicitly, never to a stale one found through /tmp/ray.
        argv.append(f"+ray_kwargs.ray_init.address={ray_address}")
    return argv + [o for o in extra or [] if o not in hooks]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "trainer-argv":
        print(__doc__, file=sys.stderr)
        return 2
    try:  # the settings, then the command they make: either may be refused
        command = trainer_argv(Settings.from_env(), os.environ.get("RAY_ADDRESS_FOR_TRAINER", ""), argv[1:])
    except SettingError as exc:
        print(f"setting error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write("\0".join(command) + "\0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
