"""Wait until this job's Ray cluster has every expected node and GPU, or say what is missing.

    python -m launch.job.ray_cluster wait --address 10.0.0.1:6379 --nodes 2 --gpus 8 --timeout 600 --watch-pid 1234

Exit 0 when ready; 1 on timeout ("1/2 nodes, 4/8 GPUs after 600 s") or when a watched process died. `ray.init` can
block with no limit (an address that accepts TCP and never answers), so the connection and the counting run in a
child process (`probe`) that reports one JSON line per attempt; this process keeps the deadline and the watched PIDs.
"""

import argparse
import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import threading
import time

POLL_SECONDS = 2.0  # between cluster counts, and before reconnecting after a failed ray.init
PROBE_PREFIX = "ray_cluster probe: "  # marks the probe's report lines among anything Ray itself prints


def alive(pid: int) -> bool:
    """The process runs; an exited but unreaped child (a zombie) counts as gone (common.sh's `alive`, for Python)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # gone, or going while read
        return False


def emit(record: dict) -> None:
    print(PROBE_PREFIX + json.dumps(record), flush=True)


def probe(args) -> int:
    """The child: connect (again after a failure: the head may still be starting), then report the cluster's size
    every POLL_SECONDS until it is complete. It ends itself when its parent is gone, in case a blocked ray.init
    ignores SIGTERM."""
    parent = os.getppid()

    def guard() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(3)

    threading.Thread(target=guard, daemon=True).start()
    import ray

    while True:
        try:
            ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
            break
        except Exception as exc:
            emit({"error": f"{type(exc).__name__}: {exc}"})
            with contextlib.suppress(Exception):  # a failure inside ray.init may leave it half connected
                ray.shutdown()
            time.sleep(POLL_SECONDS)
    while True:
        nodes, gpus = sum(1 for n in ray.nodes() if n.get("Alive")), float(ray.cluster_resources().get("GPU", 0))
        emit({"nodes": nodes, "gpus": gpus})
        if nodes >= args.nodes and gpus >= args.gpus:
            ray.shutdown()
            return 0
        time.sleep(POLL_SECONDS)


def read_reports(proc: subprocess.Popen, reports: queue.Queue) -> None:
    """The probe's report lines as they come, then None when it has ended."""
    for line in proc.stdout:
        if line.startswith(PROBE_PREFIX):
            reports.put(json.loads(line[len(PROBE_PREFIX) :]))
    reports.put(None)


def wait(args, argv: list[str]) -> int:
    """Read the probe's reports until the cluster is complete, the deadline passes or a watched process dies."""
    start = time.monotonic()
    deadline = start + args.timeout
    nodes, gpus, error = 0, 0.0, None
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "probe", *argv], stdout=subprocess.PIPE, text=True
    )
    reports: queue.Queue = queue.Queue()
    threading.Thread(target=read_reports, args=(proc, reports), daemon=True).start()
    try:
        while (now := time.monotonic()) < deadline:
            dead = [pid for pid in args.watch_pid if not alive(pid)]
            if dead:
                print(f"ray_cluster: process {dead[0]} exited while waiting for the cluster", file=sys.stderr)
                return 1
            try:
                report = reports.get(timeout=min(0.5, deadline - now))
            except queue.Empty:
                continue
            if report is None:  # the probe died (it retries every failure itself): no point waiting on
                error = f"the probe exited with {proc.wait()}"
                break
            error = report.get("error")
            nodes, gpus = report.get("nodes", nodes), report.get("gpus", gpus)
            if nodes >= args.nodes and gpus >= args.gpus:
                # Without a GPU (make demo, the CPU tests) Ray's GPUs are CONFIG_GPUS_PER_NODE's placeholders
                cpu = (
                    " (placeholders: no GPU here, torch computes on the CPU)" if not shutil.which("nvidia-smi") else ""
                )
                print(f"ray cluster ready: {nodes}/{args.nodes} nodes, {gpus:g}/{args.gpus:g} GPUs{cpu}")
                with contextlib.suppress(subprocess.TimeoutExpired):  # the probe disconnects from Ray on its own
                    proc.wait(5)
                return 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    where = f" (could not connect to {args.address}: {error or 'ray.init had not returned'})"
    print(
        f"ray cluster not complete: {nodes}/{args.nodes} nodes, {gpus:g}/{args.gpus:g} GPUs after "
        f"{time.monotonic() - start:.0f} s{where if error or not nodes else ''}",
        file=sys.stderr,
    )
    return 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["wait", "probe"])  # probe: the child that `wait` starts
    p.add_argument("--address", required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus", type=float, default=0)
    p.add_argument("--timeout", type=float, default=600)  # wait only
    p.add_argument("--watch-pid", type=int, action="append", default=[])
    args = p.parse_args(argv)
    return probe(args) if args.command == "probe" else wait(args, argv[1:])


if __name__ == "__main__":
    sys.exit(main())
