"""Every refusal of a setting, in one file: why a job was refused, and the rule of verl 0.6.1 behind each message.

A job is refused before anything starts, on the login node (PREFLIGHT_ONLY=1 bash run_grpo_qwen3_4b_mega_verl.sh)
and again inside the allocation, by launch/plan/preflight.py, which runs these in this order and prints each problem on a
line of its own, naming the setting (or the trainer key and the setting behind it) to change:

1. check(settings): the settings block alone (launch.plan.settings.Settings): values, combinations verl 0.6.1 or the
   image cannot run (combination_problems), GPU and batch arithmetic, the files the settings point at; then
   context_problems(settings, env): prompt + response against the positions in the models' config.json (and the
   reward server's REWARD_MAX_LENGTH); printed as `setting error: ...`.
2. save_deadline_problems(settings, env): CHECKPOINT_BEFORE_END against the job's own time-limit signal;
   printed as `setting error: ...` (launch/plan/deadline.py says what verl will save, and warns).
3. batch_problems(cfg), parallel_problems(cfg), rollout_problems(cfg): the trainer config composed with verl's own
   Hydra config, the user's extra overrides included, for what verl 0.6.1 asserts or silently ignores only at run
   time, hours in; printed as `preflight: verl 0.6.1 would stop at run time: ...`; thinking_problems(cfg, setting):
   what the reward function is told about the policy's prompt against its chat template, printed as `setting error`.
4. ray_cpu_problems(cfg, env): Ray's CPUs per node (the job's --cpus-per-task) against what verl holds on a node,
   without which it waits for ever; printed the same way.

Refused elsewhere, because only there is what they need:
- run_grpo_qwen3_4b_mega_verl.sh, before the container starts (no Python yet): the image file (CONFIG_IMAGE_PATH),
  the container program (CONTAINER), the folders the container binds, Slurm's GPUs per node vs CONFIG_GPUS_PER_NODE.
- launch/plan/preflight.py: verl's own validate_config and Hydra errors, the trainer's imports in the image, the data,
  the reward check (PREFLIGHT_REWARD, PREFLIGHT_REWARD_PAIRS).
- launch/job/node.py, on each node once the job runs: a hand-set port that is taken there, CONFIG_REWARD_GPUS beyond the
  job's GPUs on that node, CONFIG_NETWORK_INTERFACE.
docs/operations.md lists every message the scripts print, with what it means and what to do.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from launch.plan import thinking
from launch.plan.deadline import StallError, signal_lead, timeout_setting
from launch.plan.settings import RECOMPUTE, SGLANG_MAX_GPUS, SettingError, Settings
from reward_score.server.settings import CHOICES as REWARD_FORMAT_CHOICES  # plain data: no torch
from reward_score.server.settings import Settings as RewardServerSettings

# --- 1. the settings block ----------------------------------------------------------------------------------------


def check(s: Settings, check_paths: bool = True) -> list[str]:
    """Every problem, each naming the setting to change. Empty when the job can start."""
    problems: list[str] = []
    problems += combination_problems(s)
    problems += reward_gpu_problems(s)
    if s.rollout_engine == "sglang" and s.gpus_per_node > SGLANG_MAX_GPUS:
        problems.append(
            f"CONFIG_GPUS_PER_NODE={s.gpus_per_node} with ROLLOUT_ENGINE=sglang: a job's port block holds the ports "
            f"verl's SGLang engines take (two per GPU) for at most {SGLANG_MAX_GPUS} GPUs per node (launch/job/node.py: each node's port block)"
        )
    problems += save_deadline_setting_problems(s)
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
        # Both strategies batch by tokens (use_dynamic_bsz), so verl's validate_config asks nothing of the micro-batch:
        # only the per-rank split of each step remains (the preflight checks the rest on the composed config).
        if dp and (s.train_batch_size * s.rollout_n) % dp:
            problems.append(
                f"TRAIN_BATCH_SIZE x ROLLOUT_N = {s.train_batch_size * s.rollout_n} is not a multiple of data-parallel "
                f"size {dp}"
            )
    if s.train_batch_size < s.ppo_mini_batch_size:
        problems.append(
            f"TRAIN_BATCH_SIZE={s.train_batch_size} is smaller than PPO_MINI_BATCH_SIZE={s.ppo_mini_batch_size}"
        )
    if s.algorithm == "dapo" and not 0 <= s.overlong_buffer_len <= s.max_response_length:
        problems.append(
            f"OVERLONG_BUFFER_LEN={s.overlong_buffer_len}: between 0 (a quarter of the response) and "
            f"MAX_RESPONSE_LENGTH={s.max_response_length} (verl's dapo manager asserts it when it starts)"
        )
    if s.algorithm == "dapo":
        try:
            if s.overlong_penalty_factor < 0:
                problems.append(f"OVERLONG_PENALTY_FACTOR={s.overlong_penalty_factor}: a penalty size, 0 or more")
        except SettingError as exc:
            problems.append(str(exc))
    if s.algorithm == "ppo":
        try:
            _ = s.critic_cliprange_value  # the property refuses a non-number, or a value of 0 or less
        except SettingError as exc:
            problems.append(str(exc))
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
    if s.reward_restart_window < 1:
        problems.append(
            f"REWARD_RESTART_WINDOW={s.reward_restart_window}: the seconds REWARD_RESTARTS counts over, 1 or more"
        )
    try:
        timeout_setting(s.stall_timeout_setting)
    except StallError as exc:
        problems.append(str(exc))
    for name, value in (("STALL_FLOOR", s.stall_floor), ("STALL_FIRST_STEP", s.stall_first_step)):
        if value < 1:
            problems.append(f"{name}={value}: the seconds the stall watchdog allows, 1 or more")
    problems += validation_sampling_problems(s)
    try:
        _ = s.rollout_gpu_memory  # the property refuses anything but auto or a share in (0, 1)
    except SettingError as exc:
        problems.append(str(exc))
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


def model_positions(path: str) -> int | None:
    """The most tokens a sequence may hold for the model at `path`, read from its config.json as verl 0.6.1's rollout
    reads it before the engine starts (sglang_rollout.py and vllm_rollout_spmd.py `_verify_config`):
    max_position_embeddings (top level, else under llm_config or text_config), times rope_scaling's factor when the
    config has rope_scaling. Without rope_scaling, the usual case, verl, SGLang and vLLM all stop at
    max_position_embeddings. With it, the engines' own limits can be lower than verl's figure (SGLang drops the factor
    when rope_scaling names original_max_position_embeddings; vLLM counts YaRN from original_max_position_embeddings),
    so this is the least the job needs, not all of it. None where the file or the figure is missing: the model check
    of `check` names a missing config.json, and a config without the figure is the engine's to read."""
    try:
        config = json.loads(Path(path, "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    positions = next(
        (c.get("max_position_embeddings") for c in (config, config.get("llm_config"), config.get("text_config"))
         if isinstance(c, dict) and isinstance(c.get("max_position_embeddings"), int)),
        None,
    )  # fmt: skip
    if positions is None:
        return None
    rope = config.get("rope_scaling")
    factor = rope.get("factor", 1.0) if isinstance(rope, dict) else 1.0
    return int(positions * factor) if isinstance(factor, (int, float)) and factor > 0 else positions


def context_problems(s: Settings, environ: Mapping[str, str]) -> list[str]:
    """MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH against the positions the models have. The policy: verl 0.6.1's rollout
    asserts the sum fits (model_positions) when the engine starts on the GPUs, after the queue and the model load.
    The reward model scores prompt + response in its own chat template (a few tokens more), and the reward server
    keeps the last REWARD_MAX_LENGTH tokens of a longer pair on purpose (reward_score/server/inputs.py fit); so only a
    REWARD_MAX_LENGTH past the reward model's positions, with pairs that reach past them, is refused: such input gets
    positions the model never learned (RoPE scores it without an error, a learned table raises), and a score must mean
    "this answer is this good". The template's few tokens are not counted here (that needs the reward tokenizer)."""
    problems, sequence = [], s.max_prompt_length + s.max_response_length
    policy = model_positions(s.model_path)
    if policy is not None and sequence > policy:
        problems.append(
            f"MAX_PROMPT_LENGTH={s.max_prompt_length} + MAX_RESPONSE_LENGTH={s.max_response_length} = {sequence} "
            f"tokens, but the policy has {policy} positions (max_position_embeddings in "
            f"CONFIG_MODEL_PATH={s.model_path}/config.json): verl 0.6.1's rollout refuses it when the engine starts "
            "on the GPUs, after the queue ('model context length should be greater than total sequence length'); "
            f"lower MAX_PROMPT_LENGTH and/or MAX_RESPONSE_LENGTH until their sum is at most {policy}, or use a "
            "policy with a longer context"
        )
    raw = environ.get("REWARD_MAX_LENGTH", "")
    try:
        reward_max = int(raw) if raw else RewardServerSettings.max_length
    except ValueError:
        return problems  # the reward server names a malformed REWARD_MAX_LENGTH itself
    reward = model_positions(s.reward_model_path)
    if reward is not None and reward_max > reward and sequence > reward:
        problems.append(
            f"REWARD_MAX_LENGTH={reward_max} (the reward server keeps that many last tokens of a pair) is above the "
            f"reward model's {reward} positions (max_position_embeddings in CONFIG_REWARD_MODEL_PATH="
            f"{s.reward_model_path}/config.json), and MAX_PROMPT_LENGTH={s.max_prompt_length} + MAX_RESPONSE_LENGTH="
            f"{s.max_response_length} = {sequence} tokens, before the chat template's, reach past them: those pairs "
            f"would be scored at positions the model never learned; set REWARD_MAX_LENGTH={reward} (longer pairs "
            "keep their last tokens), or shorten MAX_PROMPT_LENGTH + MAX_RESPONSE_LENGTH to fit"
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
            f"VAL_DO_SAMPLE=false with ROLLOUT_MODE=async: verl 0.6.1's agent loop never reads do_sample "
            f"(agent_loop.py:341-343) and would sample at VAL_TEMPERATURE={s.val_temperature}; for greedy validation "
            "set VAL_TEMPERATURE=0 as well (the Qwen3 cards advise against it: greedy decoding repeats endlessly)"
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
        ("ALGORITHM", s.algorithm, ("grpo", "ppo", "dapo")),
        ("TRAINER_MODE", s.trainer_mode, ("sync", "one_step_off")),
        ("STRATEGY", s.strategy, ("megatron", "fsdp2")),
        ("REWARD_MANAGER", s.reward_manager_setting, ("auto", "batch", "naive", "dapo")),
        ("ROLLOUT_ENGINE", s.rollout_engine, ("sglang", "vllm")),
        ("MEGATRON_RECOMPUTE", s.megatron_recompute, tuple(RECOMPUTE)),
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
    if s.rollout_enforce_eager and s.rollout_engine == "sglang" and s.rollout_mode == "sync":
        problems.append(
            "ROLLOUT_ENFORCE_EAGER=true with ROLLOUT_ENGINE=sglang and ROLLOUT_MODE=sync: verl 0.6.1's sync SGLang "
            "engine never reads it (its engine arguments hold no disable_cuda_graph and take nothing from engine_kwargs "
            "but attention_backend: verl/workers/rollout/sglang_rollout/sglang_rollout.py:426-477), so CUDA graphs would "
            "stay on; use ROLLOUT_MODE=async (its SGLang server sets disable_cuda_graph from it) or ROLLOUT_ENGINE=vllm "
            "(enforce_eager), or set ROLLOUT_ENFORCE_EAGER=false"
        )
    if s.algorithm == "ppo" and s.strategy == "megatron":
        for name, value, actor_name, actor in (
            ("CRITIC_PP", s.critic_pp, "ACTOR_PP", s.actor_pp),
            ("CRITIC_TP", s.critic_tp, "ACTOR_TP", s.actor_tp),
        ):
            if value is not None and value != actor:
                problems.append(
                    f"{name}={value} differs from {actor_name}={actor}: verl 0.6.1 sets Megatron's parallel state once, "
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
                "TRAINER_MODE=one_step_off needs ROLLOUT_MODE=sync: its async rollout worker raises NotImplementedError "
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


# --- 2. the save before the time limit ------------------------------------------------------------------------------


def reward_gpu_problems(s: Settings) -> list[str]:
    """Reward servers on some of the GPUs a tensor-parallel SGLang rollout runs on. SGLang refuses to start a
    tensor-parallel group when the least free memory of its GPUs is under 90% of this GPU's (sglang/srt/
    model_executor/model_runner.py:676-688: `The memory capacity is unbalanced`), and a reward server's GPU has its
    peak less: an 8B reward model fails that, a 1.7B one on 80 GB passes by about 1 GiB. Which GPUs verl's ranks get
    on a node is Ray's choice, so the placements that hold are a server on every GPU of the node (all equally less),
    or none (CONFIG_USE_SEPARATE_REWARD_NODE, CONFIG_REWARD_DEVICE=cpu). vLLM has no such check."""
    if (s.separate_reward_node or s.reward_device != "cuda" or s.rollout_engine != "sglang" or s.rollout_tp < 2
            or s.trainer_mode != "sync" or s.sglang_memory_check_off):  # fmt: skip
        return []
    indices = {g.strip() for g in s.reward_gpus.split(",") if g.strip()}
    every = {str(g) for g in range(s.gpus_per_node)}
    if not indices or indices == every:
        return []  # no server on a GPU, or one on each (an index beyond the job's GPUs is launch/job/node.py's to refuse)
    return [
        f"ROLLOUT_TP={s.rollout_tp} with reward servers on GPU {s.reward_gpus} of {s.gpus_per_node} "
        "(CONFIG_REWARD_GPUS): SGLang refuses to start a tensor-parallel group whose GPUs' free memory differs by "
        "over 10% (sglang model_runner.py: 'The memory capacity is unbalanced'), and a reward server's GPU has its "
        f"peak less. Put a server on every GPU of the node (CONFIG_REWARD_GPUS={','.join(sorted(every, key=int))}), "
        "give the servers their own node (CONFIG_USE_SEPARATE_REWARD_NODE=true), run them on the CPU "
        "(CONFIG_REWARD_DEVICE=cpu), or use ROLLOUT_TP=1; SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK=true makes SGLang "
        "size its cache from the GPU with the least free memory instead"
    ]


def save_deadline_setting_problems(s: Settings) -> list[str]:
    """ESI_REDUNDANT_TIME and CHECKPOINT_BEFORE_END themselves."""
    problems = []
    if s.esi_redundant_time_setting != "auto":
        try:
            bad = float(s.esi_redundant_time_setting) < 0
        except ValueError:
            bad = True
        if bad:
            problems.append(f"ESI_REDUNDANT_TIME={s.esi_redundant_time_setting!r}: auto or seconds, 0 or more")
    if s.checkpoint_before_end < 0:
        problems.append(f"CHECKPOINT_BEFORE_END={s.checkpoint_before_end}: seconds before the time limit, 0 or more")
    return problems


def save_deadline_problems(s: Settings, env: Mapping[str, str]) -> list[str]:
    """The settings of the save before the time limit, then CHECKPOINT_BEFORE_END against the requeue signal: where
    verl's last save would come after the job has requeued itself (the recipes and SAVE_FREQ<=0 never save before
    the limit, so nothing to refuse there)."""
    problems = save_deadline_setting_problems(s)
    if problems or s.uses_recipe or s.save_freq <= 0:
        return problems
    lead = signal_lead(env)
    if lead is not None and s.checkpoint_before_end <= lead:
        problems.append(
            f"CHECKPOINT_BEFORE_END={s.checkpoint_before_end} is not above the time-limit signal's lead ({lead} s, "
            "#SBATCH --signal=B:USR1@...): the job requeues itself at that signal, so verl's last save before the "
            "limit would come after it; set CHECKPOINT_BEFORE_END above it by at least a save"
        )
    return problems


# --- 3. the composed trainer config -------------------------------------------------------------------------------


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
            + ("asserts they divide at the first update (verl/protocol.py make_iterator)" if not fsdp else
               "leaves a short last mini-batch whose gradient is scaled as a full one (dp_actor/dp_critic)")
        )  # fmt: skip
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


def _agent_split_holds(prompts: int, n: int, workers: int) -> bool:
    return (prompts * n) % workers == 0


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
    if _agent_split_holds(prompts, n, workers):
        return []

    def works(b: int) -> bool:  # this split and every other relation above, with b prompts a step
        return _agent_split_holds(b, n, workers) and not _update_relation_problems(cfg, prompts=b)

    mini = cfg.actor_rollout_ref.actor.ppo_mini_batch_size  # verl requires train_batch_size >= it
    below = next((b for b in range(prompts - 1, max(mini, 1) - 1, -1) if works(b)), None)
    above = next((b for b in range(prompts + 1, 4 * prompts + 1) if works(b)), None)
    sizes = " or ".join(str(b) for b in (below, above) if b is not None)
    total = prompts * n
    divisors = [d for d in range(1, total + 1) if total % d == 0]
    fewer = max((d for d in divisors if d < workers), default=None)
    more = min((d for d in divisors if d > workers), default=None)
    other_workers = " or ".join(str(d) for d in (fewer, more) if d is not None)
    return [
        f"data.train_batch_size={prompts} (TRAIN_BATCH_SIZE) x rollout.n={n} (ROLLOUT_N) = {total} sequences do not "
        f"split over the agent loop's {workers} workers (actor_rollout_ref.rollout.agent.num_workers): async rollout "
        "cuts every step's batch into equal parts, one per worker, and verl 0.6.1 asserts it at the first step "
        "(agent_loop.py generate_sequences, DataProto.chunk), after the model load; "
        + (f"nearest TRAIN_BATCH_SIZE that divides and passes the other batch checks: {sizes}" if sizes else
           "no TRAIN_BATCH_SIZE near it passes every batch check with these sizes")
        + f"; or override actor_rollout_ref.rollout.agent.num_workers with {other_workers}, which divide {total}"
    ]  # fmt: skip


def _update_relation_problems(cfg, prompts: int | None = None) -> list[str]:
    """The relations of the batch (`prompts` a step; default data.train_batch_size) to the ranks and mini-batches."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic

    arr, problems = cfg.actor_rollout_ref, []
    n, prompts = arr.rollout.n, cfg.data.train_batch_size if prompts is None else prompts
    batch, n_gpus = prompts * n, cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    dp = _dp_size(cfg, n_gpus)
    if dp < 1:
        return [f"{n_gpus} training GPUs (trainer.n_gpus_per_node x trainer.nnodes) hold no data-parallel rank of the "
                "actor's parallel sizes (ACTOR_PP x ACTOR_TP)"]  # fmt: skip
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
    budgets = [("actor_rollout_ref.actor", arr.actor.use_dynamic_bsz, "ppo_max_token_len_per_gpu", "ppo_micro_batch_size_per_gpu"),
               ("actor_rollout_ref.rollout", arr.rollout.log_prob_use_dynamic_bsz, "log_prob_max_token_len_per_gpu", "log_prob_micro_batch_size_per_gpu"),
               ("actor_rollout_ref.ref", arr.ref.log_prob_use_dynamic_bsz, "log_prob_max_token_len_per_gpu", "log_prob_micro_batch_size_per_gpu")]  # fmt: skip
    if critic_used:
        budgets += [("critic", cfg.critic.use_dynamic_bsz, "ppo_max_token_len_per_gpu", "ppo_micro_batch_size_per_gpu"),
                    ("critic", cfg.critic.use_dynamic_bsz, "forward_max_token_len_per_gpu", "forward_micro_batch_size_per_gpu")]  # fmt: skip
    for keys, dynamic, budget, micro in budgets:
        section = OmegaConf.select(cfg, keys)
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
MEGATRON_PARALLEL_KEYS = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                          "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
                          "expert_tensor_parallel_size")  # fmt: skip


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


# The Ray hooks that register the HF rollout of the CPU runs (demo/verl_cpu.py; demo/megatron_cpu.py calls it, and
# so does tests/stall_hook.py, which then slows or blocks a worker's phase for the stall watchdog's test).
CPU_HOOKS = ("demo.verl_cpu.install", "demo.megatron_cpu.install", "tests.stall_hook.install")


def rollout_problems(cfg) -> list[str]:
    """Rollout keys the engine would silently ignore. verl 0.6.1's sync SGLang engine builds its arguments without
    enforce_eager and drops every engine_kwargs.sglang key but attention_backend (sglang_rollout.py:426-477); only
    the async server reads them (async_sglang_server.py:126-157)."""
    rollout = cfg.actor_rollout_ref.rollout
    if rollout.name == "hf":
        runtime_env = cfg.get("ray_kwargs", {}).get("ray_init", {}).get("runtime_env", {})
        if runtime_env.get("worker_process_setup_hook") not in CPU_HOOKS:
            return [
                "actor_rollout_ref.rollout.name=hf: verl 0.6.1 registers no such engine (verl/workers/rollout/base.py:81-86); "
                "only the CPU runs of make demo and the tests have one, which demo/verl_cpu.py registers in every Ray "
                "worker: pass all of its overrides (python -m demo.verl_cpu lists them; python -m demo.megatron_cpu "
                "for STRATEGY=megatron), or on GPUs ROLLOUT_ENGINE=sglang|vllm"
            ]
        return []
    if rollout.name != "sglang" or rollout.mode != "sync":
        return []
    problems = []
    if rollout.enforce_eager:
        problems.append(
            "actor_rollout_ref.rollout.enforce_eager=True (ROLLOUT_ENFORCE_EAGER) with sync SGLang rollout: verl 0.6.1's "
            "sync SGLang engine never passes it on (no disable_cuda_graph, sglang_rollout.py:426-477); use async rollout "
            "or vLLM, or drop it"
        )
    ignored = sorted(
        k for k, v in (rollout.engine_kwargs.get("sglang") or {}).items() if v is not None and k != "attention_backend"
    )
    if ignored:
        problems.append(
            f"actor_rollout_ref.rollout.engine_kwargs.sglang.{{{', '.join(ignored)}}} with sync SGLang rollout: verl 0.6.1's "
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
        + ("responses start mid-reasoning and hold only </think>, so cut-off reasoning would be scored as an answer"
           if opens else "every answer without </think> would get the penalty")
        + f"; set REWARD_PROMPT_OPENS_THINK={'true' if opens else 'false'} (or auto)"
    ]  # fmt: skip


# --- 4. Ray's CPUs on each node -----------------------------------------------------------------------------------

# verl 0.6.1's rollout servers for async rollout: one Ray actor of num_cpus=1 per node of each replica, pinned to that
# node (async_sglang_server.py:50, 300-306; vllm_async_server.py:444, 520-525). The CPU runs' `hf` replica serves
# from the hybrid worker itself (demo/verl_cpu.py) and starts none.
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
    if not env.get("RAY_NUM_CPUS"):
        return []  # only the run script knows the node's CPUs; it always exports them
    try:
        cpus = int(env["RAY_NUM_CPUS"])
    except ValueError:
        return [f"RAY_NUM_CPUS={env['RAY_NUM_CPUS']!r} is not a whole number (Ray's CPUs per node)"]
    need, parts = ray_cpus_needed(cfg)
    if cpus >= need:
        return []
    source = env.get("RAY_NUM_CPUS_FROM") or "RAY_NUM_CPUS"
    return [
        f"RAY_NUM_CPUS={cpus} Ray CPUs per node ({source}), but verl 0.6.1 holds {need} on a node: {'; '.join(parts)}. "
        "With fewer it waits for ever for its workers' placement, without a message "
        f"(verl/single_controller/ray/base.py:136): give each node at least {need} (#SBATCH --cpus-per-task={need} "
        f"or more in run_grpo_qwen3_4b_mega_verl.sh, or sbatch --cpus-per-task={need}; outside Slurm RAY_NUM_CPUS={need})"
    ]
