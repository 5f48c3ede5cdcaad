"""Wait until this job's Ray cluster has every expected node and GPU, or say what is missing.

    python -m launch.ray_cluster wait --address 10.0.0.1:6379 --nodes 2 --gpus 8 --timeout 600 --watch-pid 1234

Exit 0 when ready; 1 on timeout ("1/2 nodes, 4/8 GPUs after 600 s") or when a watched process died.
"""

import argparse
import sys
import time


def alive(pid: int) -> bool:
    """The process runs; an exited but unreaped child (a zombie) counts as gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def count(ray) -> tuple[int, float]:
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    return nodes, float(ray.cluster_resources().get("GPU", 0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["wait"])
    p.add_argument("--address", required=True)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus", type=float, default=0)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--watch-pid", type=int, action="append", default=[])
    args = p.parse_args(argv)

    import ray

    deadline = time.monotonic() + args.timeout
    connected, last_error = False, None
    last = (0, 0.0)
    while time.monotonic() < deadline:
        dead = [pid for pid in args.watch_pid if not alive(pid)]
        if dead:
            print(f"ray_cluster: process {dead[0]} exited while waiting for the cluster", file=sys.stderr)
            return 1
        if not connected:
            try:
                ray.init(address=args.address, logging_level="ERROR", log_to_driver=False)
                connected = True
            except Exception as exc:  # the head may still be starting: retried until the deadline
                last_error = exc
                time.sleep(2)
                continue
        last = count(ray)
        if last[0] >= args.nodes and last[1] >= args.gpus:
            print(f"ray cluster ready: {last[0]}/{args.nodes} nodes, {last[1]:g}/{args.gpus:g} GPUs")
            ray.shutdown()
            return 0
        time.sleep(2)
    where = "" if connected else f" (could not connect: {last_error})"
    print(
        f"ray cluster not complete: {last[0]}/{args.nodes} nodes, {last[1]:g}/{args.gpus:g} GPUs after "
        f"{args.timeout:.0f} s{where}",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
