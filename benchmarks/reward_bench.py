"""Reward scoring benchmark: one GRPO step (1024 pairs) through our reward server, over HTTP.

The workload (1024 pairs of seeded lengths, random-weight models of the public configs' shapes, a word-level tokenizer)
and the ceiling (the step's FLOP at the bf16 matmul rate measured in this run) are docs/reward-benchmark.md's.

Rows (`--rows`, comma-separated; default all): our server called by our reward client's batch function (`cold`: the
first step after the server starts, `fresh`: fresh lengths), and by 64 concurrent per-sample callers (`callers-fresh`;
rows removed in issue #61: benchmarks/HISTORY.md).

`--repeat N` runs each row N times (on fresh lengths each time) and reports the median, with the minimum,
median and maximum share of the ceiling. `--variant NAME:KEY=VALUE,...` (repeatable) runs the rows once per variant
on the same model and ceiling, each with its own server: upper-case keys are server environment (an A/B in one run),
`rows=a+b` sets the rows for it.

    python -m benchmarks.reward_bench --out reward_bench.json                         # H200, Qwen3-1.7B shape
    python -m benchmarks.reward_bench --shape tiny --device cpu --samples 64 --out x.json   # smoke run on CPU
    python -m benchmarks.reward_bench --shape qwen3-8b --rows cold,fresh,callers-fresh --repeat 3 --out 8b.json
    python -m benchmarks.reward_bench --variant off:REWARD_PACK=off --variant on --rows fresh --repeat 3 --out ab.json
"""

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from benchmarks.common import SHAPES as ALL_SHAPES
from benchmarks.common import build_reward_model, command_line, machine_info, write_json
from benchmarks.reward_bench_workload import texts, workload
from launch.plan.procs import free_port, start_server, stop_process
from reward_score import safe_hack_reward_request as client

SHAPES = {k: ALL_SHAPES[k] for k in ("qwen3-1.7b", "qwen3-8b", "qwen3-14b", "tiny")}
REPO = Path(__file__).resolve().parent.parent
ROWS = {  # key -> (name, the seed of its lengths), in the order they run: cold first
    "cold": ("ours, reward client batch function, cold", 1234),
    "fresh": ("ours, reward client batch function, fresh lengths", 4321),
    "callers-fresh": ("ours, {c} concurrent per-sample callers, fresh lengths", 8765),
}


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
        "micro_batches": d["forwards"],
        "rows_per_micro_batch": d["rows"] / forwards,
        "padded_tokens": d["padded_tokens"],
        "launch_s_total": d["forward_launch_s"],
        "prepare_s_total": d["prepare_s"],
        "prepare_passes": d["prepare_passes"],
        "queue_wait_ms_mean": 1000 * d["queue_wait_s"] / max(d["requests"], 1),
        "gpu_busy_s_total": d["gpu_busy_s"],
        "packed_micro_batches": d["packed"],
    }


