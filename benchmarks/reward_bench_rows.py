"""The reward benchmark's rows: which there are, their names and seeds, --rows and --variant, and Bench, which runs
our rows for one variant against its own servers, each the number of times --repeat says."""

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from benchmarks.reward_bench_loop import LOOP_FUNCTIONS
from benchmarks.reward_bench_servers import Servers, requests_delta, server_counters, summed_delta
from benchmarks.reward_bench_workload import arrival_offsets, workload
from reward_score import safe_hack_reward_request as client

CLASSIC_ROWS = ("article", "cold", "warm", "direct", "fresh", "callers-warm", "callers-fresh")
LOOP_ROWS = ("loop-plain", "loop-async", "loop-arrivals-plain", "loop-arrivals-async")
ALL_ROWS = (*CLASSIC_ROWS, *LOOP_ROWS, "killed")


def parse_variant(spec: str, replicas: int, rows: list[str]) -> dict:
    """`NAME[:KEY=VALUE,...]`: upper-case keys are our server's environment, `replicas=N` and `rows=a+b` override
    --replicas and --rows for this variant."""
    name, _, rest = spec.partition(":")
    variant = {"name": name or "default", "env": {}, "replicas": replicas, "rows": [r for r in rows if r != "article"]}
    for item in filter(None, rest.split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--variant {spec!r}: {item!r} is not KEY=VALUE")
        if key == "replicas":
            variant["replicas"] = int(value)
        elif key == "rows":
            variant["rows"] = [r for r in check_rows(value.split("+")) if r != "article"]
        elif key.isupper():
            variant["env"][key] = value
        else:
            raise ValueError(f"--variant {spec!r}: {key!r} is neither an environment variable nor replicas/rows")
    if "killed" in variant["rows"] and variant["replicas"] < 2:
        raise ValueError(f"variant {variant['name']}: the killed row needs replicas >= 2")
    return variant


def check_rows(rows: list[str]) -> list[str]:
    unknown = [r for r in rows if r not in ALL_ROWS]
    if unknown:
        raise ValueError(f"unknown rows {unknown}; known: {', '.join(ALL_ROWS)}")
    return [r for r in ALL_ROWS if r in rows]  # always in this order: cold first, the killed row last


ROW_NAMES = {
    "cold": "ours, reward client batch function, cold",
    "warm": "ours, reward client batch function, warm",
    "direct": "ours, one POST /score_batch of the whole step, warm",
    "fresh": "ours, reward client batch function, fresh lengths",
    "callers-warm": "ours, {c} concurrent per-sample callers, warm",
    "callers-fresh": "ours, {c} concurrent per-sample callers, fresh lengths",
    "killed": "ours, reward client batch function, fresh lengths, 1 of {n} servers SIGKILLed mid-step",
}
LOOP_WORKLOADS = {  # row -> (function, spread over the arrival window?)
    "loop-plain": ("safe_hack_reward", False),
    "loop-async": ("safe_hack_reward_async", False),
    "loop-arrivals-plain": ("safe_hack_reward", True),
    "loop-arrivals-async": ("safe_hack_reward_async", True),
}
SEEDS = {"cold": 1234, "warm": 1234, "direct": 1234, "fresh": 4321, "callers-warm": 1234, "callers-fresh": 8765,
         "loop-plain": 5000, "loop-async": 5001, "loop-arrivals-plain": 5010, "loop-arrivals-async": 5011,
         "killed": 7000}  # fmt: skip
FRESH = {"fresh", "callers-fresh", "killed", *LOOP_ROWS}  # new lengths every repeat


class Bench:
    """Our rows for one variant: its servers, the reward client pointed at them, each row run `repeat` times."""

    def __init__(self, args, model_dir: Path, step, workers_factory) -> None:
        self.args, self.model_dir, self.step = args, model_dir, step
        self.workers_factory = workers_factory  # the verl-loop worker processes, started on first use
        self.on_row = None  # (rows so far, variant, servers): after each row, for partial results

    def run_variant(self, variant: dict, base_env: dict, work: Path) -> tuple[list[dict], dict]:
        args = self.args
        env = dict(base_env, **variant["env"])
        servers = Servers(variant["replicas"], self.model_dir, args.device, env, work, variant["name"])
        print(f"variant {variant['name']}: {variant['replicas']} server(s) on {servers.devices} healthy after "
              f"{servers.startup_s[-1]:.1f} s; {json.dumps(servers.health)}", flush=True)  # fmt: skip
        urls = ",".join(servers.urls)
        os.environ.update(REWARD_SERVER_URLS=urls, REWARD_PROMPT_OPENS_THINK="0", REWARD_LOG_PATH="")
        rows, peak, info = [], [], {}
        try:
            if "cold" not in variant["rows"] and not args.no_first_pass:
                self.client_batch(self.step(SEEDS["cold"])[0])  # the servers' first pass, not measured
            for row in variant["rows"]:
                rows.append(self.measure(row, servers, variant))
                if self.on_row:
                    self.on_row(rows, variant, servers)
            peak = servers.peak_gib()
        finally:
            servers.stop()
        info = {"name": variant["name"], "env": variant["env"], "replicas": variant["replicas"],
                "devices": servers.devices, "rows": variant["rows"], "startup_s": servers.startup_s[-1],
                "startup_per_replica_s": servers.startup_s, "health": servers.health, "peak_gib": peak}  # fmt: skip
        for r in rows:
            r["peak_gib"] = max(peak) if peak else None
        return rows, info

    def measure(self, row: str, servers: Servers, variant: dict) -> dict:
        repeats = 1 if row in ("cold", "killed") else self.args.repeat
        runs = []
        for k in range(repeats):
            seed = SEEDS[row] + (1000 * k if row in FRESH else 0)
            pairs, tokens = self.step(seed)
            before, before_requests = servers.counters(), servers.requests()
            extra = {}
            if row in LOOP_WORKLOADS:
                seconds, extra = self.loop_run(row, pairs, seed, servers)
            elif row == "killed":
                seconds, extra = self.killed_run(pairs, servers)
            else:
                seconds = {"cold": self.client_batch, "warm": self.client_batch, "fresh": self.client_batch,
                           "direct": self.direct_batch, "callers-warm": self.concurrent,
                           "callers-fresh": self.concurrent}[row](pairs)  # fmt: skip
            after = servers.counters()
            runs.append({"wall_s": seconds, "samples": len(pairs), "tokens": tokens,
                         "samples_per_s": len(pairs) / seconds, "tokens_per_s": tokens / seconds, "seed": seed,
                         "server": summed_delta(before, after),
                         "requests": requests_delta(before_requests, servers.requests()), **extra})  # fmt: skip
            # The share of the wall each server's GPU ran a micro-batch (from its first kernel to its last): the
            # rest is the GPU idle, waiting on HTTP, tokenizing, planning or the callers (0 on the CPU: not timed).
            live = len(servers.live_urls)
            runs[-1]["server"]["gpu_busy_share"] = runs[-1]["server"]["gpu_busy_s_total"] / seconds / live
            if "loop" in extra:
                extra["loop"]["requests"] = runs[-1]["requests"]
                # the servers' forward time over the row's wall, per server: the busy share on CPU, where a forward
                # runs while it is launched; on a GPU a lower bound (see pct_of_ceiling for the FLOP view)
                extra["loop"]["forward_busy_share"] = runs[-1]["server"]["launch_s_total"] / seconds / live
        name = ROW_NAMES.get(row, "").format(c=self.args.concurrency, n=variant["replicas"])
        if row in LOOP_WORKLOADS:
            function, spread = LOOP_WORKLOADS[row]
            workload_name = f"arrivals over {self.args.arrival_window:g} s" if spread else "all at once"
            name = f"verl loop {self.args.verl_workers}x{self.args.verl_executor}, {LOOP_FUNCTIONS[function]}, " + (
                workload_name
            )
        walls = ", ".join(f"{r['wall_s']:.2f}" for r in runs)
        print(f"  {name:<70} {walls} s  ({variant['name']})", flush=True)
        return {"row": name, "key": row, "variant": variant["name"], "replicas": variant["replicas"], "runs": runs}

    # -- the ways a step reaches the servers --

    def client_batch(self, pairs) -> float:
        n = len(pairs)
        t = time.monotonic()
        out = client.safe_hack_reward_batch(["bench"] * n, [r for _, r in pairs], [p for p, _ in pairs], [{}] * n)
        assert len(out) == n and not any(r["penalized"] or r["failed"] for r in out)
        return time.monotonic() - t

    def direct_batch(self, pairs) -> float:
        url = os.environ["REWARD_SERVER_URLS"].split(",")[0]
        t = time.monotonic()
        items = [{"prompt": p, "response": r} for p, r in pairs]
        requests.post(url + "/score_batch", json={"items": items}, timeout=600).raise_for_status()
        return time.monotonic() - t

    def concurrent(self, pairs) -> float:
        t = time.monotonic()
        with ThreadPoolExecutor(self.args.concurrency) as pool:
            out = list(pool.map(lambda pr: client.safe_hack_reward("bench", pr[1], pr[0], {}), pairs))
        assert all(not r["failed"] for r in out)
        return time.monotonic() - t

    def loop_run(self, row: str, pairs, seed: int, servers: Servers) -> tuple[float, dict]:
        function, spread = LOOP_WORKLOADS[row]
        window = self.args.arrival_window if spread else 0.0
        offsets = arrival_offsets(workload(seed, len(pairs)), window)
        start, results = self.workers_factory().run(function, pairs, offsets, ",".join(servers.urls))
        failed = sum(1 for *_, f in results if f)
        if failed:
            raise RuntimeError(f"{failed} samples failed in the verl-loop row {row}")
        arrived = [a for a, _, _, _ in results]
        done = [d for _, d, _, _ in results]
        latency = sorted(d - a for a, d, _, _ in results)
        wall = max(done) - start
        loop = {"function": function, "workload": "arrivals" if spread else "all at once", "window_s": window,
                "tail_s": max(done) - max(arrived), "latency_p50_s": latency[len(latency) // 2],
                "latency_p99_s": latency[min(len(latency) - 1, int(0.99 * len(latency)))]}  # fmt: skip
        return wall, {"loop": loop}

    def killed_run(self, pairs, servers: Servers) -> tuple[float, dict]:
        """The step through the batch function while replica 0 is SIGKILLed: `--kill-at forward` once it has
        launched a micro-batch of the step (a crash mid-forward); `start` freezes it (SIGSTOP) as the step is sent and
        kills it 0.5 s later, so its share is certainly lost (deterministic on any machine)."""
        victim, url = 0, servers.urls[0]
        forwards = server_counters(url)["forwards"]
        killed_at: list[float] = []
        began = time.monotonic()
        if self.args.kill_at == "start":
            os.killpg(servers.procs[victim].pid, signal.SIGSTOP)

        def killer() -> None:
            if self.args.kill_at == "start":
                time.sleep(0.5)
            else:
                while time.monotonic() - began < 120:
                    try:
                        if server_counters(url)["forwards"] > forwards:
                            break
                    except requests.RequestException:
                        break
                    time.sleep(0.005)
            killed_at.append(time.monotonic() - began)
            servers.kill(victim)

        thread = threading.Thread(target=killer)
        thread.start()
        try:
            seconds = self.client_batch(pairs)
        finally:
            thread.join()
        config = client.load_config()
        return seconds, {"killed": {"replica": victim, "at_s": killed_at[0], "how": self.args.kill_at,
                                    "exit_code": servers.procs[victim].returncode,
                                    "retry_budget_s": config.retry_seconds,
                                    "within_budget": seconds < config.retry_seconds}}  # fmt: skip
