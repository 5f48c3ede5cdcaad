"""Every refusal of a setting, each naming the setting to change, with the rule of verl 0.6.1 (or the image) behind it;
launch/plan/config_refusals.py refuses the trainer config composed from the settings. launch/plan/preflight.py runs
both, cheapest first, on the login node (PREFLIGHT_ONLY=1 bash run_grpo_qwen3_4b_mega_verl.sh) and again inside the
allocation, and prints each problem here as `setting error: ...`. What is refused elsewhere (in bash before the
container starts, on each node once the job runs), and why there: docs/operations.md#a-jobs-life.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path

from launch.plan import thinking
from launch.plan.deadline import StallError, preemption, signal_lead, timeout_setting
from launch.plan.settings import SGLANG_MAX_GPUS, SettingError, Settings
from launch.plan.trainer_command import RECOMPUTE
from reward_score.server.settings import CHOICES as REWARD_FORMAT_CHOICES  # plain data: no torch
from reward_score.server.settings import Settings as RewardServerSettings


def check(s: Settings, check_paths: bool = True) -> list[str]:
    """Every problem, each naming the setting to change. Empty when the job can start."""
    problems = combination_problems(s) + reward_gpu_problems(s) + save_deadline_setting_problems(s) + job_problems(s)
    problems += gpu_batch_problems(s) + algorithm_problems(s) + reward_setting_problems(s) + stall_problems(s)
    problems += validation_sampling_problems(s)
    return problems + (path_problems(s) if check_paths else [])


def job_problems(s: Settings) -> list[str]:
    """What runs the job and where: SGLang's ports on a node, a separate reward node, the card's memory."""
    problems: list[str] = []
    if s.rollout_engine == "sglang" and s.gpus_per_node > SGLANG_MAX_GPUS:
        problems.append(
            f"CONFIG_GPUS_PER_NODE={s.gpus_per_node} with ROLLOUT_ENGINE=sglang: a job's port block holds the ports "
            f"verl's SGLang engines take (two per GPU) for at most {SGLANG_MAX_GPUS} GPUs per node"
        )
    if s.separate_reward_node and s.nnodes < 2:
        problems.append(
            "CONFIG_USE_SEPARATE_REWARD_NODE=true needs at least 2 nodes (the last one runs only reward servers); "
            f"this job has {s.nnodes}: submit with --nodes=2 or set it to false"
        )
    if s.separate_reward_node and not s.uses_reward_model:
        problems.append(
            "CONFIG_USE_SEPARATE_REWARD_NODE=true with REWARD=rule: that node would idle, since rule "
            "rewards need no reward server; set it to false, or REWARD=rm+rule"
        )
    if s.gpu_memory_gib_setting != "auto":
        try:
            gib = float(s.gpu_memory_gib_setting)
        except ValueError:
            gib = 0.0
        if not gib > 0:
            problems.append(
                f"CONFIG_GPU_MEMORY_GIB={s.gpu_memory_gib_setting!r}: use auto (the GPU the preflight sees) or the "
                "card's memory in GiB, as torch reports it (an 80 GB H100: 79.2)"
            )
    return problems


def gpu_batch_problems(s: Settings) -> list[str]:
    """GPU and batch arithmetic: the parallel sizes divide the GPUs, a step holds a mini-batch."""
    problems: list[str] = []
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
        # How each step splits over the GPUs and ranks is config_refusals.batch_problems', on the composed config.
    if s.train_batch_size < s.ppo_mini_batch_size:
        problems.append(
            f"TRAIN_BATCH_SIZE={s.train_batch_size} is smaller than PPO_MINI_BATCH_SIZE={s.ppo_mini_batch_size}"
        )
    return problems


def algorithm_problems(s: Settings) -> list[str]:
    """The settings of one algorithm only (DAPO's overlong buffer and penalty, PPO's critic value clip), and
    ROLLOUT_GPU_MEMORY."""
    problems: list[str] = []
    if s.algorithm == "dapo" and not 0 <= s.overlong_buffer_len <= s.max_response_length:
        problems.append(
            f"OVERLONG_BUFFER_LEN={s.overlong_buffer_len}: between 0 (a quarter of the response) and "
            f"MAX_RESPONSE_LENGTH={s.max_response_length} (verl's dapo manager asserts it when it starts)"
        )
    # The numbers the properties read refuse what they cannot use (launch/plan/settings.py)
    used = {"dapo": ["overlong_penalty_factor"], "ppo": ["critic_cliprange_value"]}.get(s.algorithm, [])
    for name in ("rollout_gpu_memory", *used):
        try:
            getattr(s, name)
        except SettingError as exc:
            problems.append(str(exc))
    return problems


def reward_setting_problems(s: Settings) -> list[str]:
    """The reward model's input format, how the reward reads <think>, and the reward servers' restarts."""
    problems: list[str] = []
    for name, value, allowed in (
        ("CONFIG_REWARD_INPUT", s.reward_input, REWARD_FORMAT_CHOICES["input"]),
        ("CONFIG_REWARD_ADD_SPECIAL_TOKENS", s.reward_add_special_tokens, REWARD_FORMAT_CHOICES["add_special_tokens"]),
        ("CONFIG_REWARD_CHAT_TEMPLATE", s.reward_chat_template, REWARD_FORMAT_CHOICES["chat_template"]),
        ("CONFIG_REWARD_APPEND_EOS", s.reward_append_eos, REWARD_FORMAT_CHOICES["append_eos"]),
    ):
        if value not in allowed:
            problems.append(
                f"{name}={value!r}: use {' or '.join(allowed)} (python -m reward_score.check_format MODEL PAIRS says "
                "which the reward model needs)"
            )
    if s.prompt_opens_think_setting not in thinking.CHOICES:
        problems.append(
            f"REWARD_PROMPT_OPENS_THINK={s.prompt_opens_think_setting!r}: use auto (read from the policy's chat "
            "template), true or false"
        )
    if s.reward_restarts < 0:
        problems.append(f"REWARD_RESTARTS={s.reward_restarts}: restarts of a reward server that dies, 0 or more")
    return problems


def stall_problems(s: Settings) -> list[str]:
    """The stall watchdog's timeout and its floors."""
    problems: list[str] = []
    try:
        timeout_setting(s.stall_timeout_setting)
    except StallError as exc:
        problems.append(str(exc))
    for name, value in (("STALL_FLOOR", s.stall_floor), ("STALL_FIRST_STEP", s.stall_first_step)):
        if value < 1:
            problems.append(f"{name}={value}: the seconds the stall watchdog allows, 1 or more")
    return problems


