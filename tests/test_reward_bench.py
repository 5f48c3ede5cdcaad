"""The reward benchmark runs end to end (tiny model, CPU), so the command behind the README's figures keeps working."""

import json
import subprocess
import sys

from tests.support import REPO


def test_the_reward_benchmark_runs_every_row_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, "-m", "benchmarks.reward_bench", "--shape", "tiny", "--device", "cpu", "--samples", "48",
           "--article-samples", "8", "--concurrency", "4", "--out", str(out)]  # fmt: skip
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