class Server:
    """Our reward server on loopback with a variant's environment, returned once its /health answers 200."""

    def __init__(self, model_dir: Path, device: str, env: dict, log: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        began = time.monotonic()
        server_env = dict(
            env, REWARD_MODEL_PATH=str(model_dir), REWARD_DEVICE=device, REWARD_PORT=str(port), REWARD_HOST="127.0.0.1"
        )
        self.proc = start_server(
            [sys.executable, str(REPO / "reward_score" / "reward_server.py")],
            log,
            self.url + "/health",
            900,
            server_env,
            name=f"the server ({log.name})",
        )
        self.startup_s = time.monotonic() - began
        self.health = requests.get(self.url + "/health", timeout=10).json()


# --- the rows ----------------------------------------------------------------------------------------------------


class Bench:
    """Our rows for one variant: its server, the reward client pointed at it, each row run `repeat` times."""

    def __init__(self, args, model_dir: Path, step, on_row) -> None:
        self.args, self.model_dir, self.step = args, model_dir, step
        self.on_row = on_row  # (rows so far, variant, server): after each row, for partial results

    def run_variant(self, variant: dict, base_env: dict, work: Path) -> tuple[list[dict], dict]:
        args = self.args
        server = Server(
            self.model_dir, args.device, dict(base_env, **variant["env"]), work / f"server_{variant['name']}.log"
        )
        print(
            f"variant {variant['name']}: server healthy after {server.startup_s:.1f} s; {json.dumps(server.health)}",
            flush=True,
        )
        os.environ.update(REWARD_SERVER_URLS=server.url, REWARD_PROMPT_OPENS_THINK="0", REWARD_LOG_PATH="")
        rows = []
        try:
            if "cold" not in variant["rows"] and not args.no_first_pass:
                self.client_batch(self.step(ROWS["cold"][1])[0])  # the server's first pass, not measured
            for row in variant["rows"]:
                rows.append(self.measure(row, server, variant))
                self.on_row(rows, variant, server)
            peak = metrics(server.url).get("reward_gpu_memory_peak_bytes", 0.0) / 2**30
        finally:
            stop_process(server.proc, 30)
        info = {
            "name": variant["name"],
            "env": variant["env"],
            "rows": variant["rows"],
            "startup_s": server.startup_s,
            "health": server.health,
            "peak_gib": peak,
        }
        for r in rows:
            r["peak_gib"] = peak
        return rows, info

    def measure(self, row: str, server: Server, variant: dict) -> dict:
        name, first_seed = ROWS[row]
        call = self.concurrent if row.startswith("callers") else self.client_batch
        runs = []
        for k in range(1 if row == "cold" else self.args.repeat):
            seed = first_seed + 1000 * k  # new lengths every repeat
            pairs, tokens = self.step(seed)
            before = counters(server.url)
            seconds = call(pairs)
            profile = profile_delta(before, counters(server.url))
            # The share of the wall the server's GPU ran a micro-batch (from its first kernel to its last): the rest
            # is the GPU idle, waiting on HTTP, tokenizing, planning or the callers (0 on the CPU: not timed).
            profile["gpu_busy_share"] = profile["gpu_busy_s_total"] / seconds
            runs.append(
                {
                    "wall_s": seconds,
                    "samples": len(pairs),
                    "tokens": tokens,
                    "seed": seed,
                    "samples_per_s": len(pairs) / seconds,
                    "tokens_per_s": tokens / seconds,
                    "server": profile,
                }
            )
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


# --- the ceiling and the result --------------------------------------------------------------------------------


def matmul_tflops(device: str, seconds: float = 4.0) -> dict | None:
    """The bf16 rate of back-to-back 8192^3 matmuls, measured now: `burst` over the first ten (cool clocks), and
    `sustained` as the median of 20-matmul windows over the second half of a `seconds`-long run, about as long as a
    step keeps the GPU busy (clocks drop under sustained load: measure, don't assume)."""
    if not device.startswith("cuda"):
        return None
    import torch

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    flop = 2 * 8192**3

    def window(n: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            a @ b
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000 / n

    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    burst = flop / window(10) / 1e12
    times: list[tuple[float, float]] = []
    began = time.monotonic()
    while time.monotonic() - began < seconds:
        times.append((time.monotonic() - began, window(20)))
    sustained = flop / statistics.median(t for at, t in times if at >= seconds / 2) / 1e12
    a = b = None
    torch.cuda.empty_cache()
    return {"burst": burst, "sustained": sustained}


def summarize(runs: list[dict], params: float, ceiling: float | None) -> dict:
    """A row from its runs: the run of median tokens/s stands for it (wall, tokens, server profile), with the
    minimum, median and maximum share of the ceiling over all runs."""
    for r in runs:
        r["tflops"] = 2 * params * r["tokens"] / r["wall_s"] / 1e12
        r["pct_of_ceiling"] = 100 * r["tflops"] / ceiling if ceiling else None
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in runs)
    row["tflops"] = statistics.median(r["tflops"] for r in runs)
    row["repeats"] = len(runs)
    pct = [r["pct_of_ceiling"] for r in runs]
    low, middle, high = (min(pct), statistics.median(pct), max(pct)) if ceiling else (None, None, None)
    row.update(pct_of_ceiling=middle, min_pct_of_ceiling=low, median_pct_of_ceiling=middle, max_pct_of_ceiling=high)
    row["runs"] = [{k: v for k, v in r.items() if k != "server"} for r in runs]
    return row


def parse_args(argv) -> tuple[argparse.Namespace, list[dict]]:
    """The options, and the variants to run (each with its rows), checked before anything starts."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, default=1024, help="pairs per step (default 1024 = 256 prompts x 4)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True, help="JSON results")
    parser.add_argument("--rows", help=f"comma-separated rows (default all): {', '.join(ROWS)}")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each row (cold: 1); the median")
    parser.add_argument("--variant", action="append", default=[], help="NAME[:KEY=VALUE,...]; see above")
    parser.add_argument(
        "--no-first-pass",
        action="store_true",
        help="without a cold row, the first measured row is the server's first step (no unmeasured "
        "pass before it; saves a step on big models)",
    )
    parser.add_argument("--model-dir", type=Path, help="where the random checkpoint goes (reused if it is there)")
    args = parser.parse_args(argv)
    args.command = command_line("benchmarks.reward_bench", argv)
    try:
        rows = check_rows(args.rows.split(",")) if args.rows else list(ROWS)
        variants = [parse_variant(v, rows) for v in (args.variant or ["default"])]
    except ValueError as exc:
        parser.error(str(exc))
    return args, variants


def step_maker(model_dir: Path, samples: int, words: int):
    """`step(seed)`: the step's (prompt, response) texts and its token count in the server's format, cached."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cache: dict[int, tuple] = {}

    def step(seed: int):
        if seed not in cache:
            pairs = texts(workload(seed, samples), seed, words)
            rendered = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}, {"role": "assistant", "content": r}], tokenize=False
                )
                for p, r in pairs
            ]
            tokens = sum(len(x) for x in tokenizer(rendered, add_special_tokens=False)["input_ids"])
            cache[seed] = (pairs, tokens)
        return cache[seed]

    return step


