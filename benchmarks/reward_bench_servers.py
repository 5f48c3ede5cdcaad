"""The reward benchmark's servers: starting one and waiting for its /health, our server replicas of a variant
(Servers), and what their /metrics say about a row: the counters that explain it, the requests per endpoint and the
peak memory, summed over the replicas alive before and after."""

import os
import signal
import sys
import time
from pathlib import Path

import requests

from launch.plan.procs import free_port, start_process, stop_process, wait_for_http

REPO = Path(__file__).resolve().parent.parent


_PROFILE = {
    "forwards": "reward_forward_seconds_count",
    "forward_launch_s": "reward_forward_seconds_sum",
    "rows": "reward_batch_rows_sum",
    "padded_tokens": "reward_padded_tokens_total",
    "requests": "reward_queue_wait_seconds_count",
    "queue_wait_s": "reward_queue_wait_seconds_sum",
    "prepare_s": "reward_prepare_seconds_sum",
    "prepare_passes": "reward_prepare_seconds_count",
    "gpu_busy_s": "reward_gpu_busy_seconds_total",
    "packed": "reward_packed_forwards_total",
}


def metrics(url: str) -> dict[str, float]:
    """The server's /metrics: each sample's name with its labels, and its value."""
    lines = requests.get(url + "/metrics", timeout=10).text.splitlines()
    return {name: float(value) for name, _, value in (x.rpartition(" ") for x in lines if x and x[0] != "#")}


def server_counters(url: str) -> dict[str, float]:
    """The server's own counters that explain a row: micro-batches, rows, padding, waits."""
    values = metrics(url)
    return {key: values.get(name, 0.0) for key, name in _PROFILE.items()}


def profile_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    d = {k: after[k] - before[k] for k in before}
    forwards = max(d["forwards"], 1)
    return {
        "micro_batches": d["forwards"], "rows_per_micro_batch": d["rows"] / forwards,
        "padded_tokens": d["padded_tokens"], "launch_s_total": d["forward_launch_s"],
        "prepare_s_total": d["prepare_s"], "prepare_passes": d["prepare_passes"],
        "queue_wait_ms_mean": 1000 * d["queue_wait_s"] / max(d["requests"], 1),
        "gpu_busy_s_total": d["gpu_busy_s"], "packed_micro_batches": d["packed"],
    }  # fmt: skip


PID_FILE: Path | None = None  # --pid-file: every server started is listed there (to clean up after a kill)


def launch(cmd: list[str], log: Path, env: dict):
    proc = start_process(cmd, log, env)
    if PID_FILE is not None:
        with open(PID_FILE, "a") as f:
            f.write(f"{proc.pid}\n")
    return proc


def start(cmd: list[str], log: Path, port: int, env: dict, timeout: float = 900):
    """`cmd` (a server on `port`), returned once its /health answers 200."""
    proc = launch(cmd, log, env)
    try:
        wait_for_http(proc, f"http://127.0.0.1:{port}/health", log, timeout, name=Path(cmd[1]).name)
    except BaseException:
        stop_process(proc)
        raise
    return proc


def request_counts(url: str) -> dict[str, float]:
    """Answered requests per endpoint."""
    values = metrics(url)
    return {
        e: values.get(f'reward_requests_total{{endpoint="{e}",status="200"}}', 0.0) for e in ("/score", "/score_batch")
    }


class Servers:
    """`n` of our servers on loopback, one per visible GPU (several on one GPU when fewer are visible), started at
    once; `urls` is what REWARD_SERVER_URLS gets."""

    def __init__(self, n: int, model_dir: Path, device: str, env: dict, work: Path, name: str) -> None:
        devices = [device] * n
        if device == "cuda":
            import torch

            visible = max(1, torch.cuda.device_count())
            devices = [f"cuda:{i % visible}" for i in range(n)]
        self.ports = [free_port() for _ in range(n)]
        self.urls = [f"http://127.0.0.1:{port}" for port in self.ports]
        self.devices = devices
        self.procs, self.alive = [], [True] * n
        began = time.monotonic()
        cmd = [sys.executable, str(REPO / "reward_score" / "reward_server.py")]
        try:
            for k, (port, dev) in enumerate(zip(self.ports, devices, strict=True)):
                server_env = dict(env, REWARD_MODEL_PATH=str(model_dir), REWARD_DEVICE=dev, REWARD_PORT=str(port),
                                  REWARD_HOST="127.0.0.1")  # fmt: skip
                self.procs.append(launch(cmd, work / f"server_{name}_{k}.log", server_env))
            self.startup_s = []
            for k, (proc, url) in enumerate(zip(self.procs, self.urls, strict=True)):
                wait_for_http(proc, url + "/health", work / f"server_{name}_{k}.log", 900, name=f"server {name}/{k}")
                self.startup_s.append(time.monotonic() - began)
        except BaseException:
            self.stop()
            raise
        self.health = requests.get(self.urls[0] + "/health", timeout=10).json()

    @property
    def live_urls(self) -> list[str]:
        return [u for u, ok in zip(self.urls, self.alive, strict=True) if ok]

    def counters(self) -> dict[str, dict[str, float]]:
        return {u: server_counters(u) for u in self.live_urls}

    def requests(self) -> dict[str, dict[str, float]]:
        return {u: request_counts(u) for u in self.live_urls}

    def kill(self, k: int) -> None:
        """SIGKILL replica k (its process group) as a crash would: no drain, connections reset."""
        os.killpg(self.procs[k].pid, signal.SIGKILL)
        self.procs[k].wait()
        self.alive[k] = False

    def peak_gib(self) -> list[float]:
        return [metrics(u).get("reward_gpu_memory_peak_bytes", 0.0) / 2**30 for u in self.live_urls]

    def stop(self) -> None:
        for proc in self.procs:
            stop_process(proc, 30)


def summed_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float]:
    """profile_delta over the servers present both times (a killed one drops out), summed."""
    common = [u for u in after if u in before]
    total_before = {k: sum(before[u][k] for u in common) for k in _PROFILE}
    total_after = {k: sum(after[u][k] for u in common) for k in _PROFILE}
    return profile_delta(total_before, total_after)


def requests_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float]:
    common = [u for u in after if u in before]
    return {e: sum(after[u][e] - before[u][e] for u in common) for e in ("/score", "/score_batch")}
