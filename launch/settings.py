"""The launch settings as one object: checks that name the setting to change, and the exact trainer command.

The defaults live in one place, the settings block at the top of run_grpo_qwen3_4b_mega_verl.sh, which exports
them; this module reads them from the environment and never invents its own.

    python -m launch.settings check             # exit 1 with one line per problem, each naming the setting
    python -m launch.settings trainer-argv      # the trainer command, NUL-separated (bash: mapfile -d '')
"""

import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REWARD_FILE = REPO / "reward_score" / "safe_hack_reward_request.py"


class SettingError(ValueError):
    pass


def _get(env, name: str) -> str:
    if name not in env:
        raise SettingError(f"{name} is not set (it has a default in run_grpo_qwen3_4b_mega_verl.sh: run through it)")
    return env[name]


def _number(env, name: str, kind: type, what: str):
    raw = _get(env, name)
    try:
        return kind(raw)
    except ValueError:
        raise SettingError(f"{name}={raw!r} is not {what}") from None


def _int(env, name: str) -> int:
    return _number(env, name, int, "a whole number")


def _float(env, name: str) -> float:
    return _number(env, name, float, "a number")


def _bool(env, name: str) -> bool:
    raw = _get(env, name).lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off", ""):
        return False
    raise SettingError(f"{name}={raw!r}: use true or false")


@dataclass(frozen=True)
class Settings:
    container: str
    image: str
    model_path: str
    reward_model_path: str
    train_file: str
    test_file: str
    output_dir: str
    nnodes: int
    gpus_per_node: int
    separate_reward_node: bool
    rollout_mode: str
    train_batch_size: int
    max_prompt_length: int
    max_response_length: int
    actor_lr: float
    ppo_mini_batch_size: int
    micro_batch_per_gpu: int
    actor_pp: int
    actor_tp: int
    rollout_tp: int
    rollout_n: int
    rollout_gpu_memory: float
    kl_loss_coef: float
    project_name: str
    experiment_name: str
    save_freq: int
    test_freq: int
    total_epochs: int
    fp8: bool
    logger: str
    algorithm: str = "grpo"
    trainer_mode: str = "sync"
    strategy: str = "megatron"
    reward_manager_setting: str = "auto"
    critic_model_path: str = ""
    critic_lr: float = 1e-5
    critic_pp: int = 1
    critic_tp: int = 1
    dapo_dynamic_sampling: bool = False
    overlong_buffer_len: int = 0
    rollout_gpus_per_node: int = 0
    max_ckpt_to_keep: int = 2
    rollout_enforce_eager: bool = False

    @classmethod
    def from_env(cls, env=None) -> "Settings":
        env = os.environ if env is None else env
        return cls(
            container=_get(env, "CONTAINER"),
            image=_get(env, "CONFIG_IMAGE_PATH"),
            model_path=_get(env, "CONFIG_MODEL_PATH"),
            reward_model_path=_get(env, "CONFIG_REWARD_MODEL_PATH"),
            train_file=_get(env, "CONFIG_TRAIN_FILE"),
            test_file=_get(env, "CONFIG_TEST_FILE"),
            output_dir=_get(env, "CONFIG_OUTPUT_DIR"),
            nnodes=int(env.get("SLURM_NNODES") or env.get("CONFIG_NUM_NODES") or 1),
            gpus_per_node=_int(env, "CONFIG_GPUS_PER_NODE"),
            separate_reward_node=_bool(env, "CONFIG_USE_SEPARATE_REWARD_NODE"),
            rollout_mode=_get(env, "ROLLOUT_MODE"),
            train_batch_size=_int(env, "TRAIN_BATCH_SIZE"),
            max_prompt_length=_int(env, "MAX_PROMPT_LENGTH"),
            max_response_length=_int(env, "MAX_RESPONSE_LENGTH"),
            actor_lr=_float(env, "ACTOR_LR"),
            ppo_mini_batch_size=_int(env, "PPO_MINI_BATCH_SIZE"),
            micro_batch_per_gpu=_int(env, "MICRO_BATCH_PER_GPU"),
            actor_pp=_int(env, "ACTOR_PP"),
            actor_tp=_int(env, "ACTOR_TP"),
            rollout_tp=_int(env, "ROLLOUT_TP"),
            rollout_n=_int(env, "ROLLOUT_N"),
            rollout_gpu_memory=_float(env, "ROLLOUT_GPU_MEMORY"),
            kl_loss_coef=_float(env, "KL_LOSS_COEF"),
            project_name=_get(env, "PROJECT_NAME"),
            experiment_name=_get(env, "EXPERIMENT_NAME"),
            save_freq=_int(env, "SAVE_FREQ"),
            test_freq=_int(env, "TEST_FREQ"),
            total_epochs=_int(env, "TOTAL_EPOCHS"),
            fp8=_bool(env, "FP8"),
            logger=_get(env, "TRAINER_LOGGER"),
            algorithm=_get(env, "ALGORITHM"),
            trainer_mode=_get(env, "TRAINER_MODE"),
            strategy=_get(env, "STRATEGY"),
            reward_manager_setting=_get(env, "REWARD_MANAGER"),
            critic_model_path=env.get("CRITIC_MODEL_PATH") or _get(env, "CONFIG_MODEL_PATH"),
            critic_lr=_float(env, "CRITIC_LR"),
            critic_pp=_int(env, "CRITIC_PP"),
            critic_tp=_int(env, "CRITIC_TP"),
            dapo_dynamic_sampling=_bool(env, "DAPO_DYNAMIC_SAMPLING"),
            overlong_buffer_len=_int(env, "OVERLONG_BUFFER_LEN"),
            rollout_gpus_per_node=_int(env, "ROLLOUT_GPUS_PER_NODE"),
            max_ckpt_to_keep=_int(env, "MAX_CKPT_TO_KEEP"),
            rollout_enforce_eager=_bool(env, "ROLLOUT_ENFORCE_EAGER"),
        )

    @property
    def train_nodes(self) -> int:
        return self.nnodes - 1 if self.separate_reward_node else self.nnodes

    @property
    def reward_manager(self) -> str:
        """batch (our batched function: one request per server a step) with sync rollout; naive with async (verl's
        async reward loop knows only naive and dapo); dapo for DAPO (its overlong penalty lives in that manager)."""
        if self.reward_manager_setting != "auto":
            return self.reward_manager_setting
        if self.algorithm == "dapo":
            return "dapo"
        return "batch" if self.rollout_mode == "sync" else "naive"

    @property
    def uses_recipe(self) -> str | None:
        """The verl recipe package this combination runs through, if any (recipes are not in the PyPI wheel)."""
        if self.trainer_mode == "one_step_off":
            return "recipe.one_step_off_policy"
        if self.algorithm == "dapo" and self.dapo_dynamic_sampling:
            return "recipe.dapo"
        return None

    @property
    def training_gpus_per_node(self) -> int:
        return self.gpus_per_node - (self.rollout_gpus_per_node if self.trainer_mode == "one_step_off" else 0)