def main(argv=None) -> int:
    args, variants = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="reward_bench_"))
    t0 = time.monotonic()
    model_dir, params, words = build_reward_model(args.shape, args.model_dir or work / "model", args.device)
    print(f"model {args.shape}: {params / 1e9:.3f}e9 non-embedding parameters, ready in {time.monotonic() - t0:.1f} s")
    rate_start = matmul_tflops(args.device)
    step = step_maker(model_dir, args.samples, words)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    ours, infos, failed = [], [], []

    def partial(rows, variant, server) -> None:
        """What is measured so far, against the first ceiling measurement (a later kill loses nothing)."""
        info = {
            "name": variant["name"],
            "env": variant["env"],
            "startup_s": server.startup_s,
            "health": server.health,
            "in_progress": True,
        }
        write_json(args.out, assemble(args, params, rate_start, None, ours + rows, infos + [info], failed, done=False))

    bench = Bench(args, model_dir, step, partial)
    for variant in variants:
        try:
            rows, info = bench.run_variant(variant, env, work)
        except Exception as exc:  # the other variants still run, and the result says what failed
            print(f"variant {variant['name']} FAILED: {type(exc).__name__}: {exc}", flush=True)
            failed.append({"name": variant["name"], "error": f"{type(exc).__name__}: {exc}"[:2000]})
            continue
        ours.extend(rows)
        infos.append(info)
    result = assemble(args, params, rate_start, matmul_tflops(args.device), ours, infos, failed)
    write_json(args.out, result)
    print(f"wrote {args.out}: every row's share of the ceiling and the server's counters")
    return 1 if failed else 0


def assemble(args, params, rate_start, rate_end, ours, infos, failed, done=True) -> dict:
    """The result JSON: every row summarized against the ceiling (the sustained rate, the benchmark page's definition;
    of the measurements before and after our rows, the higher: the harder ceiling). `done` False: partial."""
    rates = [r for r in (rate_start, rate_end) if r]
    ceiling = max(r["sustained"] for r in rates) if rates else None
    burst = max(r["burst"] for r in rates) if rates else None
    rows = []
    for r in ours:
        r = dict(r)
        summary = summarize(copy.deepcopy(r.pop("runs")), params, ceiling)
        rows.append({**r, **{k: v for k, v in summary.items() if k not in r}})
    by_key = {(r["variant"], r["key"]): r for r in rows}
    for info in infos:
        cold = by_key.get((info["name"], "cold"))
        fresh = by_key.get((info["name"], "fresh"))
        if cold and fresh:  # the first step after start against the median of the later ones
            info["cold_over_fresh"] = cold["tokens_per_s"] / fresh["tokens_per_s"]
    first = infos[0] if infos else {}
    result = {
        "shape": args.shape,
        "device": args.device,
        "samples": args.samples,
        "params_non_embedding": params,
        "matmul_tflops_start": rate_start,
        "matmul_tflops_end": rate_end,
        "ceiling_tflops": ceiling,
        "burst_tflops": burst,
        "server_startup_s": first.get("startup_s"),
        "repeat": args.repeat,
        "command": args.command,
        "partial": not done,
        "variants": infos,
        "failed_variants": failed,
        "rows": rows,
    }
    result.update(machine_info(args.device))
    return result


if __name__ == "__main__":
    sys.exit(main())
