"""Reward scoring benchmark: one GRPO step (1024 pairs) through the article's design and through ours, over HTTP.

The workload, baseline and ceiling are those of docs/reward-benchmark.md:
- 1024 (prompt, response) pairs; prompt lengths uniform in [100, 600] tokens, response lengths lognormal (median 300,
  sigma 0.8) clipped to [10, 1800], each pair clipped to 2048 tokens; seed 1234, fresh lengths from other seeds;
- a Qwen3ForSequenceClassification of Qwen3-1.7B's shape (or `--shape qwen3-8b | qwen3-14b`, the public configs'
  dimensions) with random weights (bf16 on GPU), and a word-level tokenizer built here, so one word is one token and
  lengths are exact;
- the ceiling: the step's FLOP (2 x non-embedding parameters x tokens) at the bf16 matmul rate measured in this run.

Rows (`--rows`, comma-separated; the default follows `--mode`): the article's server with a sequential per-sample
client (`article`: cold and warm, `--article-samples` pairs); our server called by our reward client's batch function (`cold`: the first step after the
server starts, `warm`, `fresh`: fresh lengths), the same items posted straight to /score_batch (`direct`: the client's
overhead), 64 concurrent per-sample callers (`callers-warm`, `callers-fresh`). The verl-loop rows (`loop-plain`,
`loop-async`, `loop-arrivals-plain`, `loop-arrivals-async`; `--mode verl-loop`, or `all`) call our server as async
rollout does: verl 0.6.1's own NaiveRewardLoopManager.run_single, one DataProto item per sample, in `--verl-workers`
processes (rollout.agent.num_workers) whose event loops have `--verl-executor` default threads, for the plain
function and the async entry point; the step all at once, and arriving as rollouts finish (in proportion to response
length over `--arrival-window` s): the reward tail is the last arrival to the last score.

`--repeat N` runs each row N times (fresh rows on fresh lengths each time) and reports the median, with the minimum,
median and maximum share of the ceiling. `--replicas N` starts N servers (one per visible GPU, several on one GPU when
fewer are visible) and every row goes through the reward client's own spread over REWARD_SERVER_URLS; with N >= 2 the
`killed` row SIGKILLs one server mid-step (`--kill-at`) and times the step completing on the others. `--variant
NAME:KEY=VALUE,...` (repeatable) runs our rows once per variant on the same model and ceiling, each with its own
servers: upper-case keys are server environment (an A/B in one run), `replicas=N` and `rows=a+b` set those for it.

    python -m benchmarks.reward_bench --out reward_bench.json                         # H200, Qwen3-1.7B shape
    python -m benchmarks.reward_bench --shape tiny --device cpu --samples 64 --out x.json   # smoke run on CPU
    python -m benchmarks.reward_bench --mode verl-loop --out reward_loop.json            # only the verl-loop rows
    python -m benchmarks.reward_bench --shape qwen3-8b --rows cold,fresh,callers-fresh --repeat 3 --out 8b.json
    python -m benchmarks.reward_bench --replicas 2 --rows fresh,loop-async,killed --repeat 3 --out x2.json
    python -m benchmarks.reward_bench --variant off:REWARD_FUSE=off --variant on --rows fresh --repeat 3 --out ab.json
"""

import argparse
import copy
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from demo.tiny_models import REWARD_CHAT_TEMPLATE  # noqa: E402
from launch.plan.procs import free_port, start_process, stop_process, wait_for_http  # noqa: E402
from reward_score import safe_hack_reward_request as client  # noqa: E402

SHAPES = {
    "qwen3-1.7b": dict(
        hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936,
    ),
    # the public Qwen3-8B and Qwen3-14B configs' dimensions
    "qwen3-8b": dict(
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936,
    ),
    "qwen3-14b": dict(
        hidden_size=5120, intermediate_size=17408, num_hidden_layers=40, num_attention_heads=40,
        num_key_value_heads=8, head_dim=128, vocab_size=151936,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=4096,
    ),
}  # fmt: skip
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "system"]

CLASSIC_ROWS = ("article", "cold", "warm", "direct", "fresh", "callers-warm", "callers-fresh")
LOOP_ROWS = ("loop-plain", "loop-async", "loop-arrivals-plain", "loop-arrivals-async")
ALL_ROWS = (*CLASSIC_ROWS, *LOOP_ROWS, "killed")


