"""The reward benchmark runs end to end (tiny model, CPU), so the command behind the README's figures keeps working."""

import json
import subprocess
import sys

import pytest

from benchmarks.reward_bench import SHAPES, check_rows, parse_variant, summarize
from tests.support import REPO


def test_the_reward_benchmark_runs_every_row_of_each_variant_against_its_own_server_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.reward_bench",
        "--shape",
        "tiny",
        "--device",
        "cpu",
        "--samples",
        "48",
        "--concurrency",
        "4",
        "--repeat",
        "2",
        "--variant",
        "one:REWARD_PACK=off,rows=cold+fresh",
        "--variant",
        "two",
        "--out",
        str(out),
    ]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    one, two = result["variants"]
    assert one["health"]["pack"] is False and two["health"]["pack"] is True  # the variant's own env
    assert "cold_over_fresh" in one and "cold_over_fresh" in two
    rows = {(r["variant"], r["key"]): r for r in result["rows"]}
    assert list(rows) == [("one", "cold"), ("one", "fresh"), *(("two", k) for k in ("cold", "fresh", "callers-fresh"))]
    assert rows["two", "fresh"]["row"] == "ours, reward client batch function, fresh lengths"
    assert rows["two", "callers-fresh"]["row"] == "ours, 4 concurrent per-sample callers, fresh lengths"
    for key, row in rows.items():
        assert row["repeats"] == (1 if key[1] == "cold" else 2), key
        seeds = {r["seed"] for r in row["runs"]}
        assert len(seeds) == (2 if "fresh" in key[1] else 1), f"{key}: fresh lengths every repeat"
        assert row["samples"] == 48 and row["tokens"] > 48 * 100 and row["tokens_per_s"] > 0
        assert row["server"]["micro_batches"] >= 1 and row["server"]["padded_tokens"] >= row["tokens"], key


@pytest.mark.parametrize(
    "shape, non_embedding",
    [("qwen3-1.7b", 1.4e9), ("qwen3-8b", 6.95e9), ("qwen3-14b", 13.2e9)],  # the Qwen3 model cards' figures
)
def test_the_benchmark_shapes_have_the_public_qwen3_sizes(shape, non_embedding):
    import torch
    from transformers import AutoModelForSequenceClassification, Qwen3Config

    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(Qwen3Config(**SHAPES[shape], num_labels=1))
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    assert params == pytest.approx(non_embedding, rel=0.01)


def test_a_row_reports_the_median_run_and_the_spread_of_its_repeats():
    runs = [
        {"wall_s": w, "tokens": 1000, "tokens_per_s": 1000 / w, "server": {"micro_batches": k}}
        for k, w in enumerate((2.0, 1.0, 4.0))
    ]
    row = summarize(runs, params=1e12, ceiling=2000.0)  # 2 TFLOP a token-thousand... per second
    assert row["repeats"] == 3 and row["wall_s"] == 2.0 and row["server"] == {"micro_batches": 0}
    assert row["tokens_per_s"] == 500.0
    assert (row["min_pct_of_ceiling"], row["median_pct_of_ceiling"], row["max_pct_of_ceiling"]) == (25.0, 50.0, 100.0)
    assert row["pct_of_ceiling"] == 50.0 and [r["wall_s"] for r in row["runs"]] == [2.0, 1.0, 4.0]


def test_variants_and_rows_are_checked_before_anything_starts():
    v = parse_variant("unpacked:REWARD_PACK=off,rows=fresh+cold", ["fresh"])
    assert v == {"name": "unpacked", "env": {"REWARD_PACK": "off"}, "rows": ["cold", "fresh"]}
    assert parse_variant("plain", ["fresh"]) == {"name": "plain", "env": {}, "rows": ["fresh"]}
    for bad, needle in (
        ("x:REWARD_PACK", "not KEY=VALUE"),
        ("x:pack=off", "neither"),
        ("x:rows=hot", "unknown rows"),
        ("x:replicas=2", "neither"),
    ):
        with pytest.raises(ValueError, match=needle):
            parse_variant(bad, ["fresh"])
    assert check_rows(["callers-fresh", "fresh", "cold"]) == ["cold", "fresh", "callers-fresh"]
