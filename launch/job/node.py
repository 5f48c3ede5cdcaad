"""What one node of the job needs to know about itself: its ports, its GPUs (reward servers, compute mode), its address.

The helper runs this on every node (inside the container), one command a call, and reads its lines back. Ports: one
block of PORT_BLOCK ports a job and node, from the job id; SGLANG_PORT and NO_PROXY: why, in
docs/training.md#sharing-a-node-stopping-a-failed-node.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys
import zlib
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlsplit

import psutil

from launch.plan.settings import SGLANG_MAX_GPUS

PORT_FIRST, PORT_LAST = 20000, 32767  # 24 blocks
PORT_BLOCK = 512
# Offsets inside a block. Ray starts every one of these even with --include-dashboard=false (the dashboard head
# process still binds its port, and the dashboard agent and runtime-env agent run on every node).
RAY_PORT_OFFSETS = {
    "ray_port": 0,  # GCS (--port), head only
    "ray_client_server_port": 1,  # head only
    "dashboard_port": 2,  # head only
    "dashboard_agent_listen_port": 3,
    "dashboard_agent_grpc_port": 4,
    "node_manager_port": 5,
    "object_manager_port": 6,
    "metrics_export_port": 7,
    "runtime_env_agent_port": 8,
}
REWARD_OFFSET, REWARD_MAX = 16, 16  # reward servers: offsets 16..31
WORKER_OFFSET = 32  # --min-worker-port..--max-worker-port: up to the SGLang ports (one port per Ray worker process)
# verl's sync SGLang engines: two ports per GPU of the node (`sglang_port`), the block's last 32, up to 16 GPUs a node.
SGLANG_OFFSET = PORT_BLOCK - 2 * SGLANG_MAX_GPUS


class NodeError(ValueError):
    pass


def port_taken(port: int) -> bool:
    """True when a listener holds `port` on any address of this node (the servers bind with SO_REUSEADDR too)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("0.0.0.0", port))
        except OSError:
            return True
    return False


def first_block(job_id: str, rank: int, blocks: int) -> int:
    """Consecutive Slurm job ids get blocks 7 apart (7 and the block count share no factor): a node's ranks fit
    between."""
    base = int(job_id) * 7 if job_id.isdigit() else zlib.crc32(job_id.encode())
    return (base + rank) % blocks


def plan_ports(
    job_id: str,
    rank: int,
    reward_count: int,
    reward_port: int = 0,
    taken: Callable[[int], bool] = port_taken,
) -> dict[str, int]:
    """This node's ports: the first block from the job's own one on that is wholly free, then the hand-set port."""
    if reward_count > REWARD_MAX:
        raise NodeError(f"REWARD_REPLICAS={reward_count}: at most {REWARD_MAX} reward servers per node")
    blocks = (PORT_LAST + 1 - PORT_FIRST) // PORT_BLOCK
    start = first_block(job_id, rank, blocks)
    for i in range(blocks):
        base = PORT_FIRST + ((start + i) % blocks) * PORT_BLOCK
        if not any(taken(p) for p in range(base, base + PORT_BLOCK)):
            break
    else:
        raise NodeError(f"no free block of {PORT_BLOCK} ports between {PORT_FIRST} and {PORT_LAST} on this node")
    plan = {name: base + offset for name, offset in RAY_PORT_OFFSETS.items()}
    plan["reward_port"] = base + REWARD_OFFSET
    plan["sglang_port"] = base + SGLANG_OFFSET
    plan["min_worker_port"] = base + WORKER_OFFSET
    plan["max_worker_port"] = base + SGLANG_OFFSET - 1
    if reward_port:
        busy = [p for p in range(reward_port, reward_port + reward_count) if taken(p)]
        if busy:
            raise NodeError(
                f"CONFIG_REWARD_SERVER_PORT={reward_port}: port {busy[0]} is taken on {socket.gethostname()} "
                "(another job's server?): leave CONFIG_REWARD_SERVER_PORT empty (free ports per job)"
            )
        plan["reward_port"] = reward_port
    plan["block_moved"] = int(i)
    return plan


