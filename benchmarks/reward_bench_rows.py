"""The reward benchmark's rows: which there are, their names and seeds, --rows and --variant; a variant's server and
what its /metrics say about a row; and Bench, which runs a variant's rows against its own server, each row the number
of times --repeat says."""

import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from launch.plan.procs import free_port, start_process, stop_process, wait_for_http
from reward_score import safe_hack_reward_request as client

REPO = Path(__file__).resolve().parent.parent
ROWS = {  # key -> (name, the seed of its lengths), in the order they run: cold first
    "cold": ("ours, reward client batch function, cold", 1234),
    "warm": ("ours, reward client batch function, warm", 1234),
    "fresh": ("ours, reward client batch function, fresh lengths", 4321),
    "callers-warm": ("ours, {c} concurrent per-sample callers, warm", 1234),
    "callers-fresh": ("ours, {c} concurrent per-sample callers, fresh lengths", 8765),
}
FRESH = {"fresh", "callers-fresh"}  # new lengths every repeat


def check_rows(rows: list[str]) -> list[str]:
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known: {', '.join(ROWS)}")
    return [r for r in ROWS if r in rows]


def parse_variant(spec: str, rows: list[str]) -> dict:
    """`NAME[:KEY=VALUE,...]`: upper-case keys are our server's environment, `rows=a+b` overrides --rows for it."""
    name, _, rest = spec.partition(":")
    variant = {"name": name or "default", "env": {}, "rows": rows}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--variant {spec!r}: {item!r} is not KEY=VALUE")
        if key == "rows":
            variant["rows"] = check_rows(value.split("+"))
        elif key.isupper():
            variant["env"][key] = value
        else:
            raise ValueError(f"--variant {spec!r}: {key!r} is neither an environment variable nor rows")
    return variant


# --- the server and its counters -------------------------------------------------------------------------------

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
PID_FILE: Path | None = None  # --pid-file: every server started is listed there (to clean up after a kill)


def metrics(url: str) -> dict[str, float]:
    """The server's /metrics: each sample's name with its labels, and its value."""
    lines = requests.get(url + "/metrics", timeout=10).text.splitlines()
    return {name: float(value) for name, _, value in (x.rpartition(" ") for x in lines if x and x[0] != "#")}


def counters(url: str) -> dict[str, float]:
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


class Server:
    """Our reward server on loopback with a variant's environment, returned once its /health answers 200."""

    def __init__(self, model_dir: Path, device: str, env: dict, log: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        began = time.monotonic()
        server_env = dict(env, REWARD_MODEL_PATH=str(model_dir), REWARD_DEVICE=device, REWARD_PORT=str(port),
                          REWARD_HOST="127.0.0.1")  # fmt: skip
        self.proc = start_process([sys.executable, str(REPO / "reward_score" / "reward_server.py")], log, server_env)
        if PID_FILE is not None:
            with open(PID_FILE, "a") as f:
                f.write(f"{self.proc.pid}\n")
        try:
            wait_for_http(self.proc, self.url + "/health", log, 900, name=f"the server ({log.name})")
        except BaseException:
            stop_process(self.proc)
            raise
        self.startup_s = time.monotonic() - began
        self.health = requests.get(self.url + "/health", timeout=10).json()


# --- the rows ----------------------------------------------------------------------------------------------------


class Bench:
    """Our rows for one variant: its server, the reward client pointed at it, each row run `repeat` times."""

    def __init__(self, args, model_dir: Path, step) -> None:
        self.args, self.model_dir, self.step = args, model_dir, step
        self.on_row = None  # (rows so far, variant, server): after each row, for partial results

    def run_variant(self, variant: dict, base_env: dict, work: Path) -> tuple[list[dict], dict]:
        args = self.args
        server = Server(self.model_dir, args.device, dict(base_env, **variant["env"]),
                        work / f"server_{variant['name']}.log")  # fmt: skip
        print(f"variant {variant['name']}: server healthy after {server.startup_s:.1f} s; {json.dumps(server.health)}",
              flush=True)  # fmt: skip
        os.environ.update(REWARD_SERVER_URLS=server.url, REWARD_PROMPT_OPENS_THINK="0", REWARD_LOG_PATH="")
        rows = []
        try:
            if "cold" not in variant["rows"] and not args.no_first_pass:
                self.client_batch(self.step(ROWS["cold"][1])[0])  # the server's first pass, not measured
            for row in variant["rows"]:
                rows.append(self.measure(row, server, variant))
                if self.on_row:
                    self.on_row(rows, variant, server)
            peak = metrics(server.url).get("reward_gpu_memory_peak_bytes", 0.0) / 2**30
        finally:
            stop_process(server.proc, 30)
        info = {"name": variant["name"], "env": variant["env"], "rows": variant["rows"],
                "startup_s": server.startup_s, "health": server.health, "peak_gib": peak}  # fmt: skip
        for r in rows:
            r["peak_gib"] = peak
        return rows, info

    def measure(self, row: str, server: Server, variant: dict) -> dict:
        name, first_seed = ROWS[row]
        call = self.concurrent if row.startswith("callers") else self.client_batch
        runs = []
        for k in range(1 if row == "cold" else self.args.repeat):
            seed = first_seed + (1000 * k if row in FRESH else 0)
            pairs, tokens = self.step(seed)
            before = counters(server.url)
            seconds = call(pairs)
            profile = profile_delta(before, counters(server.url))
            # The share of the wall the server's GPU ran a micro-batch (from its first kernel to its last): the rest
            # is the GPU idle, waiting on HTTP, tokenizing, planning or the callers (0 on the CPU: not timed).
            profile["gpu_busy_share"] = profile["gpu_busy_s_total"] / seconds
            runs.append({"wall_s": seconds, "samples": len(pairs), "tokens": tokens, "seed": seed,
                         "samples_per_s": len(pairs) / seconds, "tokens_per_s": tokens / seconds,
                         "server": profile})  # fmt: skip
        name = name.format(c=self.args.concurrency)
        walls = ", ".join(f"{r['wall_s']:.2f}" for r in runs)
        print(f"  {name:<70} {walls} s  ({variant['name']})", flush=True)
        return {"row": name, "key": row, "variant": variant["name"], "runs": runs}

    # -- the two ways a step reaches the server --

    def client_batch(self, pairs) -> float:
        n = len(pairs)
        t = time.monotonic()
        out = client.safe_hack_reward_batch(["bench"] * n, [r for _, r in pairs], [p for p, _ in pairs], [{}] * n)
        assert len(out) == n and not any(r["penalized"] or r["failed"] for r in out)
        return time.monotonic() - t

    def concurrent(self, pairs) -> float:
        t = time.monotonic()
        with ThreadPoolExecutor(self.args.concurrency) as pool:
            out = list(pool.map(lambda pr: client.safe_hack_reward("bench", pr[1], pr[0], {}), pairs))
        assert all(not r["failed"] for r in out)
        return time.monotonic() - t