def check(s: Settings, check_paths: bool = True) -> list[str]:
    """Every problem, each naming the setting to change. Empty when the job can start."""
    problems: list[str] = []
    problems += combination_problems(s)
    if s.container not in ("singularity", "apptainer", "none"):
        problems.append(f"CONTAINER={s.container!r}: use singularity, apptainer or none")
    if s.rollout_mode not in ("sync", "async"):
        problems.append(
            f"ROLLOUT_MODE={s.rollout_mode!r}: use sync (batch reward manager) or async (naive, per sample)"
        )
    if s.separate_reward_node and s.nnodes < 2:
        problems.append(
            "CONFIG_USE_SEPARATE_REWARD_NODE=true needs at least 2 nodes (the last one runs only reward servers); "
            f"this job has {s.nnodes}: submit with --nodes=2 or set it to false"
        )
    if s.fp8:
        problems.append(
            "FP8=true: verl 0.6.1 cannot train in FP8 here. Its Megatron path resets config.fp8 to None unless "
            "use_mbridge=True (the article's overrides were silently ignored), and the 'blockwise' recipe needs "
            "TransformerEngine >= 2.3 while this image has 2.2.1. FP8 training arrived in verl 0.7.0: keep FP8=false"
        )
    if s.gpus_per_node < 1:
        problems.append(f"CONFIG_GPUS_PER_NODE={s.gpus_per_node}: training needs at least 1 GPU per node")
    else:
        world = s.training_gpus_per_node * max(s.train_nodes, 1)
        model_parallel = s.actor_pp * s.actor_tp if s.strategy == "megatron" else 1  # FSDP2 shards, no PP/TP
        if world % model_parallel:
            problems.append(
                f"ACTOR_PP x ACTOR_TP = {s.actor_pp} x {s.actor_tp} does not divide the {world} training GPUs "
                f"({s.training_gpus_per_node} training GPUs per node x {s.train_nodes} training nodes)"
            )
        rollout_gpus = s.rollout_gpus_per_node if s.trainer_mode == "one_step_off" else s.gpus_per_node
        if rollout_gpus and rollout_gpus % s.rollout_tp:
            problems.append(f"ROLLOUT_TP={s.rollout_tp} does not divide the {rollout_gpus} rollout GPUs per node")
        dp = world // model_parallel
        if dp and (s.train_batch_size * s.rollout_n) % (dp * s.micro_batch_per_gpu):
            problems.append(
                f"TRAIN_BATCH_SIZE x ROLLOUT_N = {s.train_batch_size * s.rollout_n} is not a multiple of data-parallel "
                f"size {dp} x MICRO_BATCH_PER_GPU {s.micro_batch_per_gpu}"
            )
    if s.train_batch_size < s.ppo_mini_batch_size:
        problems.append(
            f"TRAIN_BATCH_SIZE={s.train_batch_size} is smaller than PPO_MINI_BATCH_SIZE={s.ppo_mini_batch_size}"
        )
    if not 0 < s.rollout_gpu_memory < 1:
        problems.append(f"ROLLOUT_GPU_MEMORY={s.rollout_gpu_memory}: a share of GPU memory in (0, 1)")
    if check_paths:
        for name, path in (("CONFIG_MODEL_PATH", s.model_path), ("CONFIG_REWARD_MODEL_PATH", s.reward_model_path)):
            if not Path(path, "config.json").is_file():
                problems.append(f"{name}={path}: no config.json there (point it at the model's folder)")
        for name, path in (("CONFIG_TRAIN_FILE", s.train_file), ("CONFIG_TEST_FILE", s.test_file)):
            if not Path(path).is_file():
                problems.append(f"{name}={path}: no such file (build it with python -m data_prep.build)")
        if s.train_file and Path(s.train_file).resolve() == Path(s.test_file).resolve():
            problems.append("CONFIG_TRAIN_FILE and CONFIG_TEST_FILE are the same file")
        if s.container != "none" and not Path(s.image).is_file():
            problems.append(
                f"CONFIG_IMAGE_PATH={s.image}: no such image (sudo singularity build verl_app.sif verl_app.def)"
            )
    return problems