def training_node_index(address: str, addresses: Sequence[str]) -> int:
    """Which training node this is in verl's order: verl sorts its per-node placement groups by the nodes' addresses,
    as strings, and numbers the ranks node by node (verl/single_controller/ray/base.py:62-79, 384-390). Nodes that
    share an address (containers on one host) cannot be told apart: all get the first index."""
    if address not in addresses:
        raise NodeError(f"this node's address {address} is not among the training nodes' ({', '.join(addresses)})")
    return sorted(addresses).index(address)


def sglang_port(block_port: int, node_index: int, gpus_per_node: int) -> int:
    """SGLANG_PORT for training node k of G GPUs: verl's engine of global rank r binds SGLANG_PORT + 2r and + 2r + 1,
    so node k's engines land on block_port .. block_port + 2G - 1, its own. SGLang's scan upwards from SGLANG_PORT
    for free ports starts in this block's Ray worker range (for the first 448 / 2G nodes), never in another job's."""
    return block_port - 2 * node_index * gpus_per_node


# What Ray's dashboard head asks at start even with --disable-usage-stats, through the proxy variables
# (ray/dashboard/modules/usage_stats/usage_stats_head.py): never through a proxy.
RAY_OWN_HOSTS = ("169.254.169.254", "metadata.google.internal", "usage-stats.ray.io")


def no_proxy(hosts: Sequence[str], environ: Mapping[str, str]) -> str:
    """NO_PROXY (and no_proxy) for the job's processes: what the environment had in either spelling, then loopback,
    the job's own hosts and RAY_OWN_HOSTS, each once."""
    names = []
    local = ("localhost,127.0.0.1,::1", *hosts, *RAY_OWN_HOSTS)
    for raw in (environ.get("NO_PROXY", ""), environ.get("no_proxy", ""), *local):
        names += [n.strip() for n in raw.split(",") if n.strip()]
    return ",".join(dict.fromkeys(names))


def host_of(item: str) -> str:
    """The host of a URL (http://10.0.0.1:20016), an address with a port (10.0.0.1:6379) or a bare host."""
    return urlsplit(item if "://" in item else "//" + item).hostname or item


def reward_gpus(indices: str, visible: str | None) -> list[str]:
    """CONFIG_REWARD_GPUS are indices into this job's GPUs (CUDA_VISIBLE_DEVICES as Slurm set it): the GPUs to use."""
    own = [g for g in (visible or "").split(",") if g]
    out = []
    for raw in [g.strip() for g in indices.split(",") if g.strip()]:
        if not raw.isdigit():
            raise NodeError(f"CONFIG_REWARD_GPUS={indices!r}: '{raw}' is not a GPU index (use e.g. 0 or 0,1)")
        i = int(raw)
        if visible is None:
            out.append(raw)  # no CUDA_VISIBLE_DEVICES: a workstation, every GPU is ours
        elif i >= len(own):
            raise NodeError(
                f"CONFIG_REWARD_GPUS={indices!r}: index {i} but this job has {len(own)} GPU(s) on this node "
                f"(CUDA_VISIBLE_DEVICES={visible}); the indices count from 0 within the job's GPUs"
            )
        else:
            out.append(own[i])
    return out


def compute_mode_problem(smi: str, visible: str | None) -> str | None:
    """This job's GPUs in a compute mode other than Default (docs/operations.md says why), from `nvidia-smi
    --query-gpu=index,compute_mode --format=csv,noheader`, or None. Where Slurm confines the job's devices (cgroups),
    nvidia-smi lists only them, renumbered from 0: its rows are the job's as they are."""
    modes = dict(map(str.strip, line.split(",", 1)) for line in smi.splitlines() if "," in line)
    own = [g for g in (visible or "").split(",") if g]
    if not own or not set(own) <= modes.keys():
        own = list(modes)
    return "; ".join(f"GPU {g} in {modes[g]} mode" for g in own if modes[g] != "Default") or None


