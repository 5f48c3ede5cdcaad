"""The reward benchmark's verl-loop rows: our reward function called through verl 0.6.1's own async reward loop
(NaiveRewardLoopManager.run_single) in worker processes shaped as verl's agent-loop workers, and their printed
summary."""

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
REWARD_FILE = REPO / "reward_score" / "safe_hack_reward_request.py"
LOOP_FUNCTIONS = {"safe_hack_reward": "plain function", "safe_hack_reward_async": "async entry point"}


def verl_default_executor_size() -> int:
    """The threads of an asyncio loop's default executor (Python's own default): where verl's naive reward loop runs a
    plain reward function, one sample per thread."""
    return min(32, (os.cpu_count() or 1) + 4)


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


def print_loop_rows(rows: list[dict]) -> None:
    print("\nthrough verl's reward loop (tail: last arrival to last score; latency: arrival to score):")
    for r in rows:
        loop = r["loop"]
        print(f"  {r['row']:<58} tail {loop['tail_s']:7.3f} s  latency p50 {loop['latency_p50_s']:6.3f} s "
              f"p99 {loop['latency_p99_s']:6.3f} s  forward busy {100 * loop['forward_busy_share']:5.1f}%  "
              f"/score {loop['requests']['/score']:.0f}, /score_batch {loop['requests']['/score_batch']:.0f}")  # fmt: skip