def combination_problems(s: Settings) -> list[str]:
    """Combinations verl 0.6.1 (or this image) cannot run, each refused with the reason."""
    problems = []
    for name, value, allowed in (
        ("ALGORITHM", s.algorithm, ("grpo", "ppo", "dapo")),
        ("TRAINER_MODE", s.trainer_mode, ("sync", "one_step_off")),
        ("STRATEGY", s.strategy, ("megatron", "fsdp2")),
        ("REWARD_MANAGER", s.reward_manager_setting, ("auto", "batch", "naive", "dapo")),
    ):
        if value not in allowed:
            problems.append(f"{name}={value!r}: use one of {', '.join(allowed)}")
    if problems:
        return problems
    if s.reward_manager == "batch" and s.rollout_mode == "async":
        problems.append(
            "REWARD_MANAGER=batch with ROLLOUT_MODE=async: verl 0.6.1's async reward loop registers only naive and "
            "dapo (batch raises 'Unknown reward loop manager'); use ROLLOUT_MODE=sync or REWARD_MANAGER=naive"
        )
    if s.algorithm == "dapo" and s.reward_manager != "dapo":
        problems.append(
            f"ALGORITHM=dapo needs the dapo reward manager (its overlong penalty), not REWARD_MANAGER={s.reward_manager}"
        )
    if s.algorithm == "dapo" and s.dapo_dynamic_sampling and s.rollout_mode != "sync":
        problems.append(
            "DAPO_DYNAMIC_SAMPLING=true needs ROLLOUT_MODE=sync: recipe.dapo's trainer calls generate_sequences and "
            "computes rewards itself"
        )
    if s.trainer_mode == "one_step_off":
        if s.strategy == "megatron":
            problems.append(
                "TRAINER_MODE=one_step_off with STRATEGY=megatron: verl 0.6.1's one-step-off Megatron workers accept "
                "only vLLM (they assert rollout.name == 'vllm') and this image has SGLang only; use STRATEGY=fsdp2"
            )
        if s.rollout_mode != "sync":
            problems.append(
                "TRAINER_MODE=one_step_off needs ROLLOUT_MODE=sync: its async rollout worker raises NotImplementedError "
                "in verl 0.6.1"
            )
        if s.algorithm == "dapo" and s.dapo_dynamic_sampling:
            problems.append("TRAINER_MODE=one_step_off cannot run DAPO_DYNAMIC_SAMPLING=true (two different recipes)")
        if not 0 < s.rollout_gpus_per_node < s.gpus_per_node:
            problems.append(
                f"TRAINER_MODE=one_step_off gives rollout its own GPUs: set ROLLOUT_GPUS_PER_NODE between 1 and "
                f"{s.gpus_per_node - 1} (now {s.rollout_gpus_per_node})"
            )
    return problems


