"""Summarise a reward log (REWARD_LOG_PATH, written by safe_hack_reward_request.py): counts, score distribution,
penalty and error rates over time, as a table.

    python -m reward_score.reward_report logs/1234/rewards.jsonl --every 300
"""

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Bucket:
    start: float
    scores: list[float]
    penalties: int
    errors: int

    @property
    def n(self) -> int:
        return len(self.scores)


def read_log(path: Path) -> tuple[list[dict], int]:
    """The records, and how many lines could not be parsed (a crash mid-write leaves at most one)."""
    records, bad = [], 0
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                bad += 1
    return records, bad


def percentiles(values: list[float], qs=(5, 25, 50, 75, 95)) -> dict[str, float]:
    if len(values) == 1:
        return {f"p{q}": values[0] for q in qs}
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return {f"p{q}": cuts[q - 1] for q in qs}


def buckets(records: list[dict], every: float) -> list[Bucket]:
    out: dict[int, Bucket] = {}
    t0 = min(r["epoch"] for r in records)
    for r in records:
        k = int((r["epoch"] - t0) // every)
        b = out.setdefault(k, Bucket(t0 + k * every, [], 0, 0))
        b.scores.append(float(r["score"]))
        b.penalties += r["status"] == "penalty"
        b.errors += r["status"] == "error"
    return [out[k] for k in sorted(out)]


def report(records: list[dict], every: float) -> str:
    if not records:
        return "no records"
    status = Counter(r["status"] for r in records)
    reasons = Counter(r["reason"] for r in records if r["status"] == "penalty")
    scores = [float(r["score"]) for r in records]
    scored = [float(r["score"]) for r in records if r["status"] == "ok"]
    lines = [
        f"{len(records)} samples: " + ", ".join(f"{k} {v} ({v / len(records):.1%})" for k, v in status.most_common())
    ]
    if reasons:
        lines.append("penalties: " + ", ".join(f"{k} {v}" for k, v in reasons.most_common()))
    for name, values in (("all scores", scores), ("scored (ok)", scored)):
        if values:
            pct = " ".join(f"{k}={v:.3f}" for k, v in percentiles(values).items())
            lines.append(
                f"{name}: mean={statistics.fmean(values):.3f} min={min(values):.3f} {pct} max={max(values):.3f}"
            )
    lines.append("")
    lines.append(f"{'from':>19}  {'samples':>7}  {'mean':>8}  {'p50':>8}  {'penalty':>7}  {'error':>6}")
    for b in buckets(records, every):
        when = _clock(b.start)
        median = statistics.median(b.scores)
        lines.append(
            f"{when:>19}  {b.n:>7}  {statistics.fmean(b.scores):>8.3f}  {median:>8.3f}  "
            f"{b.penalties / b.n:>7.1%}  {b.errors / b.n:>6.1%}"
        )
    return "\n".join(lines)


def _clock(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", type=Path, help="the reward log (JSONL)")
    parser.add_argument("--every", type=float, default=600, help="seconds per row of the time table (default 600)")
    args = parser.parse_args(argv)
    if not args.log.is_file():
        print(f"no reward log at {args.log} (REWARD_LOG_PATH of the job)", file=sys.stderr)
        return 2
    records, bad = read_log(args.log)
    print(report(records, args.every))
    if bad:
        print(f"\n{bad} line(s) could not be parsed", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