def workload(seed: int, n: int) -> list[tuple[int, int]]:
    """(prompt tokens, response tokens) per pair."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(100, 601, size=n)
    responses = np.clip(np.round(rng.lognormal(np.log(300), 0.8, size=n)), 10, 1800).astype(int)
    responses = np.minimum(responses, 2048 - prompts)
    return list(zip(prompts.tolist(), responses.tolist(), strict=True))


def texts(pairs: list[tuple[int, int]], seed: int, words: int) -> list[tuple[str, str]]:
    rng = np.random.default_rng(seed + 1)
    return [
        (" ".join(f"w{i}" for i in rng.integers(0, words, p)), " ".join(f"w{i}" for i in rng.integers(0, words, r)))
        for p, r in pairs
    ]


def scorer_step(scorer, seed: int, n: int, words: int) -> list[list[int]]:
    """The step of `n` pairs as `scorer` (a RewardScorer) tokenizes them: one user turn each, the server's format."""
    pairs = texts(workload(seed, n), seed, words)
    return [e.ids for e in scorer.encode([scorer.render([{"role": "user", "content": p}], r) for p, r in pairs])]


def machine_info(device: str) -> dict:
    """What a result ran on: the GPU, how many are visible, torch and transformers (the GPU fields on a GPU only)."""
    import transformers

    info = {}
    if device.startswith("cuda"):
        import torch

        info.update(gpu=torch.cuda.get_device_name(), gpus_visible=torch.cuda.device_count(), torch=torch.__version__)
    info["transformers"] = transformers.__version__
    return info


