"""The launch settings as one object, read from the environment that the settings block of
run_grpo_qwen3_4b_mega_verl.sh exports: every default lives there, none here.

launch/plan's imports go one way: deadline, thinking and settings (bottom) <- trainer_command <- refusals <- preflight.
This module imports nothing of launch/ (tests/test_settings.py checks the order).
"""

import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class SettingError(ValueError):
    pass


# ROLLOUT_GPU_MEMORY=auto (Settings.rollout_gpu_memory; why these: docs/training.md, one-step-off's rollout GPUs)
ROLLOUT_GPU_MEMORY_HYBRID = 0.4
VLLM_GPU_MEMORY_UTILIZATION = 0.9
ROLLOUT_ROOM_FOR_REWARD = 0.25
# The article's sequence: MAX_PROMPT_LENGTH 2048 + MAX_RESPONSE_LENGTH 4096 tokens. Its fixed micro-batches of
# MICRO_BATCH_PER_GPU such sequences are the most tokens a micro-batch ever held there (Settings.token_budget).
ARTICLE_SEQUENCE_TOKENS = 2048 + 4096
# SGLang engines per node the port block has room for (two ports each: launch/job/node.py); refusals.py refuses more
SGLANG_MAX_GPUS = 16


def _parse(kind: type, name: str, raw: str, spelled: tuple[str, str] | None = None):
    """One setting's text as its field's type; a bad value names the setting. A flag the scripts also read (spelled)
    takes exactly the two words they compare against, so the preflight and the job never read it differently."""
    if spelled:
        if raw not in spelled:
            raise SettingError(
                f"{name}={raw!r}: use {spelled[0]} or {spelled[1]} (the job script compares exactly these)"
            )
        return raw == spelled[0]
    if kind is bool:
        value = raw.lower()
        if value in ("1", "true", "yes", "on"):
            return True
        if value in ("0", "false", "no", "off", ""):
            return False
        raise SettingError(f"{name}={raw!r}: use true or false")
    try:
        return kind(raw)
    except ValueError:
        what = "a whole number" if kind is int else "a number"
        raise SettingError(f"{name}={raw!r} is not {what}") from None


