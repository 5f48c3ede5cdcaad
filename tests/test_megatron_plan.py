"""The Megatron update's plan (launch/plan/megatron_plan.py): auto takes the table's fastest plan that fits the card
with the margin, for an 80 GB and a 141 GB card; the fused kernels where only they fit; a user's setting wins and a
slower one is said; the table is the measured files'."""

from __future__ import annotations

import json

import pytest

from benchmarks.common import block_defaults
from launch.plan import megatron_plan
from launch.plan.megatron_plan import FIRST_STAGE, LAST_STAGE, MARGIN, choose, plan_need, seconds_per_1k
from launch.plan.settings import SettingError, Settings
from launch.plan.stage_memory import GIB, ModelDims, RewardPeak
from tests.support import REPO

QWEN3_4B = ModelDims(hidden=2560, ffn=9728, q=4096, kv=1024, head_dim=128, layers=36, vocab=151936, tied=True)
QWEN3_4B_CONFIG = {"hidden_size": 2560, "tie_word_embeddings": True}
# A Qwen3-1.7B reward server's peak as the preflight sizes it (weights 3.8 GiB, a full micro-batch's activations)
REWARD = RewardPeak(weights=int(3.8 * GIB), activations=int(1.7 * GIB), tokens=32768, cap=0)
H100, H200 = int(79.18 * GIB), int(139.8 * GIB)
RESULTS = REPO / "benchmarks" / "results"


def settings(**values) -> Settings:
    env = block_defaults(str(REPO)) | {
        "CONFIG_MODEL_PATH": "m",
        "CONFIG_REWARD_MODEL_PATH": "r",
        "CONFIG_TRAIN_FILE": "t",
        "CONFIG_TEST_FILE": "v",
        "CONFIG_OUTPUT_DIR": "o",
        "CONFIG_GPUS_PER_NODE": "4",
    }
    return Settings.from_env(env | values)


def fastest_fitting(s: Settings, card: int) -> tuple:
    """The table's fastest plan whose predicted need fits the card with MARGIN, found by trying every row."""
    rows = []
    for fused, recompute, k in LAST_STAGE:
        need = plan_need(s, QWEN3_4B, (fused, recompute, k, True), REWARD)
        if need <= card * (1 - MARGIN):
            rows.append((seconds_per_1k(fused, recompute, k, s.actor_pp), fused, recompute, k))
    return min(rows)[1:]


