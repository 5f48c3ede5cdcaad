"""The reward benchmark runs end to end (tiny model, CPU), so the command behind the README's figures keeps working."""

import json
import subprocess
import sys

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


def test_the_forward_profile_scores_the_step_both_ways_and_names_kernel_kinds(tmp_path):
    from benchmarks.forward_profile import kind_of

    # kernel names as the H200 profile showed them
    assert kind_of("nvjet_tst_256x128_64x4_2x1_v_bz_coopA_TNT") == "matmul"
    assert kind_of("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert kind_of("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_0") == "compiled (triton)"
    assert kind_of("Memcpy HtoD (Pinned -> Device)") == "copy"
    assert kind_of("void at::native::index_elementwise_kernel<128, 4>") == "other elementwise"
    out = tmp_path / "fp.json"
    cmd = [sys.executable, "-m", "benchmarks.forward_profile", "--shape", "tiny", "--device", "cpu", "--samples", "24",
           "--group", "5", "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    layouts = json.loads(out.read_text())["layouts"]
    assert [x["layout"] for x in layouts] == ["batch path (whole step planned at once)",
                                              "small groups (5 sequences per call)"]  # fmt: skip
    assert all(x["wall_s"] > 0 and x["tokens"] > 24 * 100 for x in layouts)