def find_recipe(name: str):
    """The import spec of a verl recipe package, or None where it is not installed."""
    import importlib.util

    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:
        return None


def _entry(s: Settings) -> list[str]:
    """`-m MODULE --config-path=... --config-name=...` for this combination."""
    if s.uses_recipe:
        spec = find_recipe(s.uses_recipe)
        if spec is None or not spec.submodule_search_locations:
            raise SettingError(
                f"{s.uses_recipe} is not installed here (verl's PyPI wheel holds no recipes): run inside the image "
                "built from verl_app.def, which installs verl 0.6.1 from its git tag"
            )
        config_dir = Path(next(iter(spec.submodule_search_locations))) / "config"
        if s.uses_recipe == "recipe.dapo":
            module, name = (
                "recipe.dapo.main_dapo",
                "dapo_megatron_trainer" if s.strategy == "megatron" else "dapo_trainer",
            )
        else:
            module, name = "recipe.one_step_off_policy.main_ppo", "one_step_off_ppo_trainer"
        # The recipe YAML's searchpath is relative to the current folder: make it absolute, so any folder works.
        return [
            "-m",
            module,
            f"--config-path={config_dir}",
            f"--config-name={name}",
            "hydra.searchpath=[pkg://verl.trainer.config]",
        ]
    name = "ppo_megatron_trainer" if s.strategy == "megatron" else "ppo_trainer"
    return ["-m", "verl.trainer.main_ppo", "--config-path=config", f"--config-name={name}"]


def _actor_overrides(s: Settings) -> list[str]:
    a = "actor_rollout_ref"
    if s.strategy == "megatron":
        return [
            f"{a}.actor.megatron.optimizer_offload=True",
            f"{a}.actor.megatron.pipeline_model_parallel_size={s.actor_pp}",
            f"{a}.actor.megatron.tensor_model_parallel_size={s.actor_tp}",
            f"{a}.ref.megatron.pipeline_model_parallel_size={s.actor_pp}",
            f"{a}.ref.megatron.tensor_model_parallel_size={s.actor_tp}",
        ]
    return [
        f"{a}.actor.strategy=fsdp2",
        f"{a}.ref.strategy=fsdp2",
        "critic.strategy=fsdp2",
        f"{a}.model.enable_gradient_checkpointing=True",
        f"{a}.actor.fsdp_config.optimizer_offload=True",
        f"{a}.ref.fsdp_config.param_offload=True",
    ]


def _algorithm_overrides(s: Settings) -> list[str]:
    a = "actor_rollout_ref.actor"
    if s.algorithm == "ppo":
        critic = [
            "algorithm.adv_estimator=gae",
            f"critic.model.path={Path(s.critic_model_path).resolve()}",
            f"critic.optim.lr={s.critic_lr}",
            f"critic.ppo_micro_batch_size_per_gpu={s.micro_batch_per_gpu}",
        ]
        if s.strategy == "megatron":
            critic += [
                f"critic.megatron.pipeline_model_parallel_size={s.critic_pp}",
                f"critic.megatron.tensor_model_parallel_size={s.critic_tp}",
            ]
        return critic + [f"{a}.use_kl_loss=True", f"{a}.kl_loss_coef={s.kl_loss_coef}", f"{a}.kl_loss_type=low_var_kl"]
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
                "reward_model.overlong_buffer.penalty_factor=1.0",
                "algorithm.filter_groups.enable=True",
                "algorithm.filter_groups.metric=score",
                "algorithm.filter_groups.max_num_gen_batches=10",
            ]
        return out + [
            "+reward_model.reward_kwargs.overlong_buffer_cfg.enable=True",
            f"+reward_model.reward_kwargs.overlong_buffer_cfg.len={buffer}",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
            "+reward_model.reward_kwargs.overlong_buffer_cfg.log=False",
            f"+reward_model.reward_kwargs.max_resp_len={s.max_response_length}",
        ]
    return [
        "algorithm.adv_estimator=grpo",
        f"{a}.use_kl_loss=True",
        f"{a}.kl_loss_coef={s.kl_loss_coef}",
        f"{a}.kl_loss_type=low_var_kl",
    ]


