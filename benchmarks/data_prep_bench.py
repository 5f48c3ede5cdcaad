"""Build benchmark: a 1,000,000-row JSONL through `python -m data_prep.build`; wall time and peak memory.

    python -m benchmarks.data_prep_bench                 # 1,000,000 rows (target: under 60 s, under 2 GiB)
    python -m benchmarks.data_prep_bench --rows 20000    # a quick run

The input mixes English and Japanese prompts of 10-80 words with an id column kept in extra_info, plus a system
prompt and --dedup, so every per-row path of the builder runs. Peak memory is the child process's maximum RSS.
"""

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
WORDS = "the safe answer question explain risk careful step why how 安全 回答 質問 危険 説明 方法".split()


def write_input(path: Path, rows: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(rows):
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(10, 80)))
            f.write(json.dumps({"id": i, "prompt": f"{prompt} #{i}"}, ensure_ascii=False) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="data_prep_bench_"))
    source = work / "input.jsonl"
    t = time.monotonic()
    write_input(source, args.rows)
    print(f"wrote {args.rows:,} rows ({source.stat().st_size / 2**20:.0f} MiB) in {time.monotonic() - t:.1f} s")
    cmd = [
        sys.executable,
        "-m",
        "data_prep.build",
        str(source),
        "--out-dir",
        str(work / "out"),
        "--keep-columns",
        "id",
        "--system-prompt",
        "You are careful.",
        "--dedup",
    ]
    t = time.monotonic()
    subprocess.run(cmd, cwd=REPO, check=True)
    wall = time.monotonic() - t
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB
    sizes = {p.name: p.stat().st_size / 2**20 for p in (work / "out").glob("*.parquet")}
    print(
        f"build: {wall:.1f} s wall, {args.rows / wall:,.0f} rows/s, peak RSS {peak_gib:.2f} GiB, "
        f"{os.cpu_count()} CPUs; outputs {', '.join(f'{k} {v:.0f} MiB' for k, v in sorted(sizes.items()))}"
    )
    shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