def test_the_table_is_the_measured_files_figures():
    """The logits rows: benchmarks.megatron_plan's result on one H100 as product_table reads it (each plan's micro-
    batches, the optimizer's copies apart). The fused rows and stage 0's: the update seconds of the committed
    megatron_memory files (the same card and shape) less the fixed phases the plan benchmark measured."""
    from benchmarks.megatron_plan import product_table

    plan = json.loads((RESULTS / "megatron_plan_h100_qwen3_4b.json").read_text())
    assert plan["gpu"] == "NVIDIA H100 80GB HBM3" and plan["policy"]["num_hidden_layers"] == 18
    table = product_table(plan)
    for key, value in table["LAST_STAGE"].items():
        assert LAST_STAGE[key] == pytest.approx(value, abs=1e-4), key
    assert megatron_plan.OFFLOAD_SECONDS == pytest.approx(table["OFFLOAD_SECONDS"], abs=0.01)
    ok = [r for r in plan["plans"] if r["status"] == "ok" and r["optimizer_offload"] and not r["gc_frozen"]]
    fixed = sorted(r["fixed_seconds"] for r in ok)
    fixed = fixed[len(fixed) // 2]
    for name, k in (
        ("megatron_memory_h100_qwen3_4b_fused.json", 4),
        ("megatron_memory_h100_qwen3_4b_fused_2x.json", 8),
    ):
        case = json.loads((RESULTS / name).read_text())["cases"]["stage1-full-fused"]
        tokens = case["token_budget"] * case["micro_batches"]
        assert LAST_STAGE[(True, "full", k)] == pytest.approx(
            1000 * (case["update"][1]["seconds"] - fixed) / tokens, abs=1e-4
        )
    stage0 = json.loads((RESULTS / "megatron_memory_h100_qwen3_4b_fused.json").read_text())["cases"]["stage0-full"]
    assert FIRST_STAGE[("full", 4)] == pytest.approx(stage0["stage0"][1]["seconds"] / 49.152, abs=1e-4)


@pytest.mark.parametrize("card", [H100, H200], ids=["80GB", "141GB"])
def test_auto_takes_the_tables_fastest_plan_that_fits_the_card(card):
    s = settings()
    choice = choose(s, QWEN3_4B, QWEN3_4B_CONFIG, card, "test", REWARD)
    p = choice.plan
    assert (p.fused, p.recompute, p.sequences) == fastest_fitting(s, card)
    assert p.need <= card * (1 - MARGIN) and p.offload, "the hybrid engine's rollout keeps the optimizer offloaded"
    assert not p.fused, "verl's logits: faster per token than its fused kernels wherever both fit"
    assert choice.runner_up is not None and choice.runner_up.seconds_per_1k >= p.seconds_per_1k
    line = choice.line(s)
    assert f"for {card / GIB:.1f} GiB" in line and "runner-up" in line and "s per 1k tokens" in line


def test_the_fused_kernels_are_chosen_where_only_they_fit():
    """A long context: one 32,768-token sequence a micro-batch. Its logits (8 bytes x 151,936 a token) do not fit
    an 80 GB card beside the rest; the fused kernels' plan does. A 141 GB card fits the logits, which are faster."""
    s = settings(MAX_PROMPT_LENGTH="2048", MAX_RESPONSE_LENGTH="30720")
    logits = plan_need(s, QWEN3_4B, (False, "full", 4, True), REWARD)
    assert logits > H100 * (1 - MARGIN) > plan_need(s, QWEN3_4B, (True, "full", 4, True), REWARD)
    on_80 = choose(s, QWEN3_4B, QWEN3_4B_CONFIG, H100, "test", REWARD).plan
    on_141 = choose(s, QWEN3_4B, QWEN3_4B_CONFIG, H200, "test", REWARD).plan
    assert on_80.fused and not on_141.fused
    assert (on_80.fused, on_80.recompute, on_80.sequences) == fastest_fitting(s, H100)


def test_a_users_setting_wins_and_a_slower_one_is_said_in_one_line():
    s = settings(FUSED_KERNELS="on", MICRO_BATCH_PER_GPU="4")
    choice = choose(s, QWEN3_4B, QWEN3_4B_CONFIG, H100, "test", REWARD)
    assert choice.plan.fused and choice.plan.sequences == 4
    slower = choice.slower_line()
    assert slower and "slower per token than auto's" in slower and "logits" in slower
    assert choose(settings(), QWEN3_4B, QWEN3_4B_CONFIG, H100, "test", REWARD).slower_line() is None


def test_fused_kernels_on_is_refused_where_they_cannot_run_and_auto_says_why():
    """A tied policy at ACTOR_PP=1: megatron-core keeps no output weight on the one stage."""
    with pytest.raises(SettingError, match="FUSED_KERNELS=on, but the policy ties its output layer"):
        choose(settings(FUSED_KERNELS="on", ACTOR_PP="1"), QWEN3_4B, QWEN3_4B_CONFIG, H100, "test", REWARD)
    choice = choose(settings(ACTOR_PP="1"), QWEN3_4B, QWEN3_4B_CONFIG, H100, "test", REWARD)
    assert not choice.plan.fused and any(n.startswith("no fused kernels: the policy ties") for n in choice.notes)


def test_one_step_off_keeps_the_optimizer_on_the_gpu_where_it_fits():
    """Its trainer GPUs hold no rollout engine: the offload's copies buy nothing there. The hybrid engine's rollout
    takes what the optimizer frees: offloaded there."""
    s = settings(TRAINER_MODE="one_step_off", ROLLOUT_GPUS_PER_NODE="2", ROLLOUT_ENGINE="vllm")
    for card in (H100, H200):
        plan = choose(s, QWEN3_4B, QWEN3_4B_CONFIG, card, "test", REWARD).plan
        assert not plan.offload and plan.need <= card * (1 - MARGIN)
        assert choose(settings(), QWEN3_4B, QWEN3_4B_CONFIG, card, "test", REWARD).plan.offload, "the hybrid engine"


def test_the_preflights_choice_is_handed_on_for_the_auto_knobs_alone():
    s = settings(MEGATRON_RECOMPUTE="full")
    choice = choose(s, QWEN3_4B, QWEN3_4B_CONFIG, H100, "test", REWARD)
    handed = megatron_plan.handed_on(s, choice).splitlines()
    assert [line.split("=")[0] for line in handed] == ["FUSED_KERNELS", "OPTIMIZER_OFFLOAD", "MICRO_BATCH_PER_GPU"]
    assert "FUSED_KERNELS=off" in handed and "OPTIMIZER_OFFLOAD=on" in handed
    resolved, none = megatron_plan.resolve(Settings.from_env(block_env(s, handed)))
    assert none is None and resolved.micro_batch_per_gpu == choice.plan.sequences and resolved.plan_offload


def block_env(s: Settings, handed: list[str]) -> dict[str, str]:
    env = block_defaults(str(REPO)) | {"CONFIG_MODEL_PATH": "m", "CONFIG_REWARD_MODEL_PATH": "r"}
    env |= {"CONFIG_GPUS_PER_NODE": "4", "MEGATRON_RECOMPUTE": "full"}
    return env | dict(line.split("=", 1) for line in handed)