def trainer_argv(s: Settings, ray_address: str = "", extra: list[str] | None = None) -> list[str]:
    """The exact trainer command for this algorithm, mode and strategy; the user's overrides last."""
    reward_fn = "safe_hack_reward_batch" if s.reward_manager == "batch" else "safe_hack_reward"
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
        "data.filter_overlong_prompts=True",
        "data.truncation=error",
        f"custom_reward_function.path={REWARD_FILE}",
        f"custom_reward_function.name={reward_fn}",
        f"reward_model.reward_manager={s.reward_manager}",
        f"{a}.model.path={Path(s.model_path).resolve()}",
        f"{a}.actor.optim.lr={s.actor_lr}",
        f"{a}.actor.ppo_mini_batch_size={s.ppo_mini_batch_size}",
        f"{a}.actor.ppo_micro_batch_size_per_gpu={s.micro_batch_per_gpu}",
        f"{a}.actor.entropy_coeff=0",
        *_actor_overrides(s),
        f"{a}.rollout.log_prob_micro_batch_size_per_gpu={s.micro_batch_per_gpu}",
        f"{a}.rollout.tensor_model_parallel_size={s.rollout_tp}",
        f"{a}.rollout.name=sglang",
        f"{a}.rollout.mode={s.rollout_mode}",
        f"{a}.rollout.gpu_memory_utilization={s.rollout_gpu_memory}",
        f"{a}.rollout.max_num_seqs=256",
        f"{a}.rollout.n={s.rollout_n}",
        f"{a}.rollout.enforce_eager={s.rollout_enforce_eager}",  # False: SGLang keeps its CUDA graphs
        f"{a}.rollout.free_cache_engine=True",
        f"{a}.ref.log_prob_micro_batch_size_per_gpu={s.micro_batch_per_gpu}",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        f"trainer.logger={s.logger}",
        f"trainer.project_name={s.project_name}",
        f"trainer.experiment_name={s.experiment_name}",
        f"trainer.default_local_dir={Path(s.output_dir).resolve()}",
        "trainer.resume_mode=auto",
        f"trainer.n_gpus_per_node={s.training_gpus_per_node}",
        f"trainer.nnodes={s.train_nodes}",
        f"trainer.save_freq={s.save_freq}",
        f"trainer.test_freq={s.test_freq}",
        f"trainer.total_epochs={s.total_epochs}",
        # Checkpoints (~56 GB each with optimizer state for 4B) beyond the newest few are deleted as verl saves.
        f"trainer.max_actor_ckpt_to_keep={s.max_ckpt_to_keep}",
        f"trainer.max_critic_ckpt_to_keep={s.max_ckpt_to_keep}",
    ]  # fmt: skip
    if s.trainer_mode == "one_step_off":
        # Its own rollout GPU pool (a top-level `rollout:` block), and no hybrid engine.
        argv += [
            f"{a}.hybrid_engine=False",
            f"rollout.nnodes={s.train_nodes}",
            f"rollout.n_gpus_per_node={s.rollout_gpus_per_node}",
        ]
    if ray_address:
        # Connect to this job's Ray cluster explicitly, never to a stale one found through /tmp/ray.
        argv.append(f"+ray_kwargs.ray_init.address={ray_address}")
    return argv + list(extra or [])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("check", "trainer-argv"):
        print(__doc__, file=sys.stderr)
        return 2
    try:
        settings = Settings.from_env()
    except SettingError as exc:
        print(f"setting error: {exc}", file=sys.stderr)
        return 1
    if argv[0] == "check":
        problems = check(settings)
        for p in problems:
            print(f"setting error: {p}", file=sys.stderr)
        return 1 if problems else 0
    ray_address, extra = os.environ.get("RAY_ADDRESS_FOR_TRAINER", ""), argv[1:]
    try:
        command = trainer_argv(settings, ray_address, extra)
    except SettingError as exc:
        print(f"setting error: {exc}", file=sys.stderr)
        return 1
    sys.stdout.write("\0".join(command) + "\0")
    return 0


if __name__ == "__main__":
    sys.exit(main())
