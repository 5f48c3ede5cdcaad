"""The reward benchmark runs end to end (tiny model, CPU), so the command behind the README's figures keeps working."""

import json
import subprocess
import sys

import pytest

from benchmarks.reward_bench import SHAPES, summarize
from benchmarks.reward_bench_rows import check_rows, parse_variant
from tests.support import REPO


def test_the_reward_benchmark_runs_every_row_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "benchmarks.reward_bench", "--shape", "tiny", "--device", "cpu", "--samples", "48",
           "--article-samples", "8", "--concurrency", "4", "--mode", "classic", "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["row"]: r for r in result["rows"]}
    assert "article server, sequential per-sample client, warm" in rows
    assert "ours, reward client batch function, fresh lengths" in rows
    assert "ours, 4 concurrent per-sample callers, fresh lengths" in rows
    assert all(r["samples"] in (8, 48) and r["tokens"] > r["samples"] * 100 for r in rows.values())
    assert "reward client batch function vs one direct POST" in run.stdout
    ours = [r for name, r in rows.items() if name.startswith("ours")]
    assert all(r["server"]["micro_batches"] >= 1 and r["server"]["padded_tokens"] >= r["tokens"] for r in ours)
    assert "server side, per row:" in run.stdout


def test_the_verl_loop_rows_score_every_sample_through_verls_reward_loop_and_report_the_tail(tmp_path):
    out = tmp_path / "loop.json"
    cmd = [sys.executable, "-m", "benchmarks.reward_bench", "--shape", "tiny", "--device", "cpu", "--samples", "24",
           "--mode", "verl-loop", "--verl-workers", "2", "--verl-executor", "3", "--arrival-window", "2",
           "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == sorted(
        f"verl loop 2x3, {fn}, {load}"
        for fn in ("plain function", "async entry point")
        for load in ("all at once", "arrivals over 2 s")
    )
    plain, coro = (
        rows["verl loop 2x3, plain function, all at once"],
        rows["verl loop 2x3, async entry point, all at once"],
    )
    # The plain function posts one /score per sample; the entry point gathers each worker's samples into /score_batch.
    assert plain["loop"]["requests"] == {"/score": 24, "/score_batch": 0}
    assert coro["loop"]["requests"]["/score"] == 0 and 2 <= coro["loop"]["requests"]["/score_batch"] <= 4
    for name, r in rows.items():
        assert r["samples"] == 24 and r["server"]["micro_batches"] >= 1, name
        assert 0 <= r["loop"]["tail_s"] <= r["wall_s"] and r["loop"]["latency_p50_s"] <= r["loop"]["latency_p99_s"]
        assert 0 < r["loop"]["forward_busy_share"] <= 1.05, name
        if "arrivals" in name:  # the last sample arrives at the end of the window, so the step lasts at least that
            assert r["wall_s"] >= 2 and r["loop"]["tail_s"] < r["wall_s"] - 1.5
    assert "through verl's reward loop" in run.stdout


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
    runs = [{"wall_s": w, "tokens": 1000, "tokens_per_s": 1000 / w, "server": {"micro_batches": k}}
            for k, w in enumerate((2.0, 1.0, 4.0))]  # fmt: skip
    row = summarize(runs, params=1e12, ceiling=2000.0, burst=2500.0)  # 2 TFLOP a token-thousand... per second
    assert row["repeats"] == 3 and row["wall_s"] == 2.0 and row["server"] == {"micro_batches": 0}
    assert row["tokens_per_s"] == 500.0
    assert (row["min_pct_of_ceiling"], row["median_pct_of_ceiling"], row["max_pct_of_ceiling"]) == (25.0, 50.0, 100.0)
    assert row["pct_of_ceiling"] == 50.0 and [r["wall_s"] for r in row["runs"]] == [2.0, 1.0, 4.0]


def test_variants_and_rows_are_checked_before_anything_starts():
    v = parse_variant("fused:REWARD_FUSE=off,replicas=2,rows=fresh+cold+article", 1, ["fresh"])
    assert v == {"name": "fused", "env": {"REWARD_FUSE": "off"}, "replicas": 2, "rows": ["cold", "fresh"]}
    assert parse_variant("plain", 3, ["killed"])["replicas"] == 3
    for bad, needle in (("x:REWARD_FUSE", "not KEY=VALUE"), ("x:fuse=off", "neither"),
                        ("x:rows=killed", "replicas >= 2"), ("x:rows=hot", "unknown rows")):  # fmt: skip
        with pytest.raises(ValueError, match=needle):
            parse_variant(bad, 1, ["fresh"])
    assert check_rows(["killed", "loop-async", "fresh", "cold"]) == ["cold", "fresh", "loop-async", "killed"]


def test_replicas_spread_the_step_and_a_killed_one_leaves_the_step_to_the_others(tmp_path):
    out = tmp_path / "replicas.json"
    cmd = [sys.executable, "-m", "benchmarks.reward_bench", "--shape", "tiny", "--device", "cpu", "--samples", "32",
           "--article-samples", "0", "--repeat", "2", "--kill-at", "start", "--pid-file", str(tmp_path / "pids"),
           "--variant", "one:replicas=1,rows=cold+fresh,REWARD_FUSE=off",
           "--variant", "two:replicas=2,rows=fresh+killed", "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(out.read_text())
    one, two = result["variants"]
    assert (one["replicas"], two["replicas"]) == (1, 2) and len(two["startup_per_replica_s"]) == 2
    assert one["health"]["fused_modules"] == 0 and two["health"]["fused_modules"] > 0  # the variant's own env
    assert len((tmp_path / "pids").read_text().split()) == 3
    rows = {(r["variant"], r["key"]): r for r in result["rows"]}
    assert sorted(rows) == [("one", "cold"), ("one", "fresh"), ("two", "fresh"), ("two", "killed")]
    assert rows["one", "cold"]["repeats"] == 1 and rows["two", "killed"]["repeats"] == 1
    for key in (("one", "fresh"), ("two", "fresh")):
        row = rows[key]
        assert row["repeats"] == 2 and len({r["seed"] for r in row["runs"]}) == 2, "fresh lengths every repeat"
        assert row["tokens_per_s"] > 0 and all(r["tokens_per_s"] > 0 for r in row["runs"])
    # the batch function sends one request per server
    assert all(r["requests"]["/score_batch"] == 2 for r in rows["two", "fresh"]["runs"])
    killed = rows["two", "killed"]
    assert killed["row"] == "ours, reward client batch function, fresh lengths, 1 of 2 servers SIGKILLed mid-step"
    assert killed["killed"]["exit_code"] == -9 and killed["killed"]["within_budget"] is True
    # the survivor scored its own share and, on the retry, the killed server's
    assert killed["requests"] == {"/score": 0, "/score_batch": 2} and killed["wall_s"] >= 0.5
    assert "step done in" in run.stdout