def scorer_parser(doc: str) -> argparse.ArgumentParser:
    """The options forward_profile and fp8_trial share, to which each adds its own and --out: the model's shape, the
    device, and the step (its pairs and their seed)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=4321, help="workload seed (fresh lengths: not the warm-up's)")
    return parser


def save_result(out: dict, path: Path, device: str) -> None:
    """`out` and what it ran on (machine_info), written to `path` as JSON; says where."""
    out.update(machine_info(device))
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


def build_tokenizer(vocab_size: int):
    """The word-level tokenizer the benchmarks' models share: the specials, then w0, w1, ... up to `vocab_size`
    entries (one word, one token), with the reward chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = vocab_size - len(SPECIALS) - 2
    vocab = {t: i for i, t in enumerate(SPECIALS + ["[UNK]"] + [f"w{i}" for i in range(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=REWARD_CHAT_TEMPLATE,
    )  # fmt: skip


def build_model(shape: str, out: Path, device: str) -> tuple[Path, float, int]:
    """A randomly initialised reward model of `shape` and a word-level tokenizer in `out` (kept where `out` already
    holds one of that shape: a big checkpoint is written once); returns (dir, non-embedding params, words)."""
    import torch
    from transformers import AutoModelForSequenceClassification, Qwen3Config

    dims = SHAPES[shape]
    words = dims["vocab_size"] - len(SPECIALS) - 2
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        config = Qwen3Config.from_pretrained(out)
        if all(getattr(config, k) == v for k, v in dims.items()):
            with torch.device("meta"):
                model = AutoModelForSequenceClassification.from_config(config)
            params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
            return out, float(params), words
    tokenizer = build_tokenizer(dims["vocab_size"])
    config = Qwen3Config(
        **dims, max_position_embeddings=40960, rope_theta=1_000_000.0, tie_word_embeddings=True, num_labels=1,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForSequenceClassification.from_config(config, dtype=dtype)
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out, float(params), words


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


def server_counters(url: str) -> dict[str, float]:
    """The server's own counters (from /metrics) that explain a row: micro-batches, rows, padding, waits."""
    values = {}
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        name, _, value = line.partition(" ")
        if name in _PROFILE.values():
            values[name] = float(value)
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


def peak_gib(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    line = next((x for x in text.splitlines() if x.startswith("reward_gpu_memory_peak_bytes ")), "x 0")
    return float(line.split()[-1]) / 2**30


# --- through verl 0.6.1's own async reward loop ----------------------------------------------------------------

REWARD_FILE = REPO / "reward_score" / "safe_hack_reward_request.py"
LOOP_FUNCTIONS = {"safe_hack_reward": "plain function", "safe_hack_reward_async": "async entry point"}


def verl_default_executor_size() -> int:
    """The threads of an asyncio loop's default executor (Python's own default): where verl's naive reward loop runs a
    plain reward function, one sample per thread."""
    return min(32, (os.cpu_count() or 1) + 4)


def arrival_offsets(pairs: list[tuple[int, int]], window: float) -> list[float]:
    """When each sample reaches the reward loop: its rollout finishes at a time proportional to its response length,
    the longest at the end of the window (0: the whole step at once)."""
    longest = max(r for _, r in pairs)
    return [window * r / longest for _, r in pairs]


def _loop_worker(conn, model_dir: str, executor_size: int, env: dict) -> None:
    """One agent-loop worker's reward side, as verl runs it: a RewardManagerWorker process whose event loop has
    `executor_size` default threads and awaits verl's NaiveRewardLoopManager.run_single, one DataProto item per
    sample. Commands come over `conn`: ("run", function, [(prompt, response, offset)], server URLs) -> "ready", then a
    start epoch -> [(arrived, done, score, failed)]; ("stop",)."""
    os.environ.update(env)
    import asyncio

    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl import DataProto
    from verl.experimental.reward.reward_loop.naive import NaiveRewardLoopManager
    from verl.trainer.ppo.reward import get_custom_reward_fn

    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def item(prompt: str, response: str) -> DataProto:
        p = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        r = tokenizer(response, add_special_tokens=False, return_tensors="pt")["input_ids"]
        tensors = {"prompts": p, "responses": r, "input_ids": torch.cat([p, r], 1),
                   "attention_mask": torch.ones(1, p.shape[1] + r.shape[1], dtype=torch.long)}  # fmt: skip
        non_tensors = {"data_source": np.array(["bench"], dtype=object),
                       "reward_model": np.array([{"ground_truth": prompt, "style": "model"}], dtype=object),
                       "extra_info": np.array([{}], dtype=object)}  # fmt: skip
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)

    async def run_row(config, data: list, offsets: list[float], start: float) -> list:
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(executor_size))
        manager = NaiveRewardLoopManager(config, tokenizer, get_custom_reward_fn(config), None, None)

        async def one(d, offset):
            await asyncio.sleep(max(0.0, start + offset - time.time()))
            arrived = time.time()
            out = await manager.run_single(d)
            return arrived, time.time(), out["reward_score"], out["reward_extra_info"]["failed"]

        return await asyncio.gather(*(one(d, offset) for d, offset in zip(data, offsets, strict=True)))

    while True:
        command = conn.recv()
        if command[0] == "stop":
            return
        _, function, samples, urls = command
        os.environ["REWARD_SERVER_URLS"] = urls  # read by the reward client at each call
        config = OmegaConf.create({"custom_reward_function": {"path": str(REWARD_FILE), "name": function,
                                                              "reward_kwargs": {}},
                                   "reward_model": {"reward_manager": "naive"}})  # fmt: skip
        data = [item(p, r) for p, r, _ in samples]
        conn.send("ready")
        start = conn.recv()
        conn.send(asyncio.run(run_row(config, data, [s[2] for s in samples], start)))


class LoopWorkers:
    """`n` worker processes (spawned: each has its own reward client, as verl's workers do), kept for every row."""

    def __init__(self, n: int, model_dir: Path, executor_size: int, env: dict) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_loop_worker, args=(child, str(model_dir), executor_size, env), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, function: str, pairs: list[tuple[str, str]], offsets: list[float], urls: str) -> tuple[float, list]:
        """Samples split over the workers in contiguous chunks (verl's `prompts.chunk(num_workers)`), scored by the
        servers at `urls` (REWARD_SERVER_URLS); returns the common start epoch and every sample's (arrived, done,
        score, failed)."""
        chunks = np.array_split(np.arange(len(pairs)), len(self.conns))
        for conn, chunk in zip(self.conns, chunks, strict=True):
            conn.send(("run", function, [(*pairs[i], offsets[i]) for i in chunk], urls))
        for conn in self.conns:
            if not conn.poll(600):
                raise TimeoutError("a reward-loop worker did not get ready within 600 s")
            assert conn.recv() == "ready"
        start = time.time() + 0.2
        for conn in self.conns:
            conn.send(start)
        results = []
        for conn in self.conns:
            if not conn.poll(3600):
                raise TimeoutError("a reward-loop worker did not finish within an hour")
            results += conn.recv()
        return start, results

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs, strict=True):
            try:
                conn.send(("stop",))
            except OSError:
                pass
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def request_counts(url: str) -> dict[str, float]:
    """Answered requests per endpoint, from the server's /metrics."""
    counts = {"/score": 0.0, "/score_batch": 0.0}
    for line in requests.get(url + "/metrics", timeout=10).text.splitlines():
        for endpoint in counts:
            if line.startswith(f'reward_requests_total{{endpoint="{endpoint}",status="200"}}'):
                counts[endpoint] += float(line.split()[-1])
    return counts


def print_loop_rows(rows: list[dict]) -> None:
    print("\nthrough verl's reward loop (tail: last arrival to last score; latency: arrival to score):")
    for r in rows:
        loop = r["loop"]
        print(f"  {r['row']:<58} tail {loop['tail_s']:7.3f} s  latency p50 {loop['latency_p50_s']:6.3f} s "
              f"p99 {loop['latency_p99_s']:6.3f} s  forward busy {100 * loop['forward_busy_share']:5.1f}%  "
              f"/score {loop['requests']['/score']:.0f}, /score_batch {loop['requests']['/score_batch']:.0f}")  # fmt: skip


# --- our servers: one or several replicas -------------------------------------------------------------------------


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
        return [peak_gib(u) for u in self.live_urls]

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


# --- variants and repeats -------------------------------------------------------------------------------------------


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


def summarize(runs: list[dict], params: float, ceiling: float | None, burst: float | None) -> dict:
    """A row from its runs: the run of median tokens/s stands for it (wall, tokens, server profile), with the
    minimum, median and maximum share of the ceiling over all runs."""
    for r in runs:
        r["tflops"] = 2 * params * r["tokens"] / r["wall_s"] / 1e12
        r["pct_of_ceiling"] = 100 * r["tflops"] / ceiling if ceiling else None
        r["pct_of_burst_rate"] = 100 * r["tflops"] / burst if burst else None
    ordered = sorted(runs, key=lambda r: r["tokens_per_s"])
    row = dict(ordered[(len(ordered) - 1) // 2])
    row["tokens_per_s"] = statistics.median(r["tokens_per_s"] for r in runs)
    row["tflops"] = statistics.median(r["tflops"] for r in runs)
    row["repeats"] = len(runs)
    if ceiling:
        pct = [r["pct_of_ceiling"] for r in runs]
        row.update(pct_of_ceiling=statistics.median(pct), min_pct_of_ceiling=min(pct),
                   median_pct_of_ceiling=statistics.median(pct), max_pct_of_ceiling=max(pct),
                   pct_of_burst_rate=100 * row["tflops"] / burst)  # fmt: skip
    else:
        row.update(pct_of_ceiling=None, min_pct_of_ceiling=None, median_pct_of_ceiling=None, max_pct_of_ceiling=None,
                   pct_of_burst_rate=None)  # fmt: skip
    row["runs"] = [{k: v for k, v in r.items() if k != "server"} for r in runs]
    return row


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


def sdpa_backends(device: str) -> dict | None:
    """Which kernel torch's scaled_dot_product_attention picks here for the server's two attention calls: causal
    without a mask (padded rows) and with a boolean block mask (packed rows)."""
    if not device.startswith("cuda"):
        return None
    import torch

    try:
        from torch.nn.attention import SDPBackend

        q = torch.randn(8, 16, 1024, 128, device=device, dtype=torch.bfloat16)
        k = torch.randn(8, 8, 1024, 128, device=device, dtype=torch.bfloat16)
        mask = torch.ones(8, 1, 1024, 1024, device=device, dtype=torch.bool).tril()
        kv = k.repeat_interleave(2, dim=1)

        def choice(**kw):
            return SDPBackend(torch._fused_sdp_choice(q, kv, kv, **kw)).name

        return {"causal, no mask": choice(is_causal=True), "boolean mask": choice(attn_mask=mask)}
    except Exception as exc:  # noqa: BLE001 - a report, never a reason to fail the benchmark
        return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, default=1024, help="pairs per step (default 1024 = 256 prompts x 4)")
    parser.add_argument("--article-samples", type=int, default=1024, help="pairs for the article's baseline (0: skip)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--out", type=Path, required=True, help="JSON results")
    parser.add_argument("--server-env", action="append", default=[], help="extra KEY=VALUE for our server")
    parser.add_argument(
        "--mode",
        choices=["all", "classic", "verl-loop"],
        default="all",
        help="the default rows: classic (batch function, direct POST, per-sample callers), verl-loop, all: both",
    )
    parser.add_argument("--rows", help=f"comma-separated rows instead of --mode's: {', '.join(ALL_ROWS)}")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each row (cold and killed: 1); the median")
    parser.add_argument("--replicas", type=int, default=1, help="our servers, one per visible GPU (round robin)")
    parser.add_argument("--kill-at", choices=["forward", "start"], default="forward", help="the killed row's crash")
    parser.add_argument("--variant", action="append", default=[], help="NAME[:KEY=VALUE,...]; see above")
    parser.add_argument("--no-first-pass", action="store_true",
                        help="without a cold row, the first measured row is the servers' first step (no unmeasured "
                        "pass before it; saves a step on big models)")  # fmt: skip
    parser.add_argument("--model-dir", type=Path, help="where the random checkpoint goes (reused if it is there)")
    parser.add_argument("--pid-file", type=Path, help="append the pid of every server started (for cleanup)")
    parser.add_argument("--verl-workers", type=int, default=8, help="agent-loop workers (rollout.agent.num_workers)")
    parser.add_argument(
        "--verl-executor",
        type=int,
        default=verl_default_executor_size(),
        help="default-executor threads per worker (Python's default: min(32, CPUs + 4))",
    )
    parser.add_argument("--arrival-window", type=float, default=60.0, help="rollout window of the spread workload, s")
    args = parser.parse_args(argv)
    args.command = "python -m benchmarks.reward_bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    global PID_FILE
    PID_FILE = args.pid_file

    default_rows = {"classic": list(CLASSIC_ROWS), "verl-loop": list(LOOP_ROWS),
                    "all": [*CLASSIC_ROWS, *LOOP_ROWS]}[args.mode]  # fmt: skip
    if args.replicas >= 2 and not args.rows:
        default_rows.append("killed")
    try:
        rows_wanted = check_rows(args.rows.split(",")) if args.rows else default_rows
        variants = [parse_variant(v, args.replicas, rows_wanted) for v in (args.variant or ["default"])]
    except ValueError as exc:
        parser.error(str(exc))

    work = Path(tempfile.mkdtemp(prefix="reward_bench_"))
    t0 = time.monotonic()
    model_dir, params, words = build_model(args.shape, args.model_dir or work / "model", args.device)
    print(f"model {args.shape}: {params / 1e9:.3f}e9 non-embedding parameters, ready in {time.monotonic() - t0:.1f} s")
    rate_start = matmul_tflops(args.device)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cache: dict[int, tuple] = {}

    def step(seed: int, n: int = args.samples):
        if (seed, n) not in cache:
            pairs = texts(workload(seed, n), seed, words)
            rendered = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}, {"role": "assistant", "content": r}], tokenize=False
                )
                for p, r in pairs
            ]
            tokens = sum(len(x) for x in tokenizer(rendered, add_special_tokens=False)["input_ids"])
            cache[(seed, n)] = (pairs, tokens)
        return cache[(seed, n)]

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    article_runs: list[tuple[str, list[dict]]] = []

    # --- the article's design ---
    if args.article_samples and "article" in rows_wanted:
        port = free_port()
        proc = start([sys.executable, str(REPO / "benchmarks" / "article_server.py"), str(model_dir), str(port)],
                     work / "article.log", port, env)  # fmt: skip
        session = requests.Session()
        pairs, tokens = step(1234, args.article_samples)
        try:
            for label in ("cold", "warm"):
                t = time.monotonic()
                for p, r in pairs:
                    session.post(
                        f"http://127.0.0.1:{port}/score", json={"prompt": p, "response": r}, timeout=600
                    ).raise_for_status()
                seconds = time.monotonic() - t
                article_runs.append((f"article server, sequential per-sample client, {label}",
                                     [{"wall_s": seconds, "samples": len(pairs), "tokens": tokens,
                                       "samples_per_s": len(pairs) / seconds, "tokens_per_s": tokens / seconds}]))  # fmt: skip
                print(f"  {article_runs[-1][0]:<70} {seconds:.2f} s", flush=True)
        finally:
            stop_process(proc, 30)

    # --- ours, once per variant ---
    base_env = dict(env)
    base_env.update(kv.split("=", 1) for kv in args.server_env)
    holder: list = []

    def workers():
        if not holder:
            holder.append(LoopWorkers(args.verl_workers, model_dir, args.verl_executor, dict(os.environ)))
        return holder[0]

    bench = Bench(args, model_dir, step, workers)
    ours, infos, failed = [], [], []
    sdpa = sdpa_backends(args.device)

    def partial(rows, variant, servers) -> None:
        """What is measured so far, against the first ceiling measurement (a later kill loses nothing)."""
        info = {"name": variant["name"], "env": variant["env"], "replicas": variant["replicas"],
                "startup_s": servers.startup_s[-1], "health": servers.health, "in_progress": True}  # fmt: skip
        write_result(args, assemble(args, params, rate_start, None, article_runs, ours + rows, infos + [info], failed,
                                    sdpa, done=False))  # fmt: skip

    bench.on_row = partial
    try:
        for variant in variants:
            try:
                rows, info = bench.run_variant(variant, base_env, work)
            except Exception as exc:  # the other variants still run, and the result says what failed
                print(f"variant {variant['name']} FAILED: {type(exc).__name__}: {exc}", flush=True)
                failed.append({"name": variant["name"], "error": f"{type(exc).__name__}: {exc}"[:2000]})
                continue
            ours.extend(rows)
            infos.append(info)
    finally:
        if holder:
            holder[0].close()
    rate_end = matmul_tflops(args.device)
    result = assemble(args, params, rate_start, rate_end, article_runs, ours, infos, failed, sdpa)
    write_result(args, result)
    print_summary(result)
    print(f"wrote {args.out}")
    if failed:
        return 1
    return 0


