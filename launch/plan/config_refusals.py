"""The refusals of the trainer config that launch/plan/preflight.py composes from the settings with verl's own Hydra
config, the user's extra overrides included (launch/plan/refusals.py refuses the settings themselves): what verl 0.6.1
asserts or silently ignores only at run time, hours in (batches, parallel sizes, rollout keys, what the reward function
is told about the policy's prompt), and Ray's CPUs per node, without which verl waits for ever; each with the rule of
verl 0.6.1 behind its message.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from launch.plan import thinking
from launch.plan.trainer_command import USER_HOOK


def _dp_size(cfg, n_gpus: int) -> int:
    """Data-parallel ranks of the actor, as its workers compute them: Megatron's parallel state is built from the
    actor's sizes (megatron_workers.py, mpu.initialize_model_parallel); FSDP divides by Ulysses sequence parallel."""
    actor = cfg.actor_rollout_ref.actor
    if actor.strategy == "megatron":
        m = actor.megatron
        return n_gpus // (m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size)
    return n_gpus // (actor.get("ulysses_sequence_parallel_size") or 1)


def _update_problems(role: str, section, keys: str, batch: int, dp: int, n: int, fsdp: bool) -> list[str]:
    """The normalisation every verl 0.6.1 worker applies before its first update, and what it asserts then:
    mini = ppo_mini_batch_size * rollout.n // data-parallel size per rank (megatron_workers.py, fsdp_workers.py);
    Megatron's make_iterator asserts it divides the rank's share of the batch (verl/protocol.py), FSDP asserts it is
    a multiple of ppo_micro_batch_size_per_gpu (fsdp_workers.py)."""
    problems = []
    mini, epochs = section.ppo_mini_batch_size, section.ppo_epochs
    if epochs < 1:
        problems.append(f"{keys}.ppo_epochs={epochs}: at least 1 (0 updates nothing, silently)")
    per_rank = mini * n // dp
    if per_rank < 1:
        return problems + [
            f"{keys}.ppo_mini_batch_size={mini} (PPO_MINI_BATCH_SIZE) x rollout.n={n} = {mini * n} sequences is less "
            f"than one per data-parallel rank ({dp}): verl's {role} worker would get empty mini-batches (FSDP asserts, "
            "Megatron's DataLoader refuses batch size 0)"
        ]
    if mini * n % dp:
        problems.append(
            f"{keys}.ppo_mini_batch_size={mini} (PPO_MINI_BATCH_SIZE) x rollout.n={n} = {mini * n} sequences does not "
            f"split over {dp} data-parallel ranks: verl rounds each rank's mini-batch down to {per_rank}, "
            f"a different mini-batch from the one set"
        )
    if batch % dp == 0 and (batch // dp) % per_rank:
        problems.append(
            f"{keys}.ppo_mini_batch_size={mini} (PPO_MINI_BATCH_SIZE) does not divide data.train_batch_size "
            f"(TRAIN_BATCH_SIZE): each of {dp} data-parallel ranks gets {batch // dp} sequences a step and updates "
            f"in mini-batches of {per_rank}; verl 0.6.1 "
            + (
                "asserts they divide at the first update (verl/protocol.py make_iterator)"
                if not fsdp
                else "leaves a short last mini-batch whose gradient is scaled as a full one (dp_actor/dp_critic)"
            )
        )
    micro = section.get("ppo_micro_batch_size_per_gpu")
    if fsdp and micro is not None and per_rank % micro:
        problems.append(
            f"{keys}.ppo_micro_batch_size_per_gpu={micro} (MICRO_BATCH_PER_GPU) does not divide the mini-batch per "
            f"rank, {per_rank} (PPO_MINI_BATCH_SIZE x ROLLOUT_N / {dp} ranks): verl's FSDP {role} worker asserts it"
        )
    return problems


def batch_problems(cfg) -> list[str]:
    """Every batch relation verl 0.6.1 asserts only at run time (after the queue, the model load and the first
    rollout), checked on the final composed config, so extra Hydra overrides count. Each names the keys and
    settings to change."""
    return _update_relation_problems(cfg) + agent_loop_problems(cfg)


def agent_loop_problems(cfg) -> list[str]:
    """Async rollout: the agent loop cuts every training step's batch (prompts x rollout.n, unpadded) into one equal
    part per worker, rollout.agent.num_workers of them (verl/experimental/agent_loop/agent_loop.py:734, 764), and
    DataProto.chunk asserts equal parts (verl/protocol.py:880-883) unless VERL_AUTO_PADDING is on. Validation pads to
    the worker count itself (ray_trainer.py:581-587), training does not: a batch that does not divide stops the job
    at its first step, after the model load and the rollout engine's start."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.mode != "async" or os.environ.get("VERL_AUTO_PADDING", "FALSE").upper() in ("TRUE", "1"):
        return []
    workers, n, prompts = rollout.agent.num_workers, rollout.n, cfg.data.train_batch_size
    if workers < 1:
        return [
            f"actor_rollout_ref.rollout.agent.num_workers={workers}: async rollout needs at least 1 agent loop worker"
        ]
    total = prompts * n
    if total % workers == 0:
        return []
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    fewer = max((d for d in divisors if d < workers), default=None)
    more = min((d for d in divisors if d > workers), default=None)
    other_workers = " or ".join(str(d) for d in (fewer, more) if d is not None)
    return [
        f"data.train_batch_size={prompts} (TRAIN_BATCH_SIZE) x rollout.n={n} (ROLLOUT_N) = {total} sequences do not "
        f"split over the agent loop's {workers} workers (actor_rollout_ref.rollout.agent.num_workers): async rollout "
        "cuts every step's batch into equal parts, one per worker, and verl 0.6.1 asserts it at the first step "
        f"(agent_loop.py generate_sequences, DataProto.chunk), after the model load; set TRAIN_BATCH_SIZE x ROLLOUT_N "
        f"to a multiple of {workers}, or override actor_rollout_ref.rollout.agent.num_workers with {other_workers}, "
        f"which divide {total}"
    ]


def _update_relation_problems(cfg) -> list[str]:
    """The relations of the batch (data.train_batch_size prompts a step) to the ranks and mini-batches."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic

    arr, problems = cfg.actor_rollout_ref, []
    n, prompts = arr.rollout.n, cfg.data.train_batch_size
    batch, n_gpus = prompts * n, cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    dp = _dp_size(cfg, n_gpus)
    if dp < 1:
        return [
            f"{n_gpus} training GPUs (trainer.n_gpus_per_node x trainer.nnodes) hold no data-parallel rank of the "
            "actor's parallel sizes (ACTOR_PP x ACTOR_TP)"
        ]
    if cfg.trainer.get("balance_batch", True) and batch % n_gpus:
        problems.append(
            f"data.train_batch_size={prompts} (TRAIN_BATCH_SIZE) x rollout.n={n} (ROLLOUT_N) = {batch} sequences do "
            f"not split evenly over the {n_gpus} training GPUs: verl's trainer balances every step over all of them "
            "(trainer.balance_batch; seqlen_balancing.get_seqlen_balanced_partitions asserts equal parts)"
        )
    elif batch % dp:
        problems.append(
            f"data.train_batch_size={prompts} (TRAIN_BATCH_SIZE) x rollout.n={n} (ROLLOUT_N) = {batch} sequences do "
            f"not split over {dp} data-parallel ranks (verl/protocol.py DataProto.chunk asserts it)"
        )
    fsdp, critic_used = arr.actor.strategy != "megatron", need_critic(cfg)
    problems += _update_problems("actor", arr.actor, "actor_rollout_ref.actor", batch, dp, n, fsdp)
    if critic_used:
        critic = cfg.critic
        # A Megatron critic shares the actor's process and its parallel state (megatron_workers.py).
        critic_dp = dp if not fsdp else n_gpus // (critic.get("ulysses_sequence_parallel_size") or 1)
        problems += _update_problems("critic", critic, "critic", batch, critic_dp, critic.rollout_n, fsdp)
    seq = cfg.data.max_prompt_length + cfg.data.max_response_length
    # (section, its dynamic-batching switch, the prefix of its token budget and micro-batch keys)
    budgets = [
        ("actor_rollout_ref.actor", arr.actor.use_dynamic_bsz, "ppo"),
        ("actor_rollout_ref.rollout", arr.rollout.log_prob_use_dynamic_bsz, "log_prob"),
        ("actor_rollout_ref.ref", arr.ref.log_prob_use_dynamic_bsz, "log_prob"),
    ]
    if critic_used:
        budgets += [
            ("critic", cfg.critic.use_dynamic_bsz, "ppo"),
            ("critic", cfg.critic.use_dynamic_bsz, "forward"),
        ]
    for keys, dynamic, kind in budgets:
        section = OmegaConf.select(cfg, keys)
        budget = f"{kind}_max_token_len_per_gpu"
        micro = f"{kind}_micro_batch_size_per_gpu"
        if dynamic and section.get(budget) is not None and section[budget] < seq:
            problems.append(
                f"{keys}.{budget}={section[budget]} is less than one whole sequence, data.max_prompt_length + "
                f"data.max_response_length = {seq} tokens: verl's dynamic batching asserts it "
                "(seqlen_balancing.rearrange_micro_batches)"
            )
        if not dynamic and section.get(micro) is not None and section[micro] < 1:
            problems.append(f"{keys}.{micro}={section[micro]} (MICRO_BATCH_PER_GPU): at least 1")
    return problems


# The keys of Megatron's parallel state, set once per process from the actor (megatron_workers.py).
MEGATRON_PARALLEL_KEYS = (
    "tensor_model_parallel_size",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
)


def parallel_problems(cfg) -> list[str]:
    """Ref and critic sizes that differ from the actor's. verl 0.6.1 places actor, ref and critic in one process per
    GPU and initialises Megatron's parallel state once, from the actor; the others only read it, so their own sizes
    would be a label that the run does not follow."""
    from verl.trainer.ppo.utils import need_critic

    if cfg.actor_rollout_ref.actor.strategy != "megatron":
        return []
    actor = cfg.actor_rollout_ref.actor.megatron
    others = [("actor_rollout_ref.ref", cfg.actor_rollout_ref.ref.megatron)]
    if need_critic(cfg):
        others.append(("critic", cfg.critic.megatron))
    return [
        f"{name}.megatron.{key}={section.get(key)} differs from actor_rollout_ref.actor.megatron.{key}="
        f"{actor.get(key)}: verl 0.6.1 sets Megatron's parallel state once per process, from the actor "
        "(verl/workers/megatron_workers.py), so this size would be ignored; drop the override"
        for name, section in others
        for key in MEGATRON_PARALLEL_KEYS
        if section.get(key) != actor.get(key)
    ]


# The Ray hooks that register the HF rollout of the CPU runs (cpu/verl_shims.py; cpu/megatron_shims.py calls it), which
# the job's own hook calls first (USER_HOOK); the stall test's own comes after them (CPU_RUN_THEN_HOOK).
CPU_HOOKS = ("cpu.verl_shims.install", "cpu.megatron_shims.install", "cpu.megatron_shims.install_gpu")


def rollout_problems(cfg) -> list[str]:
    """Rollout keys the engine would silently ignore. verl 0.6.1's sync SGLang engine builds its arguments without
    enforce_eager and drops every engine_kwargs.sglang key but attention_backend (sglang_rollout.py:426-477); only
    the async server reads them (async_sglang_server.py:126-157)."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "hf":
        runtime_env = cfg.get("ray_kwargs", {}).get("ray_init", {}).get("runtime_env", {})
        hooks = {runtime_env.get("worker_process_setup_hook"), runtime_env.get("env_vars", {}).get(USER_HOOK)}
        if not hooks & set(CPU_HOOKS):
            return [
                "actor_rollout_ref.rollout.name=hf: verl 0.6.1 registers no such engine "
                "(verl/workers/rollout/base.py:81-86); "
                "only the CPU runs of make demo and the tests have one, which cpu/verl_shims.py registers in every Ray "
                "worker: pass all of its overrides (python -m cpu.verl_shims lists them; python -m cpu.megatron_shims "
                "for STRATEGY=megatron), or on GPUs ROLLOUT_ENGINE=sglang|vllm"
            ]
        return []
    if rollout.name != "sglang" or rollout.mode != "sync":
        return []
    problems = []
    if rollout.enforce_eager:
        problems.append(
            "actor_rollout_ref.rollout.enforce_eager=True (ROLLOUT_ENFORCE_EAGER) with sync SGLang rollout: verl "
            "0.6.1's "
            "sync SGLang engine never passes it on (no disable_cuda_graph, sglang_rollout.py:426-477); use async "
            "rollout "
            "or vLLM, or drop it"
        )
    ignored = sorted(
        k for k, v in (rollout.engine_kwargs.get("sglang") or {}).items() if v is not None and k != "attention_backend"
    )
    if ignored:
        problems.append(
            f"actor_rollout_ref.rollout.engine_kwargs.sglang.{{{', '.join(ignored)}}} with sync SGLang rollout: verl "
            "0.6.1's "
            "sync SGLang engine reads only attention_backend from engine_kwargs (sglang_rollout.py:426-430); use async "
            "rollout, whose server passes them all, or drop them"
        )
    return problems


def thinking_problems(cfg, setting: str) -> list[str]:
    """The prompt_opens_think the reward function gets (REWARD_PROMPT_OPENS_THINK, or an extra override of it) against
    what the policy's chat template does with the job's data.apply_chat_template_kwargs (launch/plan/thinking.py): a
    thinking policy told false scores cut-off reasoning as answers; a policy told true that opens no block gets the
    penalty on every answer without `</think>`, from the first step."""
    told = (cfg.custom_reward_function.get("reward_kwargs") or {}).get("prompt_opens_think")
    kwargs = dict(cfg.data.get("apply_chat_template_kwargs") or {})
    opens = thinking.template_opens_think(cfg.actor_rollout_ref.model.path, kwargs)
    if told is None or bool(told) == opens:
        return []
    given = f" with data.apply_chat_template_kwargs={kwargs}" if kwargs else ""
    return [
        f"REWARD_PROMPT_OPENS_THINK={setting} tells the reward function prompt_opens_think={bool(told)}, but the "
        f"policy's chat template{given} {thinking.describe(opens)} (CONFIG_MODEL_PATH="
        f"{cfg.actor_rollout_ref.model.path}): "
        + (
            "responses start mid-reasoning and hold only </think>, so cut-off reasoning would be scored as an answer"
            if opens
            else "every answer without </think> would get the penalty"
        )
        + f"; set REWARD_PROMPT_OPENS_THINK={'true' if opens else 'false'} (or auto)"
    ]


# --- Ray's CPUs on each node ------------------------------------------------------------------------------------------

# verl 0.6.1's rollout servers for async rollout: one Ray actor of num_cpus=1 per node of each replica, pinned to that
# node (async_sglang_server.py:50, 300-306; vllm_async_server.py:444, 520-525). The CPU runs' `hf` replica serves
# from the hybrid worker itself (cpu/verl_shims.py) and starts none.
SERVER_ENGINES = ("sglang", "vllm")


def ray_cpus_needed(cfg) -> tuple[int, list[str]]:
    """The Ray CPUs verl 0.6.1 holds on a node for the whole run, and what holds them. Every node gets the same
    (`ray start --num-cpus=RAY_NUM_CPUS`), and Ray may put the TaskRunner on any of them, so each needs room for it.
    verl's other actors (agent-loop and reward-loop workers) are Ray's default actors, which hold no CPU."""
    gpus = cfg.trainer.n_gpus_per_node
    parts = [
        "1 for verl's TaskRunner (main_ppo.py:77, ray.remote(num_cpus=1))",
        f"{gpus} for its workers' placement bundles, 1 CPU beside each GPU (ray_trainer.py:88, max_colocate_count=1; "
        "single_controller/ray/base.py:122)",
    ]
    need = 1 + gpus
    rollout_gpus = (cfg.get("rollout") or {}).get("n_gpus_per_node")  # the one-step-off recipe's own pool
    if rollout_gpus:
        parts.append(f"{rollout_gpus} for its rollout pool's bundles (rollout.n_gpus_per_node, one-step-off recipe)")
        need += rollout_gpus
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.mode == "async" and rollout.name in SERVER_ENGINES:
        world = rollout.tensor_model_parallel_size * rollout.data_parallel_size * rollout.pipeline_model_parallel_size
        servers = gpus // min(gpus, world)
        parts.append(
            f"{servers} for its {rollout.name} servers, one per rollout replica on the node (async rollout, "
            f"{world} GPU(s) a replica: replica.py:91-100, async_sglang_server.py:50, vllm_async_server.py:444)"
        )
        need += servers
    return need, parts


def ray_cpu_problems(cfg, env: Mapping[str, str]) -> list[str]:
    """RAY_NUM_CPUS (the run script's: the job's --cpus-per-task) against what verl holds on a node. With fewer, verl
    waits for its placement group (ray.get(pg.ready()) without a timeout, single_controller/ray/base.py:136) or for
    a rollout server's actor for ever, printing nothing: the job would sit in its allocation until the time limit."""
    if not env.get("RAY_NUM_CPUS", "").isdigit():
        return []  # only the run script knows the node's CPUs; it exports them, refusing what is not a whole number
    cpus = int(env["RAY_NUM_CPUS"])
    need, parts = ray_cpus_needed(cfg)
    if cpus >= need:
        return []
    source = env.get("RAY_NUM_CPUS_FROM") or "RAY_NUM_CPUS"
    return [
        f"RAY_NUM_CPUS={cpus} Ray CPUs per node ({source}), but verl 0.6.1 holds {need} on a node: {'; '.join(parts)}. "
        "With fewer it waits for ever for its workers' placement, without a message "
        f"(verl/single_controller/ray/base.py:136): give each node at least {need} (#SBATCH --cpus-per-task={need} "
        f"or more in run_grpo_qwen3_4b_mega_verl.sh, or sbatch --cpus-per-task={need}; outside Slurm "
        f"RAY_NUM_CPUS={need})"
    ]
