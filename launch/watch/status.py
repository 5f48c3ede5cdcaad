"""Where a job is, when it ends and whether it learns, in one command; read-only, for a running job or an ended one.

    python -m launch.watch.status                      # the newest job in CONFIG_LOG_DIR (default: logs/)
    python -m launch.watch.status 24                   # job 24: logs/24, logs/24-r1, ... and what Slurm says
    python -m launch.watch.status logs/24-r1           # the job that folder belongs to
    python -m launch.watch.status 24 --follow          # again every 60 s (--follow 10: every 10 s) until the job ends

What it reads and what it says: docs/operations.md#watching-a-run. Nothing is written.
"""

# This module renders the text and runs the command; launch/watch/reading.py reads the
# job, launch/watch/health.py judges it. The docstring above is the command's --help.

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from launch.watch.health import FINAL, report
from launch.watch.reading import StatusError, clock, duration, load, read_text

# --- as text ---------------------------------------------------------------------------------------------------------


def size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def steps_text(steps: list[int]) -> str:
    return "no step" if not steps else f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


def render(r: dict) -> str:
    lines = [f"job {r['job']}: {r['state'].upper()}" + (f": {r['why']}" if r["why"] else "")]
    slurm = r["slurm"]
    local = r["job"].startswith("local-")  # the run script's id outside Slurm (CONTAINER=none, make demo)
    lines.append(
        f"  Slurm (scontrol): {slurm['state']}" + (f", Restarts={slurm['restarts']}" if slurm.get("restarts") else "")
        if slurm
        else "  a local run, outside Slurm"
        if local
        else f"  Slurm: {'; '.join(r['slurm_notes'])}"
    )
    if r["canary"]:
        summary = Path(r["canary"]) / "summary.txt"
        if summary.is_file():
            lines.append(f"  a canary job (CANARY=1): its table, {summary}:")
            lines += [f"    {line}" for line in read_text(summary).splitlines()]
        else:
            lines.append(f"  a canary job (CANARY=1): its table comes at its end, {summary}")
    lines.append(f"starts ({len(r['starts'])}):")
    for s in r["starts"]:
        resumed = {None: "", 0: " from scratch"}.get(s["resumed_from"], f" resumed at step {s['resumed_from']}")
        end = clock(s["ended"]) if s["ended"] else "now" if s is r["starts"][-1] and r["state"] == "running" else "?"
        how = s["how"] or (f"exit code {s['exit_code']}" if s["exit_code"] is not None else "")
        lines.append(
            f"  {s['name']:<12} {clock(s['began'])} - {end:<16}  "
            + (f"[{s['kind']}] " if s["kind"] else "")
            + f"{steps_text(s['steps'])}{resumed}"
            + (f"; {how}" if how else "")
        )
    p = r["progress"]
    if p.get("total"):
        lines.append(
            f"progress: step {p['step']} of {p['total']} ({p['step'] / p['total']:.0%})"
            + (f", {p['remaining_steps']} to go" if p.get("remaining_steps") else "")
        )
    elif not any(s["steps"] for s in r["starts"]):
        lines.append("progress: no steps yet")
    else:
        lines.append(f"progress: step {p['step']} (the total is unknown until verl prints 'Total training steps')")
    if p.get("step_s") is not None:
        lines.append(
            f"  a step takes {p['step_s']:.1f} s (timing_s/step, median of the last 10), "
            f"{p['wall_per_step_s']:.1f} s with validations and saves"
        )
    if p.get("eta"):
        starts = p.get("starts_left")
        running = r["state"] == "running"
        more = (
            "in this start"
            if running and starts == 1
            else f"in {starts} starts, this one included"
            if running
            else f"in {starts} start(s)"
        )
        lines.append(
            f"  ETA {clock(p['eta'])} ({duration(p['remaining_s'])} of training {more}"
            + (", queue waits not counted" if starts and starts > 1 else "")
            + ")"
        )
        if p.get("time_limit_s"):
            lines.append(
                f"  per start: {duration(p['time_limit_s'])} limit, startup ~{duration(p.get('startup_s') or 0)}, "
                f"saves ~{p.get('steps_per_start')} steps (CHECKPOINT_BEFORE_END={p['checkpoint_before_end_s']} s)"
                + (f"; this start saves ~{p['this_start_saves']} more" if p.get("this_start_saves") is not None else "")
            )
    ckpt = r["checkpoint"]
    if ckpt and ckpt.get("step") is not None:
        age = r["now"] - ckpt["saved"] if ckpt.get("saved") else None
        lines.append(
            f"checkpoint: step {ckpt['step']}, {duration(age) + ' ago' if age is not None else '?'}, "
            f"{size(ckpt['bytes'])} ({ckpt['path']})" + ("; TRAINING_DONE" if ckpt["training_done"] else "")
        )
    elif ckpt:
        lines.append(f"checkpoint: none yet in {ckpt['root']}")
    restarts = sum(len(s["reward_restarts"]) for s in r["starts"])
    lines.append(f"reward servers: {restarts} restart(s)" if restarts else "reward servers: no restarts")
    if r["metrics"]:
        lines.append("metrics: newest value (its step; change over the last steps)  healthy:")
        for key, m in r["metrics"].items():
            lines.append(
                f"  {key:<34} {m['value']:>9.4g} ({m['step']}; {m['change']:+.3g} over {m['over']})  {m['healthy']}"
            )
    for w in r["warnings"]:
        lines.append(f"WARNING: {w}")
    newest = r["starts"][-1] if r["starts"] else None
    if newest:
        lines.append("logs: " + ", ".join(x for x in (newest["log"] or newest["folder"], r["output"]) if x))
    return "\n".join(lines)


# --- main -------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m launch.watch.status", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("job", nargs="?", help="a job id, or a start's log folder (default: the newest job)")
    p.add_argument("--log-dir", type=Path, help="where the job folders are (default: CONFIG_LOG_DIR, else logs/)")
    p.add_argument(
        "--follow",
        nargs="?",
        type=float,
        const=60.0,
        metavar="SECONDS",
        help="print again every SECONDS (default 60) until the job ends",
    )
    args = p.parse_args(argv)
    if args.follow is not None and args.follow <= 0:
        p.error("--follow: seconds between refreshes, more than 0")
    try:
        while True:
            job = load(args.job, args.log_dir)
            r = report(job)
            print(render(r), flush=True)
            if args.follow is None or r["state"] in FINAL:
                return 0
            args.job = job.id  # the same job on every refresh, even when a newer one starts
            time.sleep(args.follow)
            print(f"--- {clock(time.time())} ---", flush=True)
    except StatusError as exc:
        print(f"status: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