def assemble(args, params, rate_start, rate_end, article_runs, ours, infos, failed, sdpa, done=True) -> dict:
    """The result JSON: every row summarized against the ceiling (the sustained rate, the benchmark page's definition;
    of the measurements before and after our rows, the higher: the harder ceiling). `done` False: partial."""
    rates = [r for r in (rate_start, rate_end) if r]
    ceiling = max(r["sustained"] for r in rates) if rates else None
    burst = max(r["burst"] for r in rates) if rates else None
    rows = [{"row": name, "variant": None, "replicas": None, **summarize(runs, params, ceiling, burst),
             "peak_gib": None, "server": None} for name, runs in article_runs]  # fmt: skip
    for r in ours:
        r = dict(r)
        summary = summarize(copy.deepcopy(r.pop("runs")), params, ceiling, burst)
        rows.append({**r, **{k: v for k, v in summary.items() if k not in r}})
    by_key = {(r.get("variant"), r.get("key")): r for r in rows}
    overheads = {}
    for info in infos:
        warm, direct = by_key.get((info["name"], "warm")), by_key.get((info["name"], "direct"))
        if warm and direct:
            overheads[info["name"]] = 100 * (warm["wall_s"] / direct["wall_s"] - 1)
        cold, fresh = by_key.get((info["name"], "cold")), by_key.get((info["name"], "fresh"))
        for key, other in (("cold_over_warm", warm), ("cold_over_fresh", fresh)):
            if cold and other:  # the first step after start against the median of the later ones
                info[key] = cold["tokens_per_s"] / other["tokens_per_s"]
    first = infos[0] if infos else {}
    result = {
        "shape": args.shape, "device": args.device, "samples": args.samples, "params_non_embedding": params,
        "matmul_tflops_start": rate_start, "matmul_tflops_end": rate_end, "ceiling_tflops": ceiling,
        "burst_tflops": burst, "server_startup_s": first.get("startup_s"), "replicas": first.get("replicas"),
        "repeat": args.repeat, "client_overhead_pct": overheads.get(first.get("name")),
        "client_overhead_by_variant": overheads, "server_env": args.server_env, "mode": args.mode,
        "command": args.command, "partial": not done, "variants": infos, "failed_variants": failed,
        "verl_workers": args.verl_workers, "verl_executor": args.verl_executor, "arrival_window_s": args.arrival_window,
        "sdpa_backend": sdpa, "rows": rows,
    }  # fmt: skip
    result.update(machine_info(args.device))
    return result


