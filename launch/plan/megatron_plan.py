"""The Megatron update's plan: MEGATRON_RECOMPUTE, FUSED_KERNELS, OPTIMIZER_OFFLOAD and MICRO_BATCH_PER_GPU.

Each is `auto` by default. auto takes, for the card's memory (CONFIG_GPU_MEMORY_GIB: the GPU the preflight sees; where
it sees none, an 80 GB H100), the plan that is fastest per token in the table measured on one H100 (SPEED) among those
whose predicted peak (launch/plan/stage_memory.py: every pipeline stage, the update and the log-prob passes, the reward
server beside stage 0) fits the card with MARGIN. A value the user sets wins, and where it makes the update slower
than auto's choice the preflight says so in one line. The preflight prints the plan chosen and the runner-up:

    preflight: Megatron plan (auto, for 79.2 GiB: this GPU): logits, recompute off, 1 x 6144 tokens, optimizer
    offloaded: 0.061 s per 1k tokens, ~71.3 GiB; runner-up: ...

The table's figures are seconds per 1,000 tokens of the update's micro-batches (forward and backward) through verl
0.6.1's own worker at Qwen3-4B's PP=2 stages, without Transformer Engine: benchmarks/results/
megatron_plan_h100_qwen3_4b.json (`python -m benchmarks.megatron_plan`; tests/test_megatron_plan.py keeps the two
equal). Other shapes are ranked by the same figures: what a plan costs per token changes little in order between
dense models of one family. With PP=1 a plan costs both stages' seconds, with more stages the slower one's (1F1B).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

from launch.plan.settings import ARTICLE_SEQUENCE_TOKENS, SettingError, Settings
from launch.plan.stage_memory import (
    GIB,
    WORKER_OVERHEAD,
    ModelDims,
    RewardPeak,
    log_prob_stage,
    stage_parameters,
    update_plan,
)

# Room left on the card beside the predicted peak: the formula's largest error against the measured peaks of the
# table (benchmarks/results/megatron_plan_h100_qwen3_4b.json, `predicted_gib`) is under it.
MARGIN = 0.05
ASSUMED_CARD_GIB = 79.18  # an 80 GB H100 as torch reports it: the card auto plans for where the preflight sees none
RECOMPUTES = ("off", "selective", "full")
TABLE_CARD = "one H100 80GB HBM3"
# (fused, recompute, sequences of 6,144 tokens a micro-batch) -> seconds per 1,000 tokens of the update's micro-batches
# (forward and backward) on the last stage (its half of the layers, the output layer and the logits or verl's fused
# kernels); stage 0 (the other half and the embedding) by (recompute, sequences). Measured on TABLE_CARD through verl
# 0.6.1's own worker at Qwen3-4B's stage shapes: benchmarks/results/megatron_plan_h100_qwen3_4b.json
# (`python -m benchmarks.megatron_plan --quick`); the fused kernels' rows and stage 0's from the update seconds of
# megatron_memory_h100_qwen3_4b_fused.json and _fused_2x.json less the fixed phases the former measured.
# tests/test_megatron_plan.py reads each back. A plan out of memory on that card is not a row.
LAST_STAGE = {
    (False, "full", 1): 0.0597,
    (False, "full", 2): 0.0551,
    (False, "full", 4): 0.0543,
    (False, "off", 1): 0.0489,
    (True, "full", 4): 0.0781,
    (True, "full", 8): 0.0875,
}
FIRST_STAGE = {("full", 4): 0.043}
OFFLOAD_SECONDS = 1.87  # the optimizer's load and offload each update_actor call at that stage (measured there)


@dataclass(frozen=True)
class Plan:
    fused: bool
    recompute: str
    sequences: int  # MICRO_BATCH_PER_GPU
    offload: bool
    tokens: int  # the micro-batch's token budget with this job's lengths
    seconds_per_1k: float | None  # None: not in the table
    need: int  # bytes: the fullest GPU's peak (a stage's update or log-prob pass, the reward server beside stage 0)

    def describe(self) -> str:
        speed = f"{self.seconds_per_1k:.4f} s per 1k tokens" if self.seconds_per_1k is not None else "not measured"
        return (
            f"{'fused kernels' if self.fused else 'logits'}, recompute {self.recompute}, {self.sequences} x "
            f"{ARTICLE_SEQUENCE_TOKENS} tokens ({self.tokens} a micro-batch), optimizer "
            f"{'offloaded' if self.offload else 'on the GPU'}: {speed}, ~{self.need / GIB:.1f} GiB"
        )


def seconds_per_1k(fused: bool, recompute: str, sequences: int, stages: int) -> float | None:
    """The table's cost of a plan per 1,000 tokens: both stages' with PP=1, the slower stage's with more. Stage 0 (no
    logits) at the nearest size the table has for the recompute; where it has none, the last stage's figure alone
    ranks the plan (stage 0 ran faster per token than the last stage at every plan measured)."""
    last = LAST_STAGE.get((fused, recompute, sequences))
    if last is None:
        return None
    firsts = sorted((abs(k - sequences), v) for (rc, k), v in FIRST_STAGE.items() if rc == recompute)
    if not firsts:
        return last
    first = firsts[0][1]
    return last + first if stages == 1 else max(last, first)


def plan_need(s: Settings, dims: ModelDims, plan: tuple[bool, str, int, bool], reward: RewardPeak | None) -> int:
    """The fullest GPU's predicted peak for `plan` (fused, recompute, sequences, offload): each stage's update and its
    log-prob passes (with the optimizer resident where it is not offloaded), the reward server's beside stage 0 where
    it shares the head's GPU."""
    fused, recompute, sequences, offload = plan
    planned = replace(s, megatron_recompute=recompute, micro_batch_per_gpu=sequences)
    dp = max(1, s.train_nodes * s.training_gpus_per_node // max(1, s.actor_pp * s.actor_tp))
    shared = reward.total if reward is not None and not s.separate_reward_node else 0
    need = 0
    for stage in update_plan(planned, dims, fused):
        log_prob = log_prob_stage(
            dims,
            stage=stage.stage,
            stages=s.actor_pp,
            tp=s.actor_tp,
            tokens=planned.token_budget,
            fused_logits=fused,
            reference_on_gpu=True,
            process=WORKER_OVERHEAD,
        ).total
        if not offload:
            log_prob += 12 * stage_parameters(dims, stage=stage.stage, stages=s.actor_pp) // s.actor_tp // dp
        need = max(need, max(stage.total, log_prob) + (shared if stage.stage == 0 else 0))
    return need


@dataclass(frozen=True)
class Choice:
    plan: Plan
    runner_up: Plan | None
    auto: Plan  # what auto alone would choose (the user's settings aside)
    card: int
    card_source: str
    notes: tuple[str, ...]  # why a knob was not free: the fused kernels' blocker, the offload's rule

    def line(self, s: Settings) -> str:
        settings = ", ".join(
            f"{name}={value}"
            for name, value in (
                ("MEGATRON_RECOMPUTE", s.megatron_recompute_setting),
                ("FUSED_KERNELS", s.fused_kernels_setting),
                ("OPTIMIZER_OFFLOAD", s.optimizer_offload_setting),
                ("MICRO_BATCH_PER_GPU", s.micro_batch_setting),
            )
        )
        text = f"Megatron plan ({settings}; for {self.card / GIB:.1f} GiB: {self.card_source}): {self.plan.describe()}"
        if self.runner_up is not None:
            text += f"; runner-up: {self.runner_up.describe()}"
        return text + "".join(f"; {note}" for note in self.notes)

    def slower_line(self) -> str | None:
        """One line where the user's settings make the update slower than auto's choice, else None."""
        mine, auto = self.plan.seconds_per_1k, self.auto.seconds_per_1k
        if mine is None or auto is None or mine <= auto * 1.01:
            return None
        return (
            f"the Megatron plan set here runs {mine / auto - 1:.0%} slower per token than auto's "
            f"({self.auto.describe()}): set the knobs above to auto to take it"
        )


def fused_blocker(s: Settings, config: dict, cpu_stand_in: bool) -> tuple[str, str] | None:
    """Why verl 0.6.1's fused log-prob kernels cannot run on this Megatron plan and policy (its config.json), and the
    fix beyond FUSED_KERNELS=auto or off; None where they run."""
    # transformers' own default ties them (PretrainedConfig: tie_word_embeddings=True)
    if s.actor_pp == 1 and config.get("tie_word_embeddings", True):
        return (
            "the policy ties its output layer to the embedding (tie_word_embeddings), and at ACTOR_PP=1 "
            "megatron-core keeps no output_layer.weight, which verl 0.6.1's fused forward reads "
            "(verl/models/mcore/model_forward_fused.py:201; verl 0.7.0 falls back to the embedding's)",
            ", or ACTOR_PP=2 or more (the last stage holds its own copy of the tied weight)",
        )
    if config.get("hidden_size", 0) % 128 and not cpu_stand_in:
        return (
            f"hidden_size {config.get('hidden_size')} is not a multiple of 128, which verl's Triton kernel "
            "asserts (verl/utils/kernel/kernels.py:537)",
            "",
        )
    return None


def fused_refusal(blocker: tuple[str, str]) -> SettingError:
    """FUSED_KERNELS=on where fused_blocker says the kernels cannot run: the reason and the fix."""
    return SettingError(f"FUSED_KERNELS=on, but {blocker[0]}: set FUSED_KERNELS=auto or off{blocker[1]}")


def card_bytes(s: Settings) -> tuple[int, str]:
    """The card auto plans for, and where that figure comes from."""
    if s.gpu_memory_gib_setting != "auto":
        return int(float(s.gpu_memory_gib_setting) * GIB), "CONFIG_GPU_MEMORY_GIB"
    from launch.plan.gpu_memory import gpu_total

    total = gpu_total()
    if total is not None:
        return total, "this GPU"
    return int(ASSUMED_CARD_GIB * GIB), "no GPU here: an 80 GB H100 (CONFIG_GPU_MEMORY_GIB names another)"


def choose(
    s: Settings, dims: ModelDims, config: dict, card: int, card_source: str, reward: RewardPeak | None, stand_in=False
) -> Choice:
    """The plan for this job: the fastest per token of the table among the plans that fit the card with MARGIN, each
    knob the user set held at the user's value; where none fits, the one that needs least (the preflight's memory
    check then refuses it, naming the fix)."""
    notes = []
    fused_options = {"on": (True,), "off": (False,), "auto": (False, True)}[s.fused_kernels_setting]
    blocker = fused_blocker(s, config, stand_in)
    if blocker is not None and True in fused_options:
        if s.fused_kernels_setting == "on":
            raise fused_refusal(blocker)
        fused_options = (False,)
        notes.append(f"no fused kernels: {blocker[0]}")
    engine_shares = s.trainer_mode != "one_step_off"  # the hybrid engine's rollout takes what the optimizer frees
    offload_options = {"on": (True,), "off": (False,), "auto": (True,) if engine_shares else (False, True)}[
        s.optimizer_offload_setting
    ]
    if s.optimizer_offload_setting == "auto" and engine_shares:
        notes.append(
            f"the optimizer offloaded: the rollout shares this GPU, and its copies cost ~{OFFLOAD_SECONDS:.1f} s an "
            "update (measured), not per token"
        )
    recomputes = RECOMPUTES if s.megatron_recompute_setting == "auto" else (s.megatron_recompute_setting,)
    measured = sorted({k for _, _, k in LAST_STAGE}) or [4]
    sizes = measured if s.micro_batch_setting == "auto" else [int(s.micro_batch_setting)]

    dp = max(1, s.train_nodes * s.training_gpus_per_node // max(1, s.actor_pp * s.actor_tp))
    update_tokens = s.train_batch_size * s.rollout_n * (s.max_prompt_length + s.max_response_length) // dp

    def plans(fused_set, recompute_set, size_set, offload_set) -> list[Plan]:
        out = []
        for fused in fused_set:
            for recompute in recompute_set:
                for k in size_set:
                    for offload in offload_set:
                        planned = replace(s, micro_batch_per_gpu=k)
                        need = plan_need(s, dims, (fused, recompute, k, offload), reward)
                        speed = seconds_per_1k(fused, recompute, k, s.actor_pp)
                        if speed is not None and offload:  # its copies, once an update, over the update's tokens
                            speed += 1000 * OFFLOAD_SECONDS / update_tokens
                        out.append(Plan(fused, recompute, k, offload, planned.token_budget, speed, need))
        return out

    def ranked(candidates: list[Plan]) -> list[Plan]:
        fitting = [p for p in candidates if p.need <= card * (1 - MARGIN)]
        if not fitting:
            return sorted(candidates, key=lambda p: p.need)[:1]
        return sorted(fitting, key=lambda p: (math.inf if p.seconds_per_1k is None else p.seconds_per_1k, p.need))

    mine = ranked(plans(fused_options, recomputes, sizes, offload_options))
    engine_offload = (True,) if engine_shares else (False, True)
    fused_auto = (False,) if blocker is not None else (False, True)
    auto = ranked(plans(fused_auto, RECOMPUTES, measured, engine_offload))
    return Choice(mine[0], mine[1] if len(mine) > 1 else None, auto[0], card, card_source, tuple(notes))


KNOBS = {  # the plan's settings: their field and how the chosen plan spells them
    "MEGATRON_RECOMPUTE": ("megatron_recompute_setting", lambda p: p.recompute),
    "FUSED_KERNELS": ("fused_kernels_setting", lambda p: "on" if p.fused else "off"),
    "OPTIMIZER_OFFLOAD": ("optimizer_offload_setting", lambda p: "on" if p.offload else "off"),
    "MICRO_BATCH_PER_GPU": ("micro_batch_setting", lambda p: str(p.sequences)),
}


def handed_on(s: Settings, choice: Choice) -> str:
    """NAME=VALUE lines of the knobs auto chose, for the run script to export: every node's trainer command is then
    built from them as the preflight chose them, without transformers (launch/plan/trainer_command.py)."""
    return "".join(
        f"{name}={spell(choice.plan)}\n" for name, (field, spell) in KNOBS.items() if getattr(s, field) == "auto"
    )


def resolve(s: Settings, stand_in: bool = False, explain: bool = False) -> tuple[Settings, Choice | None]:
    """The settings with every auto knob of the Megatron plan replaced by its choice, and the choice (None with
    STRATEGY=fsdp2, whose plan is MICRO_BATCH_PER_GPU alone: auto gives the article's 4; None where every knob is set
    and no `explain` is asked: then nothing but the policy's config.json is read). The knobs' own settings stay as
    they were, so resolving resolved settings gives them again."""
    if s.strategy != "megatron":
        return replace(s, micro_batch_per_gpu=s.micro_batch_per_gpu or 4), None
    if not explain and all(getattr(s, field) != "auto" for field, _ in KNOBS.values()):
        fused = s.fused_kernels_setting == "on"
        if fused:
            try:
                config = json.loads((Path(s.model_path) / "config.json").read_text())
            except (OSError, ValueError):
                config = None  # the preflight refuses a missing CONFIG_MODEL_PATH itself
            blocker = fused_blocker(s, config, stand_in) if config is not None else None
            if blocker is not None:
                raise fused_refusal(blocker)
        return replace(s, plan_fused=fused, plan_offload=s.optimizer_offload_setting == "on"), None
    config_file = Path(s.model_path) / "config.json"
    try:
        stamp = config_file.stat().st_mtime_ns
    except OSError:
        stamp = None
    unresolved = replace(s, micro_batch_per_gpu=0, megatron_recompute="", plan_fused=None, plan_offload=None)
    choice = _choice(unresolved, stand_in, stamp)
    p = choice.plan
    resolved = replace(
        s, megatron_recompute=p.recompute, micro_batch_per_gpu=p.sequences, plan_fused=p.fused, plan_offload=p.offload
    )
    return resolved, choice


@lru_cache(maxsize=16)
def _choice(s: Settings, stand_in: bool, stamp: int | None) -> Choice:
    """resolve's choice, once a process for the same settings and policy config (the reward server's size and the
    card are read here too). A policy config that cannot be read gets the reference job's plan, said in its notes:
    the preflight refuses a missing CONFIG_MODEL_PATH itself."""
    try:
        from transformers import AutoConfig
    except ImportError as exc:
        raise SettingError(
            f"MEGATRON_RECOMPUTE, FUSED_KERNELS, OPTIMIZER_OFFLOAD or MICRO_BATCH_PER_GPU=auto reads the policy's "
            f"config.json with transformers, which this Python lacks ({exc}): run it in the image, pip install "
            "transformers, or set the four"
        ) from None
    from launch.plan.gpu_memory import reward_peak

    card, source = card_bytes(s)
    config = None
    try:
        config = json.loads((Path(s.model_path) / "config.json").read_text())
        dims = ModelDims.from_config(AutoConfig.from_pretrained(s.model_path))
    except (OSError, ValueError) as exc:
        why = f"CONFIG_MODEL_PATH's config.json is not readable here ({exc!r})"
        return _reference_choice(s, card, source, why, config, stand_in)
    try:
        reward = reward_peak(s)
    except (Exception, SystemExit) as exc:  # the preflight refuses the reward model's problems by name
        why = f"the reward server cannot be sized here ({exc!r})"
        return _reference_choice(s, card, source, why, config, stand_in)
    return choose(s, dims, config, card, source, reward, stand_in)


def _reference_choice(s: Settings, card: int, source: str, why: str, config=None, stand_in=False) -> Choice:
    """The reference job's plan (logits, full recompute, 4 x 6144 tokens, the optimizer offloaded), each knob the
    user set kept, where the plan cannot be predicted; FUSED_KERNELS=on still refused where the policy blocks it."""
    blocker = fused_blocker(s, config, stand_in) if config is not None else None
    if blocker is not None and s.fused_kernels_setting == "on":
        raise fused_refusal(blocker)
    sequences = 4 if s.micro_batch_setting == "auto" else int(s.micro_batch_setting)
    plan = Plan(
        fused=s.fused_kernels_setting == "on",
        recompute="full" if s.megatron_recompute_setting == "auto" else s.megatron_recompute_setting,
        sequences=sequences,
        offload=s.optimizer_offload_setting != "off",
        tokens=replace(s, micro_batch_per_gpu=sequences).token_budget,
        seconds_per_1k=None,
        need=0,
    )
    blocked = (f"no fused kernels: {blocker[0]}",) if blocker else ()
    return Choice(plan, None, plan, card, source, (f"the reference plan: {why}", *blocked))