def path_problems(s: Settings) -> list[str]:
    """The files the settings point at: the models and the data (the image is the run script's to refuse)."""
    problems: list[str] = []
    for name, path in (("CONFIG_MODEL_PATH", s.model_path), ("CONFIG_REWARD_MODEL_PATH", s.reward_model_path)):
        if not Path(path, "config.json").is_file() and (name == "CONFIG_MODEL_PATH" or s.uses_reward_model):
            problems.append(f"{name}={path}: no config.json there (point it at the model's folder)")
    for name, path in (("CONFIG_TRAIN_FILE", s.train_file), ("CONFIG_TEST_FILE", s.test_file)):
        if not Path(path).is_file():
            problems.append(f"{name}={path}: no such file (build it with python -m data_prep.build)")
    if s.train_file and Path(s.train_file).resolve() == Path(s.test_file).resolve():
        problems.append("CONFIG_TRAIN_FILE and CONFIG_TEST_FILE are the same file")
    return problems


def model_positions(path: str) -> int | None:
    """The most tokens a sequence may hold for the model at `path`, as verl 0.6.1's rollout reads its config.json
    (sglang_rollout.py and vllm_rollout_spmd.py `_verify_config`): max_position_embeddings (top level, else under
    llm_config or text_config) times rope_scaling's factor. The engines' own limits can be lower with rope_scaling, so
    this is the least the job needs. None where the file or the figure is missing."""
    try:
        config = json.loads(Path(path, "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    positions = next(
        (
            c.get("max_position_embeddings")
            for c in (config, config.get("llm_config"), config.get("text_config"))
            if isinstance(c, dict) and isinstance(c.get("max_position_embeddings"), int)
        ),
        None,
    )
    if positions is None:
        return None
    rope = config.get("rope_scaling")
    factor = rope.get("factor", 1.0) if isinstance(rope, dict) else 1.0
    return int(positions * factor) if isinstance(factor, (int, float)) and factor > 0 else positions


def sbatch_header(text: str) -> dict[str, tuple[int, str]]:
    """A script's #SBATCH options, as sbatch reads them: option -> (line number, value), the first of each."""
    found: dict[str, tuple[int, str]] = {}
    for n, line in enumerate(text.splitlines(), 1):
        if m := re.match(r"#SBATCH --([a-z-]+)=(\S+)", line):
            found.setdefault(m.group(1), (n, m.group(2)))
    return found


def header_problems(text: str, environ: Mapping[str, str], name: str = "run_grpo_qwen3_4b_mega_verl.sh") -> list[str]:
    """The login-node check (PREFLIGHT_ONLY=1 outside a job; inside one the run script holds Slurm's own count against
    it): the script's #SBATCH --gpus-per-node against CONFIG_GPUS_PER_NODE as its settings block sets it, both lines
    of the file a user edits; otherwise the job would find out after the queue. A value from the environment is
    the user's own (sbatch --gpus-per-node may go with it), so not refused."""
    (line, value), setting = sbatch_header(text).get("gpus-per-node", (0, "")), environ.get("CONFIG_GPUS_PER_NODE", "")
    block = re.search(r'^CONFIG_GPUS_PER_NODE="\$\{CONFIG_GPUS_PER_NODE:-(\d+)\}"', text, flags=re.M)
    gpus = value.rsplit(":", 1)[-1]  # gpu:4 or h100:4 too
    if not (block and setting == block.group(1) and gpus.isdigit()) or gpus == setting:
        return []
    return [
        f"CONFIG_GPUS_PER_NODE={setting}, but line {line} of {name}, #SBATCH --gpus-per-node={value}, gives each "
        f"node {gpus}: change line {line} to #SBATCH --gpus-per-node={setting} (or CONFIG_GPUS_PER_NODE to "
        f"{gpus}); the job would be refused only after its wait in the queue"
    ]


def context_problems(s: Settings, environ: Mapping[str, str]) -> list[str]:
    """MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH against the positions the models have: the policy's (verl's rollout
    asserts it after the queue), and a REWARD_MAX_LENGTH past the reward model's where the pairs reach past them
    (positions it never learned: docs/reward.md). The reward template's few tokens are not counted."""
    problems, sequence = [], s.max_prompt_length + s.max_response_length
    policy = model_positions(s.model_path)
    if policy is not None and sequence > policy:
        problems.append(
            f"MAX_PROMPT_LENGTH={s.max_prompt_length} + MAX_RESPONSE_LENGTH={s.max_response_length} = {sequence} "
            f"tokens, but the policy has {policy} positions (CONFIG_MODEL_PATH={s.model_path}/config.json), which "
            f"verl's rollout asserts after the queue: lower them until their sum is at most {policy}"
        )
    raw = environ.get("REWARD_MAX_LENGTH", "")
    try:
        reward_max = int(raw) if raw else RewardServerSettings.max_length
    except ValueError:
        return problems  # the reward server names a malformed REWARD_MAX_LENGTH itself
    reward = model_positions(s.reward_model_path) if s.uses_reward_model else None
    if reward is not None and reward_max > reward and sequence > reward:
        problems.append(
            f"REWARD_MAX_LENGTH={reward_max} is above the reward model's {reward} positions (CONFIG_REWARD_MODEL_PATH="
            f"{s.reward_model_path}/config.json), and prompt + response = {sequence} tokens reach past them, positions "
            f"it never learned: set REWARD_MAX_LENGTH={reward} (longer pairs keep their last tokens)"
        )
    return problems


def validation_sampling_problems(s: Settings) -> list[str]:
    """VAL_* as verl 0.6.1 applies them: sync rollout reads do_sample, then top_k, top_p and temperature
    (sglang_rollout.py:703-727, the same in vLLM's); async rollout's agent loop reads only temperature and top_p
    (agent_loop.py:341-343), so do_sample=false there would still sample."""
    problems = []
    if s.val_temperature < 0:
        problems.append(f"VAL_TEMPERATURE={s.val_temperature}: 0 (greedy) or more")
    if not 0 < s.val_top_p <= 1:
        problems.append(f"VAL_TOP_P={s.val_top_p}: a share of the probability mass in (0, 1]")
    if s.val_top_k == 0 or s.val_top_k < -1:
        problems.append(f"VAL_TOP_K={s.val_top_k}: -1 (off) or 1 or more (SGLang and vLLM refuse 0)")
    if not s.val_do_sample and s.rollout_mode == "async" and s.val_temperature > 0:
        problems.append(
            f"VAL_DO_SAMPLE=false with ROLLOUT_MODE=async: verl 0.6.1's agent loop never reads do_sample and would "
            f"sample at VAL_TEMPERATURE={s.val_temperature}; for greedy validation set VAL_TEMPERATURE=0 as well"
        )
    if s.val_do_sample and s.val_temperature == 0:
        problems.append(
            "VAL_DO_SAMPLE=true with VAL_TEMPERATURE=0 decodes greedily all the same: set a temperature (the Qwen3 "
            "thinking cards: 0.6), or VAL_DO_SAMPLE=false to say greedy"
        )
    return problems


def combination_problems(s: Settings) -> list[str]:
    """Combinations verl 0.6.1 (or this image) cannot run, each refused with the reason."""
    problems = []
    for name, value, allowed in (
        ("CONTAINER", s.container, ("singularity", "apptainer", "none")),
        ("ROLLOUT_MODE", s.rollout_mode, ("sync", "async")),
        ("ALGORITHM", s.algorithm, ("grpo", "ppo", "dapo")),
        ("TRAINER_MODE", s.trainer_mode, ("sync", "one_step_off")),
        ("STRATEGY", s.strategy, ("megatron", "fsdp2")),
        ("REWARD_MANAGER", s.reward_manager_setting, ("auto", "batch", "naive", "dapo")),
        ("ROLLOUT_ENGINE", s.rollout_engine, ("sglang", "vllm")),
        ("MEGATRON_RECOMPUTE", s.megatron_recompute_setting, ("auto", *RECOMPUTE)),
        ("OPTIMIZER_OFFLOAD", s.optimizer_offload_setting, ("auto", "on", "off")),
        ("VAL_BEFORE_TRAIN", s.val_before_train_setting, ("auto", "true", "false")),
        ("FUSED_KERNELS", s.fused_kernels_setting, ("auto", "on", "off")),
    ):
        if value not in allowed:
            problems.append(f"{name}={value!r}: use one of {', '.join(allowed)}")
    if problems:
        return problems
    if s.fused_kernels_setting == "on" and s.strategy == "fsdp2":
        problems.append(
            "FUSED_KERNELS=on, but STRATEGY=fsdp2 keeps verl's logits: set FUSED_KERNELS=auto or off, or "
            "STRATEGY=megatron"
        )
    if s.reward_manager == "batch" and s.rollout_mode == "async":
        problems.append(
            "REWARD_MANAGER=batch with ROLLOUT_MODE=async: verl 0.6.1's async reward loop registers only naive and "
            "dapo (batch raises 'Unknown reward loop manager'); use ROLLOUT_MODE=sync or REWARD_MANAGER=naive"
        )
    if s.algorithm == "dapo" and s.reward_manager != "dapo":
        problems.append(
            "ALGORITHM=dapo needs the dapo reward manager (its overlong penalty), not "
            f"REWARD_MANAGER={s.reward_manager}"
        )
    if s.algorithm == "dapo" and s.dapo_dynamic_sampling and s.rollout_mode != "sync":
        problems.append(
            "DAPO_DYNAMIC_SAMPLING=true needs ROLLOUT_MODE=sync: recipe.dapo's trainer calls generate_sequences and "
            "computes rewards itself"
        )
    if s.algorithm == "ppo" and s.strategy == "megatron":
        for name, value, actor_name, actor in (
            ("CRITIC_PP", s.critic_pp, "ACTOR_PP", s.actor_pp),
            ("CRITIC_TP", s.critic_tp, "ACTOR_TP", s.actor_tp),
        ):
            if value is not None and value != actor:
                problems.append(
                    f"{name}={value} differs from {actor_name}={actor}: verl 0.6.1 sets Megatron's parallel state "
                    "once, "
                    "from the actor (verl/workers/megatron_workers.py; actor, ref and critic share one process per "
                    f"GPU), so the critic runs with the actor's sizes whatever it says; unset {name}"
                )
    if s.trainer_mode == "one_step_off":
        if s.rollout_engine != "vllm":
            problems.append(
                f"TRAINER_MODE=one_step_off with ROLLOUT_ENGINE={s.rollout_engine}: verl 0.6.1's one-step-off recipe "
                "builds its weight-sync group in recipe/one_step_off_policy/distributed_util.py, which imports "
                "vllm.distributed (pynccl, StatelessProcessGroup) whatever the engine, and the SGLang image has no "
                "vLLM; use ROLLOUT_ENGINE=vllm with the vLLM image, or TRAINER_MODE=sync"
            )
        if s.rollout_mode != "sync":
            problems.append(
                "TRAINER_MODE=one_step_off needs ROLLOUT_MODE=sync: its async rollout worker raises "
                "NotImplementedError "
                "in verl 0.6.1 (and its Megatron rollout worker asserts rollout.mode == 'sync')"
            )
        if s.algorithm == "dapo" and s.dapo_dynamic_sampling:
            problems.append("TRAINER_MODE=one_step_off cannot run DAPO_DYNAMIC_SAMPLING=true (two different recipes)")
        if not 0 < s.rollout_gpus_per_node < s.gpus_per_node:
            problems.append(
                f"TRAINER_MODE=one_step_off gives rollout its own GPUs: set ROLLOUT_GPUS_PER_NODE between 1 and "
                f"{s.gpus_per_node - 1} (now {s.rollout_gpus_per_node})"
            )
    return problems


def reward_gpu_problems(s: Settings) -> list[str]:
    """Reward servers on some of the GPUs a tensor-parallel SGLang rollout runs on: SGLang's memory-balance check
    stops it (docs/training.md, GPU memory per role); a server on every GPU of the node, or none, passes."""
    if (
        s.separate_reward_node
        or s.reward_device != "cuda"
        or s.rollout_engine != "sglang"
        or s.rollout_tp < 2
        or s.trainer_mode != "sync"
        or s.sglang_memory_check_off
        or not s.uses_reward_model
    ):
        return []
    indices = {g.strip() for g in s.reward_gpus.split(",") if g.strip()}
    every = {str(g) for g in range(s.gpus_per_node)}
    if not indices or indices == every:
        return []  # no server on a GPU, or one on each (an index beyond the job's GPUs: launch/job/node.py refuses)
    return [
        f"ROLLOUT_TP={s.rollout_tp} with reward servers on GPU {s.reward_gpus} of {s.gpus_per_node} "
        "(CONFIG_REWARD_GPUS): SGLang would stop with 'The memory capacity is unbalanced'. Put a server on every GPU "
        f"(CONFIG_REWARD_GPUS={','.join(sorted(every, key=int))}), CONFIG_USE_SEPARATE_REWARD_NODE=true, "
        "CONFIG_REWARD_DEVICE=cpu, ROLLOUT_TP=1 or SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK=true"
    ]


def save_deadline_setting_problems(s: Settings) -> list[str]:
    """SAVE_FREQ, ESI_REDUNDANT_TIME and CHECKPOINT_BEFORE_END themselves."""
    problems = []
    if s.esi_redundant_time_setting != "auto":
        try:
            bad = not 0 <= float(s.esi_redundant_time_setting) < math.inf  # nan and inf too
        except ValueError:
            bad = True
        if bad:
            problems.append(f"ESI_REDUNDANT_TIME={s.esi_redundant_time_setting!r}: auto or seconds, 0 or more")
    if s.save_freq_setting != "auto" and not s.save_freq_setting.lstrip("-").isdigit():
        problems.append(f"SAVE_FREQ={s.save_freq_setting!r}: auto or a number of steps (0 or less: no saves)")
    if s.checkpoint_before_end < 0:
        problems.append(f"CHECKPOINT_BEFORE_END={s.checkpoint_before_end}: seconds before the time limit, 0 or more")
    return problems


def save_deadline_problems(s: Settings, env: Mapping[str, str]) -> list[str]:
    """CHECKPOINT_BEFORE_END against the requeue signal, for settings `check` let through: where verl's last save
    would come after the job has requeued itself (the recipes and SAVE_FREQ<=0 never save before the limit, so
    nothing to refuse there)."""
    lead = signal_lead(env)
    if s.uses_recipe or preemption(s, env)[0] <= 0 or lead is None or s.checkpoint_before_end > lead:
        return []
    return [
        f"CHECKPOINT_BEFORE_END={s.checkpoint_before_end} is not above the time-limit signal's lead ({lead} s), at "
        "which the job requeues itself: set CHECKPOINT_BEFORE_END above it by at least a save"
    ]