def write_result(args, result: dict) -> None:
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, args.out)


def print_summary(result: dict) -> None:
    rows = result["rows"]
    ceiling, burst = result["ceiling_tflops"], result["burst_tflops"]
    rate_start, rate_end = result["matmul_tflops_start"], result["matmul_tflops_end"]
    if ceiling:
        print(f"\nceiling: {ceiling:.0f} TFLOP/s sustained bf16 matmul (first burst {burst:.0f}); "
              f"start {rate_start}, end {rate_end}")  # fmt: skip
    else:
        print("\n(no GPU: no ceiling)")
    for info in result["variants"]:
        health = info.get("health") or {}
        print(f"variant {info['name']}: {info['replicas']} server(s), healthy after {info['startup_s']:.1f} s, "
              f"peak {info['peak_gib']} GiB, env {info['env']}, compiled {health.get('compiled')}, liger "
              f"{health.get('liger')}, first-layer checks {health.get('checks')}"
              + "".join(f", {k.replace('_over_', '/')} {info[k]:.2f}" for k in ("cold_over_warm", "cold_over_fresh")
                        if k in info))  # fmt: skip
    print(f"{'row':<70} {'variant':>10} {'wall s':>8} {'tokens/s':>10} {'TFLOP/s':>8} {'% ceil':>7} "
          f"{'min-max':>11} {'% burst':>7} {'peak GiB':>8}")  # fmt: skip
    for r in rows:
        pct = f"{r['pct_of_ceiling']:.1f}" if r["pct_of_ceiling"] is not None else "-"
        spread = (f"{r['min_pct_of_ceiling']:.1f}-{r['max_pct_of_ceiling']:.1f}"
                  if r["min_pct_of_ceiling"] is not None else "-")  # fmt: skip
        pct_burst = f"{r['pct_of_burst_rate']:.1f}" if r["pct_of_burst_rate"] is not None else "-"
        peak_s = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        print(f"{r['row']:<70} {str(r['variant'] or '-'):>10} {r['wall_s']:>8.2f} {r['tokens_per_s']:>10.0f} "
              f"{r['tflops']:>8.1f} {pct:>7} {spread:>11} {pct_burst:>7} {peak_s:>8}")  # fmt: skip
    print("\nserver side, per row: (the median run of each)")
    for r in rows:
        if r["server"]:
            p = r["server"]
            print(f"  {r['row']:<68} {p['micro_batches']:5.0f} micro-batches ({p.get('packed_micro_batches', 0):.0f} packed) x "
                  f"{p['rows_per_micro_batch']:5.1f} rows, "
                  f"prepare {p['prepare_s_total']:6.2f} s in {p['prepare_passes']:4.0f} passes, launch {p['launch_s_total']:6.2f} s, "
                  f"queue wait {p['queue_wait_ms_mean']:6.1f} ms, GPU busy {100 * p.get('gpu_busy_share', 0):5.1f}% "
                  "of the wall")  # fmt: skip
    loop_rows = [r for r in rows if "loop" in r]
    if loop_rows:
        print_loop_rows(loop_rows)
    for r in rows:
        if "killed" in r:
            k = r["killed"]
            print(f"killed row ({r['variant']}): replica {k['replica']} SIGKILLed at {k['at_s']:.2f} s ({k['how']}), "
                  f"step done in {r['wall_s']:.2f} s on the others (retry budget {k['retry_budget_s']:.0f} s)")  # fmt: skip
    for f in result["failed_variants"]:
        print(f"variant {f['name']} FAILED: {f['error'][:500]}")
    for name, overhead in result["client_overhead_by_variant"].items():
        print(f"reward client batch function vs one direct POST (warm, {name}): {overhead:+.1f}% wall time")


if __name__ == "__main__":
    sys.exit(main())