def _number(name: str, raw: str, accepts, wanted: str) -> float:
    """A setting's number; a value that is not one, or one `accepts` refuses, names the setting and what it wants."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not accepts(value):
        raise SettingError(f"{name}={raw!r}: use {wanted}")
    return value


def setting(name: str, spelled: tuple[str, str] | None = None):
    """A field read from the environment variable NAME, which the run script's settings block exports; a flag that bash
    reads too is spelled (on, off) as bash compares it."""
    return field(metadata={"env": name, "spelled": spelled})


@dataclass(frozen=True)
class Settings:
    """The settings block of run_grpo_qwen3_4b_mega_verl.sh, read. That block holds every default: a new setting is a
    line there and a line here, and nothing here has a default of its own."""

    container: str = setting("CONTAINER")
    image: str = setting("CONFIG_IMAGE_PATH")
    model_path: str = setting("CONFIG_MODEL_PATH")
    prompt_opens_think_setting: str = setting("REWARD_PROMPT_OPENS_THINK")  # auto | true | false (thinking.py)
    reward: str = setting("REWARD")  # rm | rule | rm+rule (the reward function checks it: reward_score_range)
    reward_model_path: str = setting("CONFIG_REWARD_MODEL_PATH")
    train_file: str = setting("CONFIG_TRAIN_FILE")
    test_file: str = setting("CONFIG_TEST_FILE")
    output_dir: str = setting("CONFIG_OUTPUT_DIR")
    gpus_per_node: int = setting("CONFIG_GPUS_PER_NODE")
    separate_reward_node: bool = setting("CONFIG_USE_SEPARATE_REWARD_NODE", spelled=("true", "false"))
    reward_device: str = setting("CONFIG_REWARD_DEVICE")
    reward_gpus: str = setting("CONFIG_REWARD_GPUS")
    reward_replicas: int = setting("REWARD_REPLICAS")
    rollout_mode: str = setting("ROLLOUT_MODE")
    train_batch_size: int = setting("TRAIN_BATCH_SIZE")
    max_prompt_length: int = setting("MAX_PROMPT_LENGTH")
    max_response_length: int = setting("MAX_RESPONSE_LENGTH")
    actor_lr: float = setting("ACTOR_LR")
    ppo_mini_batch_size: int = setting("PPO_MINI_BATCH_SIZE")
    # The Megatron update's plan, each auto | a value (launch/plan/megatron_plan.py resolves auto into the fields below)
    micro_batch_setting: str = setting("MICRO_BATCH_PER_GPU")  # auto | sequences of 6144 tokens
    megatron_recompute_setting: str = setting("MEGATRON_RECOMPUTE")  # auto | full | selective | off
    fused_kernels_setting: str = setting("FUSED_KERNELS")  # auto | on | off (trainer_command.fused_kernels)
    optimizer_offload_setting: str = setting("OPTIMIZER_OFFLOAD")  # auto | on | off
    gpu_memory_gib_setting: str = setting("CONFIG_GPU_MEMORY_GIB")  # auto | GiB: the card auto plans for
    actor_pp: int = setting("ACTOR_PP")
    actor_tp: int = setting("ACTOR_TP")
    rollout_tp: int = setting("ROLLOUT_TP")
    rollout_n: int = setting("ROLLOUT_N")
    rollout_gpu_memory_setting: str = setting("ROLLOUT_GPU_MEMORY")  # auto | a share (rollout_gpu_memory)
    kl_loss_coef: float = setting("KL_LOSS_COEF")
    val_do_sample: bool = setting("VAL_DO_SAMPLE")
    val_temperature: float = setting("VAL_TEMPERATURE")
    val_top_p: float = setting("VAL_TOP_P")
    val_top_k: int = setting("VAL_TOP_K")
    project_name: str = setting("PROJECT_NAME")
    experiment_name: str = setting("EXPERIMENT_NAME")
    save_freq_setting: str = setting("SAVE_FREQ")  # auto | steps (launch/plan/deadline.py preemption)
    test_freq: int = setting("TEST_FREQ")
    val_before_train_setting: str = setting("VAL_BEFORE_TRAIN")  # auto | true | false (val_before_train)
    total_epochs: int = setting("TOTAL_EPOCHS")
    logger: str = setting("TRAINER_LOGGER")
    algorithm: str = setting("ALGORITHM")
    trainer_mode: str = setting("TRAINER_MODE")
    strategy: str = setting("STRATEGY")
    reward_manager_setting: str = setting("REWARD_MANAGER")
    critic_model_path: str = setting("CRITIC_MODEL_PATH")  # empty: the policy (filled in by from_env)
    critic_lr: float = setting("CRITIC_LR")
    critic_cliprange_value_setting: str = setting("CRITIC_CLIPRANGE_VALUE")  # auto | a number (critic_cliprange_value)
    dapo_dynamic_sampling: bool = setting("DAPO_DYNAMIC_SAMPLING")
    overlong_buffer_len: int = setting("OVERLONG_BUFFER_LEN")
    overlong_penalty_factor_setting: str = setting("OVERLONG_PENALTY_FACTOR")
    rollout_gpus_per_node: int = setting("ROLLOUT_GPUS_PER_NODE")
    rollout_engine: str = setting("ROLLOUT_ENGINE")
    max_ckpt_to_keep: int = setting("MAX_CKPT_TO_KEEP")
    rollout_enforce_eager: bool = setting("ROLLOUT_ENFORCE_EAGER")
    # The reward server's input format (reward_score/server/settings.py: --input, --add-special-tokens, ...).
    reward_input: str = setting("CONFIG_REWARD_INPUT")
    reward_add_special_tokens: str = setting("CONFIG_REWARD_ADD_SPECIAL_TOKENS")
    reward_chat_template: str = setting("CONFIG_REWARD_CHAT_TEMPLATE")
    reward_append_eos: str = setting("CONFIG_REWARD_APPEND_EOS")
    checkpoint_before_end: int = setting("CHECKPOINT_BEFORE_END")
    esi_redundant_time_setting: str = setting("ESI_REDUNDANT_TIME")
    stall_timeout_setting: str = setting("STALL_TIMEOUT")  # auto | off | seconds (launch/job/watchdog.py)
    stall_floor: int = setting("STALL_FLOOR")
    stall_first_step: int = setting("STALL_FIRST_STEP")
    stall_requeue: bool = setting("STALL_REQUEUE", spelled=("1", "0"))
    preempt_save: bool = setting("PREEMPT_SAVE", spelled=("1", "0"))
    reward_restarts: int = setting("REWARD_RESTARTS")
    # Not settings: Slurm's node count, the reward client's score range, two removed settings still read so that
    # a stale value is refused, not ignored, and SGLang's own switch for its memory-balance check.
    nnodes: int = 1
    reward_score_range: tuple[float, float] = (-40.0, 30.0)
    critic_pp: int | None = None
    critic_tp: int | None = None
    sglang_memory_check_off: bool = False
    # The plan's values: what the user set, or auto's choice once resolved (launch/plan/megatron_plan.resolve); until
    # then an auto knob reads 0, "" or None here.
    micro_batch_per_gpu: int = 0
    megatron_recompute: str = ""
    plan_fused: bool | None = None
    plan_offload: bool | None = None

    @classmethod
    def from_env(cls, env=None) -> "Settings":
        env = os.environ if env is None else env
        read = [f for f in fields(cls) if "env" in f.metadata]
        missing = [f.metadata["env"] for f in read if f.metadata["env"] not in env]
        if missing:
            raise SettingError(
                f"{', '.join(missing)} not set (the defaults live in run_grpo_qwen3_4b_mega_verl.sh: run through it)"
            )
        values = {
            f.name: _parse(f.type, f.metadata["env"], env[f.metadata["env"]], f.metadata["spelled"]) for f in read
        }
        values["critic_model_path"] = values["critic_model_path"] or values["model_path"]
        for field_name, name in (("critic_pp", "CRITIC_PP"), ("critic_tp", "CRITIC_TP")):
            values[field_name] = _parse(int, name, env[name]) if env.get(name) else None
        if values["micro_batch_setting"] != "auto":
            wanted = f"auto or a whole number (sequences of {ARTICLE_SEQUENCE_TOKENS} tokens a micro-batch)"
            sequences = _number("MICRO_BATCH_PER_GPU", values["micro_batch_setting"], float.is_integer, wanted)
            values["micro_batch_per_gpu"] = int(sequences)
        if values["megatron_recompute_setting"] != "auto":
            values["megatron_recompute"] = values["megatron_recompute_setting"]
        values["plan_offload"] = {"on": True, "off": False}.get(values["optimizer_offload_setting"])
        return cls(
            **values,
            nnodes=int(env.get("SLURM_NNODES") or env.get("CONFIG_NUM_NODES") or 1),
            reward_score_range=_reward_score_range(env),
            # as SGLang reads it (get_bool_env_var: "true" or "1")
            sglang_memory_check_off=env.get("SGL_DISABLE_TP_MEMORY_INBALANCE_CHECK", "").lower() in ("true", "1"),
        )

    @property
    def reward_format_flags(self) -> list[str]:
        """The reward server's (and check_format's) input-format flags, from CONFIG_REWARD_INPUT and the rest."""
        values = (
            ("--input", self.reward_input),
            ("--add-special-tokens", self.reward_add_special_tokens),
            ("--chat-template", self.reward_chat_template),
            ("--append-eos", self.reward_append_eos),
        )
        return [x for pair in values for x in pair]

    @property
    def val_before_train(self) -> bool:
        """verl's trainer.val_before_train (its default True). auto: only a start that resumes no checkpoint (verl's
        resume_mode=auto reads CONFIG_OUTPUT_DIR's tracker file) validates first; a requeued start goes straight to
        training and validates at its next TEST_FREQ step."""
        if self.val_before_train_setting == "auto":
            return not (Path(self.output_dir) / "latest_checkpointed_iteration.txt").is_file()
        return self.val_before_train_setting == "true"

    @property
    def uses_reward_model(self) -> bool:
        """REWARD=rule scores in verl's workers alone: no reward server, on no GPU."""
        return self.reward != "rule"

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
    def half_reward_range(self) -> float:
        low, high = self.reward_score_range
        return (high - low) / 2

    @property
    def overlong_penalty_factor(self) -> float:
        """DAPO's overlong penalty at MAX_RESPONSE_LENGTH; auto: half the reward range, as DAPO's 1.0 of -1..1."""
        raw = self.overlong_penalty_factor_setting
        if raw == "auto":
            return self.half_reward_range
        return _number("OVERLONG_PENALTY_FACTOR", raw, lambda v: v >= 0, "auto or a number, 0 or more (a penalty size)")

    @property
    def critic_cliprange_value(self) -> float:
        """PPO's value clip (critic.cliprange_value); auto: half the reward range (docs/training.md)."""
        raw = self.critic_cliprange_value_setting
        if raw == "auto":
            return self.half_reward_range
        wanted = "auto (half the reward range) or a number above 0, the most an update may move the critic's prediction"
        return _number("CRITIC_CLIPRANGE_VALUE", raw, lambda v: math.isfinite(v) and v > 0, wanted)

    @property
    def rollout_gpu_memory(self) -> float:
        """The rollout engine's share of each of its GPUs (rollout.gpu_memory_utilization); auto: the hybrid
        engine's share, or one-step-off's own GPUs less room for a reward server (docs/training.md)."""
        raw = self.rollout_gpu_memory_setting
        if raw == "auto":
            if self.trainer_mode != "one_step_off":
                return ROLLOUT_GPU_MEMORY_HYBRID
            shared = not self.separate_reward_node and self.reward_device != "cpu" and self.uses_reward_model
            return round(VLLM_GPU_MEMORY_UTILIZATION - (ROLLOUT_ROOM_FOR_REWARD if shared else 0), 2)
        wanted = "auto or a share of GPU memory in (0, 1) (docs/training.md: GPU memory)"
        return _number("ROLLOUT_GPU_MEMORY", raw, lambda v: 0 < v < 1, wanted)

    @property
    def token_budget(self) -> int:
        """Tokens per micro-batch on each GPU: as many whole sequences of this job's length as fit in
        MICRO_BATCH_PER_GPU sequences of the article's, at least one (docs/training.md, micro-batches)."""
        sequence = self.max_prompt_length + self.max_response_length
        return max(1, self.micro_batch_per_gpu * ARTICLE_SEQUENCE_TOKENS // sequence) * sequence

    @property
    def training_gpus_per_node(self) -> int:
        return self.gpus_per_node - (self.rollout_gpus_per_node if self.trainer_mode == "one_step_off" else 0)


def _reward_score_range(env) -> tuple[float, float]:
    """The scores a sample can get as the reward function reads its settings (its defaults, then the environment):
    REWARD_MIN_SCORE to REWARD_MAX_SCORE for the reward model, and with REWARD=rule or rm+rule the rule's part."""
    from reward_score.safe_hack_reward_request import load_config

    try:
        config = load_config(environ=dict(env))
    except (TypeError, ValueError) as exc:
        raise SettingError(str(exc)) from None
    return config.score_range
