"""Wait until this job's Ray cluster has every expected node and GPU, or say what is missing.

    python -m launch.job.ray_cluster wait --address 10.0.0.1:6379 --nodes 2 --gpus 8 --timeout 600 --watch-pid 1234

Exit 0 when ready; 1 on timeout ("1/2 nodes, 4/8 GPUs after 600 s") or when a watched process died.

`ray.init` can block with no limit (an address that accepts TCP and never answers; two jobs on one node sharing Ray's
default ports hung past 240 s), so the connection and the counting run in a child process (`probe`), which reports
one JSON line per attempt and poll; this process keeps the deadline and the watched PIDs, and kills the child when
either ends. The timeout counts from when the probe has imported Ray (a few seconds, itself bounded by the timeout).
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


def alive(pid: int) -> bool:
    """The process runs; an exited but unreaped child (a zombie) counts as gone (common.sh's `alive`, for Python)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):  # gone, or going while read
        return False


def ready(nodes: int, gpus: float, args) -> bool:
    return nodes >= args.nodes and gpus >= args.gpus


PROBE_PREFIX = "ray_cluster probe: "  # marks the probe's report lines among anything Ray itself prints


def emit(record: dict) -> None:
    sys.stdout.write(PROBE_PREFIX + json.dumps(record) + "\n")
    sys.stdout.flush()


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
        emit({"connecting": True})
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
        if ready(nodes, gpus, args):
            ray.shutdown()
            return 0
        time.sleep(POLL_SECONDS)


def read_reports(proc: subprocess.Popen, reports: queue.Queue) -> None:
    """The probe's report lines as they come, then None when it has ended."""
    for line in proc.stdout:
        if line.startswith(PROBE_PREFIX):
            reports.put(json.loads(line[len(PROBE_PREFIX) :]))
    reports.put(None)


def wait(args) -> int:
    """Read the probe's reports until the cluster is complete, the deadline passes or a watched process dies."""
    # The timeout counts from when the probe has imported Ray (its first attempt to connect), and the import itself
    # must finish within the timeout too.
    deadline, imported = time.monotonic() + args.timeout, False
    last, connected, last_error, since = (0, 0.0), False, None, None  # since: when the running ray.init began
    command = [
        sys.executable,
        os.path.abspath(__file__),
        "probe",
        "--address",
        args.address,
        "--nodes",
        str(args.nodes),
        "--gpus",
        str(args.gpus),
    ]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
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
                since, last_error = None, f"the probe exited with {proc.wait()}"
                break
            if "connecting" in report:
                if not imported:  # the first attempt: Ray is imported, the timeout starts now
                    deadline, imported = time.monotonic() + args.timeout, True
                since = time.monotonic()
            elif "error" in report:
                since, last_error = None, report["error"]
            else:
                connected, last = True, (report["nodes"], report["gpus"])
                if ready(*last, args):
                    # Without a GPU (make demo, the CPU tests) Ray's GPUs are CONFIG_GPUS_PER_NODE's placeholders
                    placeholders = (
                        " (placeholders: no GPU here, torch computes on the CPU)"
                        if shutil.which("nvidia-smi") is None
                        else ""
                    )
                    print(
                        f"ray cluster ready: {last[0]}/{args.nodes} nodes, {last[1]:g}/{args.gpus:g} GPUs{placeholders}"
                    )
                    # the probe disconnects from Ray on its own (ray.shutdown); killed only if that hangs
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        proc.wait(5)
                    return 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if connected:
        where = ""
    elif since is not None:
        waited = time.monotonic() - since
        where = f" (could not connect: ray.init(address={args.address!r}) had not returned after {waited:.0f} s"
        where += f"; the attempt before it: {last_error})" if last_error else ")"
    else:
        where = f" (could not connect: {last_error or 'the probe had not even imported ray'})"
    print(
        f"ray cluster not complete: {last[0]}/{args.nodes} nodes, {last[1]:g}/{args.gpus:g} GPUs after "
        f"{time.monotonic() - deadline + args.timeout:.0f} s{where}",  # the time waited
        file=sys.stderr,
    )
    return 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["wait", "probe"])  # probe: the child that `wait` starts
    p.add_argument("--address", required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus", type=float, default=0)
    p.add_argument("--timeout", type=float, default=600)  # wait only
    p.add_argument("--watch-pid", type=int, action="append", default=[])
    args = p.parse_args(argv)
    return probe(args) if args.command == "probe" else wait(args)


if __name__ == "__main__":
    sys.exit(main())