def interfaces() -> dict[str, str]:
    """Each network interface that has an IPv4 address, with its first one."""
    return {
        name: ipv4[0].address
        for name, addrs in psutil.net_if_addrs().items()
        if (ipv4 := [a for a in addrs if a.family == socket.AF_INET])
    }


def host_addresses(hostname: str) -> list[str]:
    """The IPv4 addresses the host name resolves to (what `hostname --ip-address` looks at), in order, no repeats."""
    try:
        infos = socket.getaddrinfo(hostname, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def pick_address(interface: str, nodes: int, resolved: Sequence[str], iface_addr: str | None, available: str) -> str:
    """The address to publish: the interface's when CONFIG_NETWORK_INTERFACE is set, else the host name's first
    non-loopback IPv4; loopback only on a one-node job."""
    if interface:
        if not iface_addr:
            raise NodeError(
                f"CONFIG_NETWORK_INTERFACE={interface}: no such interface with an IPv4 address on "
                f"{socket.gethostname()} (interfaces: {available})"
            )
        return iface_addr
    routable = [a for a in resolved if not ipaddress.ip_address(a).is_loopback]
    if routable:
        return routable[0]
    if nodes <= 1:
        return "127.0.0.1"
    raise NodeError(
        f"the host name of {socket.gethostname()} resolves only to {', '.join(resolved) or 'nothing'} (loopback), "
        f"which the other nodes cannot reach: set CONFIG_NETWORK_INTERFACE to one of: {available}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m launch.job.node", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("ports")
    p.add_argument("--job-id", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--reward-count", type=int, default=0)
    p.add_argument("--reward-port", default="", help="CONFIG_REWARD_SERVER_PORT as set (empty: per job)")
    g = sub.add_parser("reward-gpus")
    g.add_argument("indices")
    a = sub.add_parser("address")
    a.add_argument("--interface", default="")
    a.add_argument("--nodes", type=int, default=1)
    s = sub.add_parser("sglang-port")
    s.add_argument("--block-port", type=int, required=True, help="sglang_port of this node's plan (ports)")
    s.add_argument("--gpus", type=int, required=True, help="CONFIG_GPUS_PER_NODE")
    s.add_argument("--address", required=True, help="this node's address, as it starts Ray with it")
    s.add_argument("--addresses", required=True, help="every training node's address, comma-separated")
    sub.add_parser("gpu-modes", help="nvidia-smi --query-gpu=index,compute_mode --format=csv,noheader on stdin")
    n = sub.add_parser("no-proxy")
    n.add_argument("hosts", nargs="*", help="hosts, addresses with a port, or URLs; comma-separated lists too")
    args = parser.parse_args(argv)
    try:
        if args.command == "ports":
            if args.reward_port and not args.reward_port.isdigit():
                raise NodeError(
                    f"CONFIG_REWARD_SERVER_PORT={args.reward_port!r} is not a port number "
                    "(or leave it empty: free ports)"
                )
            plan = plan_ports(args.job_id, args.rank, args.reward_count, int(args.reward_port or 0))
            print("\n".join(f"{k}={v}" for k, v in plan.items()))
        elif args.command == "reward-gpus":
            print(",".join(reward_gpus(args.indices, os.environ.get("CUDA_VISIBLE_DEVICES"))))
        elif args.command == "sglang-port":
            index = training_node_index(args.address, [a for a in args.addresses.split(",") if a])
            print(sglang_port(args.block_port, index, args.gpus))
        elif args.command == "gpu-modes":
            print(compute_mode_problem(sys.stdin.read(), os.environ.get("CUDA_VISIBLE_DEVICES")) or "")
        elif args.command == "no-proxy":
            hosts = [host_of(item) for raw in args.hosts for item in raw.split(",") if item.strip()]
            print(no_proxy(hosts, os.environ))
        else:
            found = interfaces()
            available = ", ".join(f"{n} ({ip})" for n, ip in found.items()) or "none found"
            iface_addr = found.get(args.interface) if args.interface else None
            print(pick_address(args.interface, args.nodes, host_addresses(socket.gethostname()), iface_addr, available))
    except NodeError as exc:
        print(f"setting error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
