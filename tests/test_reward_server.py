"""The reward server scores exactly as the model was trained, batches without changing scores, survives bad input.

In-process tests use FastAPI's TestClient with the lifespan running (model load, warm-up, the GPU thread); the
process tests start the real `python reward_score/reward_server.py` on a loopback port.
"""

import ast
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from reward_score.server.app import MAX_CHARS, MAX_ITEMS, create_app
from reward_score.server.batcher import Batcher, Preparer, _Job
from reward_score.server.inputs import ConversationRefused
from reward_score.server.planner import (
    MICRO_BATCH_COST,
    MemoryTooSmall,
    Planner,
    activation_bytes_per_token,
    model_micro_batch_cost,
    model_packs,
    model_token_budget,
)
from reward_score.server.runner import NotARewardModel, RewardScorer
from reward_score.server.settings import Settings, load_settings
from reward_score.server.warmup import warm_up
from tests.support import REPO, free_port, http_get, start_http_server, start_process

LONG_ANSWER = " ".join(f"word{i % 17} step {i}" for i in range(120))


@pytest.fixture(scope="module")
def reference(tiny_models):
    """The model and tokenizer loaded the plain way, to compute what a score should be."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models.reward_model)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_models.reward_model).eval()

    def score(messages, response, keep_last=None):
        text = tok.apply_chat_template([*messages, {"role": "assistant", "content": response}], tokenize=False)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if keep_last:
            ids = ids[-keep_last:]
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids])).logits[0, 0].item()

    return score


def make_client(tiny_models, **overrides) -> TestClient:
    cfg = replace(Settings(model_path=str(tiny_models.reward_model), device="cpu"), **overrides)
    return TestClient(create_app(cfg, RewardScorer.load(cfg)))


@pytest.fixture(scope="module")
def client(tiny_models):
    with make_client(tiny_models) as c:
        yield c


def metric(client: TestClient, name: str) -> float:
    text = client.get("/metrics").text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith(name) and not line.startswith("#")
    )


def score_one(client: TestClient, item: dict, **kwargs):
    """One item through /score_batch (the endpoint the reward function calls): the response."""
    return client.post("/score_batch", json={"items": [item]}, **kwargs)


def score_of(client: TestClient, item: dict) -> float:
    r = score_one(client, item)
    assert r.status_code == 200, r.text
    return r.json()["scores"][0]


# --- scoring as trained ----------------------------------------------------------------------------------------


def test_score_equals_a_direct_forward_on_the_chat_templated_text(client, reference):
    body = score_one(client, {"prompt": "Is it safe to mix bleach and ammonia?", "response": "No."}).json()
    expected = reference([{"role": "user", "content": "Is it safe to mix bleach and ammonia?"}], "No.")
    assert body["scores"] == [pytest.approx(expected, abs=1e-5)]
    assert body["truncated"] == [False]


def test_messages_replace_the_prompt_and_keep_the_system_turn(client, reference):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "こんにちは"}]
    score = score_of(client, {"messages": messages, "response": "世界"})
    assert score == pytest.approx(reference(messages, "世界"), abs=1e-5)
    as_prompt = score_of(client, {"prompt": "こんにちは", "response": "世界"})
    assert as_prompt != pytest.approx(score, abs=1e-4), "the system turn must reach the model"


def test_batched_scores_equal_one_at_a_time_scores(client):
    items = [{"prompt": f"question {i} " * (1 + i % 7), "response": LONG_ANSWER[: 10 + 37 * i]} for i in range(40)]
    batch = client.post("/score_batch", json={"items": items}).json()
    singles = [score_of(client, item) for item in items]
    assert batch["scores"] == pytest.approx(singles, abs=1e-5)
    assert len(set(round(s, 4) for s in singles)) > 30, "the tiny model must tell these apart for this to mean anything"


def test_a_big_request_tokenized_in_slices_keeps_its_order(tiny_models, reference):
    items = [{"prompt": f"p{i}", "response": f"answer number {i} " * (1 + i % 5)} for i in range(300)]
    with make_client(tiny_models) as c:
        scores = c.post("/score_batch", json={"items": items}).json()["scores"]
    for i in (0, 127, 128, 257, 299):  # order holds across many micro-batches
        assert scores[i] == pytest.approx(
            reference([{"role": "user", "content": f"p{i}"}], items[i]["response"]), abs=1e-5
        )


def test_concurrent_callers_share_forwards_and_get_their_own_scores(tiny_models):
    items = [{"prompt": f"q{i}", "response": LONG_ANSWER[: 20 + 13 * i]} for i in range(24)]
    with make_client(tiny_models) as c:
        singles = [score_of(c, item) for item in items]
        forwards_before = metric(c, "reward_batch_rows_count")
        results: dict[int, float] = {}

        def call(i):
            results[i] = score_of(c, items[i])

        threads = [threading.Thread(target=call, args=(i,)) for i in range(len(items))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        forwards = metric(c, "reward_batch_rows_count") - forwards_before
    assert [results[i] for i in range(len(items))] == pytest.approx(singles, abs=1e-5)
    assert forwards < len(items), f"{len(items)} concurrent requests took {forwards:.0f} forwards: no batching"


def test_reward_server_refuses_a_checkpoint_without_a_scoring_head(tiny_models, tmp_path):
    """A causal LM (here the policy) would load as a sequence classifier with a randomly initialized `score.weight`:
    refused by its config.json's architectures; one whose config claims a classifier but whose weights lack the head
    is refused after the load, naming what was missing."""
    with pytest.raises(NotARewardModel) as refused:
        RewardScorer.load(Settings(model_path=str(tiny_models.policy), device="cpu", compile="off"))
    message = str(refused.value)
    assert str(tiny_models.policy) in message and "architectures=['Qwen3ForCausalLM']" in message
    assert "*ForSequenceClassification checkpoint with a one-output score head" in message
    assert "RewardTrainer" in message
    shutil.copytree(tiny_models.policy, tmp_path / "claims")
    config = json.loads((tmp_path / "claims" / "config.json").read_text())
    config |= {"architectures": ["Qwen3ForSequenceClassification"], "num_labels": 1}
    (tmp_path / "claims" / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotARewardModel, match=re.escape("without the scoring head ['score.weight']")):
        RewardScorer.load(Settings(model_path=str(tmp_path / "claims"), device="cpu", compile="off"))


@pytest.mark.parametrize("labels", [{"id2label": {"0": "safe", "1": "unsafe"}}, {}, {"num_labels": 3}])
def test_reward_server_refuses_a_classifier_head_from_its_config_before_loading_anything(tmp_path, labels):
    """num_labels other than 1 (config.json omits id2label for transformers' default of two) is refused from the
    config alone, in one line naming the field, its value and the fix: the folder holds no weights, no tokenizer."""
    config = {"model_type": "qwen3", "architectures": ["Qwen3ForSequenceClassification"]} | labels
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotARewardModel) as refused:
        RewardScorer.load(Settings(model_path=str(tmp_path), device="cpu", compile="off"))
    message = str(refused.value)
    assert "\n" not in message and f"the reward model {tmp_path} (CONFIG_REWARD_MODEL_PATH" in message
    assert f"num_labels={len(config.get('id2label', {})) or config.get('num_labels', 2)} " in message
    assert "save it with num_labels=1 and a one-row score head" in message


def _with_budget(scorer: RewardScorer, tokens: int) -> RewardScorer:
    """The scorer with a token budget of `tokens` (the server's is the model's: 8192 on the CPU)."""
    scorer.planner = replace(scorer.planner, token_budget=tokens)
    return scorer


def test_micro_batches_respect_the_token_budget_and_pad_to_a_bounded_set_of_lengths(tiny_models):
    scorer = _with_budget(RewardScorer.load(Settings(model_path=str(tiny_models.reward_model), device="cpu")), 512)
    lengths = [5, 700, 64, 65, 300, 129, 1, 1000, 64, 200]
    plan = scorer.planner.plan(lengths)
    assert sorted(i for rows in plan for i in rows) == list(range(len(lengths)))
    seen = []
    scorer.on_forward = lambda rows, width, tokens, seconds: seen.append((rows, width, tokens))
    seqs = [[7] * n for n in lengths]
    scores = scorer.score_ids(seqs)
    assert len(scores) == len(lengths) and len(seen) == len(plan)
    for rows, width, _ in seen:  # rows as run: packed rows count once however many sequences they hold
        assert width % 16 == 0
        assert rows == 1 or rows * width <= 512
    assert sum(t for _, _, t in seen) == sum(lengths)


def test_mixed_lengths_are_packed_several_to_a_row_and_score_as_alone(tiny_models):
    scorer = _with_budget(RewardScorer.load(Settings(model_path=str(tiny_models.reward_model), device="cpu")), 4096)
    rng = torch.Generator().manual_seed(3)
    lengths = [250, 31, 90, 7, 160, 64, 12, 200, 45, 128]
    seqs = [torch.randint(10, 200, (n,), generator=rng).tolist() for n in lengths]
    alone = [scorer.score_ids([s])[0] for s in seqs]
    seen = []
    scorer.on_forward = lambda rows, width, tokens, seconds: seen.append((rows, width, tokens))
    together = scorer.score_ids(seqs)
    assert together == pytest.approx(alone, abs=1e-5)
    ((rows, width, tokens),) = seen
    assert width == 256 and rows <= 0.8 * len(lengths), f"{len(lengths)} sequences in {rows} rows: not packed"
    assert rows * width < len(lengths) * width and tokens == sum(lengths)


def test_rows_of_similar_length_are_padded_not_packed(tiny_models):
    scorer = _with_budget(RewardScorer.load(Settings(model_path=str(tiny_models.reward_model), device="cpu")), 4096)
    seen = []
    scorer.on_forward = lambda rows, width, tokens, seconds: seen.append((rows, width))
    scorer.score_ids([[7] * n for n in (250, 240, 231, 200, 199)])
    assert seen == [(5, 256)]


class _GatedScorer:
    """Stands in for the GPU: each launched micro-batch finishes only when the test opens its gate.
    A row's score is the sum of its ids; a row [666] makes the launch raise, [777] the wait for its result."""

    planner = Planner(token_budget=100, pad_multiple=1)

    def __init__(self):
        self.launched: list[tuple[list[list[int]], threading.Event]] = []

    def launch(self, seqs):
        if [666] in seqs:
            raise RuntimeError("device-side assert (simulated)")
        gate = threading.Event()
        self.launched.append((seqs, gate))
        return _GatedHandle(seqs, gate)


class _GatedHandle:
    def __init__(self, seqs, gate):
        self.seqs, self.gate = seqs, gate

    def ready(self) -> bool:
        if [777] in self.seqs:
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
        return self.gate.is_set()

    def result(self) -> list[float]:
        assert self.gate.wait(10), "result() before the micro-batch finished"
        return [float(sum(s)) for s in self.seqs]


async def _until(condition, timeout: float = 5.0) -> None:
    for _ in range(int(timeout / 0.005)):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


def _with_batcher(depth: int, body) -> None:
    async def main():
        scorer = _GatedScorer()
        batcher = Batcher(scorer, max_wait_s=0.05, quiet_s=0.02, depth=depth)
        batcher.start()
        try:
            await body(scorer, batcher)
        finally:
            for _, gate in scorer.launched:
                gate.set()
            batcher.stop()

    asyncio.run(main())


def test_a_request_is_answered_when_its_own_micro_batch_finishes():
    async def body(scorer, batcher):
        first = asyncio.ensure_future(batcher.score([[1] * 90]))
        second = asyncio.ensure_future(batcher.score([[2] * 80]))
        await _until(lambda: len(scorer.launched) == 2)  # too long to share a micro-batch: both queued on the GPU
        assert [len(s[0]) for s, _ in scorer.launched] == [90, 80]
        scorer.launched[0][1].set()
        assert await asyncio.wait_for(first, 5) == [90.0]
        assert not second.done()
        scorer.launched[1][1].set()
        assert await asyncio.wait_for(second, 5) == [160.0]

    _with_batcher(2, body)


def test_rows_spread_over_micro_batches_come_back_in_order():
    async def body(scorer, batcher):
        seqs = [[1] * 30, [1] * 90, [1] * 10, [1] * 60, [1] * 45]
        task = asyncio.ensure_future(batcher.score(seqs))
        while not task.done():
            await _until(lambda: any(not g.is_set() for _, g in scorer.launched) or task.done())
            for _, gate in scorer.launched:
                gate.set()
        assert await task == [30.0, 90.0, 10.0, 60.0, 45.0]
        assert len(scorer.launched) >= 3
        assert all(sum(len(s) for s in seqs) <= 100 or len(seqs) == 1 for seqs, _ in scorer.launched)

    _with_batcher(2, body)


def test_the_oldest_waiting_request_goes_first_even_when_longer_ones_arrive_later():
    async def body(scorer, batcher):
        blocker = asyncio.ensure_future(batcher.score([[1] * 90]))
        await _until(lambda: len(scorer.launched) == 1)
        short = asyncio.ensure_future(batcher.score([[3] * 10]))
        await asyncio.sleep(0.05)
        longer = [asyncio.ensure_future(batcher.score([[4] * 95])) for _ in range(2)]
        await asyncio.sleep(0.05)
        scorer.launched[0][1].set()
        await _until(lambda: len(scorer.launched) == 2)
        assert scorer.launched[1][0] == [[3] * 10], "a length-sorted plan alone would run the longer rows first"
        for k in (1, 2, 3):
            await _until(lambda k=k: len(scorer.launched) > k)
            scorer.launched[k][1].set()
        assert await asyncio.wait_for(short, 5) == [30.0]
        assert [await f for f in (blocker, *longer)] == [[90.0], [380.0], [380.0]]

    _with_batcher(1, body)


def test_while_one_micro_batch_runs_the_next_goes_in_once_its_rows_waited_max_wait():
    async def body(scorer, batcher):
        running = asyncio.ensure_future(batcher.score([[1] * 90]))
        await _until(lambda: len(scorer.launched) == 1)
        started = asyncio.get_running_loop().time()
        small = [asyncio.ensure_future(batcher.score([[2] * 5])) for _ in range(3)]  # far below the token budget
        await _until(lambda: len(scorer.launched) == 2)
        waited = asyncio.get_running_loop().time() - started
        assert waited >= 0.04, f"launched after {waited:.3f} s: it should wait max_wait (0.05 s) for more to join"
        assert scorer.launched[1][0] == [[2] * 5] * 3, "the requests that landed together share one micro-batch"
        assert not running.done(), "queued behind the running micro-batch, not after it"
        for _, gate in scorer.launched:
            gate.set()
        assert await asyncio.wait_for(running, 5) == [90.0]
        assert [await asyncio.wait_for(f, 5) for f in small] == [[10.0]] * 3

    _with_batcher(2, body)


class _TimedHandle(_GatedHandle):
    """A micro-batch whose GPU time is known once it is done: `seconds_per_token` of its `tokens`."""

    seconds_per_token = 0.1

    def __init__(self, seqs, gate):
        super().__init__(seqs, gate)
        self.tokens = sum(len(s) for s in seqs)

    def gpu_seconds(self):
        return self.seconds_per_token * self.tokens if self.gate.is_set() else None


class _TimedScorer(_GatedScorer):
    def launch(self, seqs):
        gate = threading.Event()
        self.launched.append((seqs, gate))
        return _TimedHandle(seqs, gate)


def test_the_gpu_time_of_each_finished_micro_batch_reaches_the_metrics_hook():
    async def main():
        scorer, seen = _TimedScorer(), []
        batcher = Batcher(scorer, max_wait_s=0.01, quiet_s=0.005, depth=2, on_gpu=seen.append)
        batcher.start()
        try:
            task = asyncio.ensure_future(batcher.score([[1] * 10]))
            await _until(lambda: len(scorer.launched) == 1)
            assert seen == [], "counted before the GPU finished it"
            scorer.launched[0][1].set()
            await asyncio.wait_for(task, 5)
            await _until(lambda: seen)
            assert seen == [pytest.approx(1.0)]  # 0.1 s a token, 10 tokens
        finally:
            for _, gate in scorer.launched:
                gate.set()
            batcher.stop()

    asyncio.run(main())


def test_after_wait_queues_the_next_micro_batch_once_its_rows_waited_max_wait_whatever_the_gpu_has_left():
    async def main():
        scorer = _TimedScorer()
        batcher = Batcher(scorer, max_wait_s=0.05, quiet_s=0.02, depth=2)
        batcher.start()
        try:
            first = asyncio.ensure_future(batcher.score([[1] * 10]))
            await _until(lambda: len(scorer.launched) == 1)
            scorer.launched[0][1].set()
            await asyncio.wait_for(first, 5)
            running = asyncio.ensure_future(batcher.score([[1] * 90]))
            await _until(lambda: len(scorer.launched) == 2)
            small = asyncio.ensure_future(batcher.score([[2] * 3]))
            await _until(lambda: len(scorer.launched) == 3)
            assert not running.done()
            for _, gate in scorer.launched:
                gate.set()
            assert await asyncio.wait_for(small, 5) == [6.0]
        finally:
            for _, gate in scorer.launched:
                gate.set()
            batcher.stop()

    asyncio.run(main())


def test_requests_that_queued_while_the_thread_was_busy_go_in_one_micro_batch():
    async def body(scorer, batcher):
        running = asyncio.ensure_future(batcher.score([[1] * 90]))
        await _until(lambda: len(scorer.launched) == 1)
        loop = asyncio.get_running_loop()
        # Three requests that have waited past max_wait already (as while a launch held the thread), queued at once.
        jobs = [_Job([[k] * 5], loop.create_future(), loop, time.perf_counter() - 1) for k in (2, 3, 4)]
        with batcher._queue.mutex:
            batcher._queue.queue.extend(jobs)
            batcher._queue.not_empty.notify()
        await _until(lambda: len(scorer.launched) == 2)
        await asyncio.sleep(0.05)
        assert len(scorer.launched) == 2 and len(scorer.launched[1][0]) == 3, "one micro-batch, not one per request"
        for _, gate in scorer.launched:
            gate.set()
        assert [await asyncio.wait_for(j.future, 5) for j in jobs] == [[10.0], [15.0], [20.0]]
        assert await running == [90.0]

    _with_batcher(2, body)


def test_a_failing_micro_batch_fails_only_its_own_requests():
    async def body(scorer, batcher):
        bad = asyncio.ensure_future(batcher.score([[666]]))
        good = asyncio.ensure_future(batcher.score([[5] * 99]))
        await _until(lambda: len(scorer.launched) == 1)
        scorer.launched[0][1].set()
        assert await asyncio.wait_for(good, 5) == [495.0]
        with pytest.raises(RuntimeError, match="simulated"):
            await asyncio.wait_for(bad, 5)
        after = asyncio.ensure_future(batcher.score([[1] * 3]))
        await _until(lambda: len(scorer.launched) == 2)
        scorer.launched[1][1].set()
        assert await asyncio.wait_for(after, 5) == [3.0]

    _with_batcher(2, body)


def test_an_error_while_waiting_on_the_gpu_fails_the_requests_held_and_the_thread_serves_on():
    async def body(scorer, batcher):
        broken = asyncio.ensure_future(batcher.score([[777]]))
        with pytest.raises(RuntimeError, match="illegal memory access"):
            await asyncio.wait_for(broken, 5)
        after = asyncio.ensure_future(batcher.score([[2] * 4]))
        await _until(lambda: len(scorer.launched) == 2)
        scorer.launched[1][1].set()
        assert await asyncio.wait_for(after, 5) == [8.0]

    _with_batcher(2, body)


# --- the planner and the package's layers ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lengths, pack, expected",
    [
        # mixed lengths, packing allowed: 10 sequences (987 tokens) in 4 rows of 256 (first-fit, longest first)
        ([250, 31, 90, 7, 160, 64, 12, 200, 45, 128], True, (256, 4)),
        # the same lengths where the model cannot pack: one padded row each
        ([250, 31, 90, 7, 160, 64, 12, 200, 45, 128], False, (256, None)),
        # similar lengths: packing would save no row, so they are padded
        ([250, 240, 231, 200, 199], True, (256, None)),
        # one sequence is never packed, and its width is the next multiple of 64
        ([65], True, (128, None)),
    ],
)
def test_the_planner_alone_decides_how_a_micro_batch_is_laid_out(lengths, pack, expected):
    layout = Planner(token_budget=4096, pad_multiple=64, pack=pack).layout(lengths)
    width, rows = expected
    assert layout.width == width
    if rows is None:
        assert layout.bins is None
    else:
        assert len(layout.bins) == rows and sorted(k for b in layout.bins for k in b) == list(range(len(lengths)))
        assert all(sum(lengths[k] for k in b) <= width for b in layout.bins)


def test_the_planner_keeps_every_micro_batch_within_the_token_budget_as_it_runs():
    planner = Planner(token_budget=512, pad_multiple=64, pack=True)
    lengths = [5, 700, 64, 65, 300, 129, 1, 1000, 64, 200, 33, 17, 90]
    plan = planner.plan(lengths)
    assert sorted(i for rows in plan for i in rows) == list(range(len(lengths)))
    for rows in plan:
        layout = planner.layout([lengths[i] for i in rows])
        row_count = len(rows) if layout.bins is None else len(layout.bins)
        assert row_count == 1 or row_count * layout.width <= 512, (rows, layout)


def test_the_planner_cuts_where_fewest_padded_tokens_are_computed():
    # Filling up to the budget puts a 100-token row beside the 500-token one (padded to 512); cutting after the long
    # row computes 512 + 8 x 112 tokens instead of 2 x 512 + 7 x 112.
    lengths = [500] + [100] * 8
    plan = Planner(token_budget=1024, pad_multiple=16).plan(lengths)
    assert plan == [[0], [1, 2, 3, 4, 5, 6, 7, 8]]


def test_on_the_benchmark_step_the_planner_computes_under_4_percent_padding():
    """The benchmark's step (docs/reward-benchmark.md, seed 1234) under the server's defaults: filling each
    micro-batch to the budget with rows padded to 64 computed 8% more tokens than the step holds."""
    from benchmarks.reward_bench_workload import workload

    lengths = [p + r + 12 for p, r in workload(1234, 1024)]  # + the chat template's tokens
    planner = Planner.for_settings(Settings(), "cuda", pack=True)
    plan = planner.plan(lengths)
    assert sorted(i for rows in plan for i in rows) == list(range(len(lengths)))
    computed = 0
    for rows in plan:
        layout = planner.layout([lengths[i] for i in rows])
        row_count = len(rows) if layout.bins is None else len(layout.bins)
        assert row_count * layout.width <= planner.token_budget
        computed += row_count * layout.width
    assert computed < 1.04 * sum(lengths), computed / sum(lengths)


def test_a_bigger_models_planner_splits_rows_into_narrower_micro_batches_with_less_padding():
    """What 64 per-sample callers leave waiting: a few dozen rows of mixed lengths. The cost of one more forward is
    time, and a Qwen3-8B token takes ~5x a 1.7B's: at its cost the plan computes fewer padded tokens."""
    from benchmarks.reward_bench_workload import workload

    assert model_micro_batch_cost(1.41e9) == MICRO_BATCH_COST  # Qwen3-1.7B: as measured
    assert model_micro_batch_cost(0.44e9) == MICRO_BATCH_COST  # smaller: never more
    assert 150 < model_micro_batch_cost(6.95e9) < 300  # Qwen3-8B
    assert model_micro_batch_cost(13.2e9) < model_micro_batch_cost(6.95e9)
    assert model_micro_batch_cost(1e15) == 64  # a floor

    lengths = [p + r for p, r in workload(8765, 40)]

    def padded(cost: int) -> tuple[int, int]:
        planner = Planner(token_budget=32768, pad_multiple=16, micro_batch_cost=cost)
        plan = planner.plan(lengths)
        assert sorted(i for rows in plan for i in rows) == list(range(len(lengths)))
        return sum(len(rows) * planner.layout([lengths[i] for i in rows]).width for rows in plan), len(plan)

    (small_model, forwards_small), (big_model, forwards_big) = padded(1024), padded(model_micro_batch_cost(6.95e9))
    assert forwards_big > forwards_small
    assert small_model > 1.10 * sum(lengths) and big_model < 1.06 * sum(lengths)  # 12% padding, then 5%


def test_only_models_up_to_the_measured_size_pack_and_pack_off_scores_the_same_unpacked(tiny_models):
    assert model_packs(1.41e9) and not model_packs(6.95e9)  # Qwen3-1.7B packs, Qwen3-8B does not (H200, 64 callers)
    packing = RewardScorer.load(Settings(model_path=str(tiny_models.reward_model), device="cpu", compile="off"))
    plain = RewardScorer.load(
        Settings(model_path=str(tiny_models.reward_model), device="cpu", compile="off", pack="off")
    )
    assert packing.planner.pack and not plain.planner.pack
    packed, padded = [], []
    packing.on_packed, plain.on_packed = lambda: packed.append(1), lambda: padded.append(1)
    seqs = [[5] * 200] + [[7 + k] * 40 for k in range(6)]  # six short ones fit beside each other in 208-token rows
    assert plain.score_ids(seqs) == pytest.approx(packing.score_ids(seqs), abs=1e-4)
    assert packed and not padded


def test_the_micro_batch_cost_setting_wins_and_the_cpu_keeps_the_measured_one(tiny_models):
    assert (
        Planner.for_settings(Settings(micro_batch_cost=300), "cuda", pack=True, model_cost=200).micro_batch_cost == 300
    )
    assert Planner.for_settings(Settings(), "cuda", pack=True, model_cost=200).micro_batch_cost == 200
    scorer = RewardScorer.load(Settings(model_path=str(tiny_models.reward_model), device="cpu"))
    assert scorer.planner.micro_batch_cost == MICRO_BATCH_COST
    scorer = RewardScorer.load(Settings(model_path=str(tiny_models.reward_model), device="cpu", micro_batch_cost=96))
    assert scorer.planner.micro_batch_cost == 96


def test_the_planner_and_the_settings_load_without_torch():
    code = (
        "import sys\n"
        "from reward_score.server.planner import Planner\n"
        "from reward_score.server.settings import load_settings\n"
        "Planner(token_budget=64).plan([3, 70, 5])\n"
        "assert 'torch' not in sys.modules and 'fastapi' not in sys.modules, sorted(sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_each_part_of_the_server_imports_only_the_parts_before_it():
    chain = ["settings", "planner", "inputs", "runner", "warmup", "batcher", "app"]
    for k, name in enumerate(chain):
        tree = ast.parse((REPO / "reward_score" / "server" / f"{name}.py").read_text())
        imported = {
            node.module.split(".")[2]
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("reward_score.server.")
        }
        assert imported <= set(chain[:k]), f"{name}.py imports {sorted(imported - set(chain[:k]))}, later in the chain"


# --- tokenizing off the event loop ------------------------------------------------------------------------------

# Qwen3's template refuses a conversation without a user turn with this very message.
REFUSING_TEMPLATE = (
    "{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('No user query found in messages.') }}"
    "{% endif %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
)


@pytest.fixture(scope="module")
def cpu_scorer(tiny_models):
    return RewardScorer.load(Settings(model_path=str(tiny_models.reward_model), device="cpu"))


def _conversation(i: int):
    return [{"role": "user", "content": f"question {i}"}], f"answer {i} " * (1 + i % 4)


def test_requests_waiting_together_are_tokenized_in_one_pass(cpu_scorer):
    passes = []
    preparer = Preparer(cpu_scorer, asyncio.to_thread, on_pass=lambda requests, items, s: passes.append(items))

    async def main():
        return await asyncio.gather(*(preparer.ids([_conversation(i)]) for i in range(10)))

    got = asyncio.run(main())
    assert passes == [10], "ten requests waiting together must share one tokenizer call"
    expected = cpu_scorer.tokenize([cpu_scorer.render(*_conversation(i)) for i in range(10)])
    assert got == [[ids] for ids in expected]


def test_requests_arriving_during_a_pass_go_together_in_the_next(cpu_scorer):
    passes = []
    gate = threading.Event()

    async def gated_thread(fn, *args):
        return await asyncio.to_thread(lambda: gate.wait(5) and fn(*args))

    preparer = Preparer(cpu_scorer, gated_thread, on_pass=lambda requests, items, s: passes.append((requests, items)))

    async def main():
        first = asyncio.ensure_future(preparer.ids([_conversation(0), _conversation(1)]))
        await asyncio.sleep(0.05)  # the first pass is running (held at the gate)
        later = [asyncio.ensure_future(preparer.ids([_conversation(i)])) for i in (2, 3, 4)]
        await asyncio.sleep(0.05)
        gate.set()
        return await first, await asyncio.gather(*later)

    first, later = asyncio.run(main())
    assert passes == [(1, 2), (3, 3)]
    assert len(first) == 2 and [len(x) for x in later] == [1, 1, 1]
    assert later[2][0] == cpu_scorer.tokenize([cpu_scorer.render(*_conversation(4))])[0]


def test_a_conversation_the_template_refuses_fails_only_its_own_request(tiny_models):
    cfg = Settings(model_path=str(tiny_models.reward_model), device="cpu")
    scorer = RewardScorer.load(cfg)
    scorer.tokenizer.chat_template = REFUSING_TEMPLATE
    preparer = Preparer(scorer, asyncio.to_thread)
    bad = ([{"role": "tool", "content": "42"}], "ok")

    async def main():
        return await asyncio.gather(
            preparer.ids([_conversation(1)]),
            preparer.ids([_conversation(2), bad]),
            preparer.ids([_conversation(3)]),
            return_exceptions=True,
        )

    good1, refused, good3 = asyncio.run(main())
    assert isinstance(refused, ConversationRefused) and "No user query found" in str(refused)
    assert good1 == scorer.tokenize([scorer.render(*_conversation(1))])
    assert good3 == scorer.tokenize([scorer.render(*_conversation(3))])

    with TestClient(create_app(cfg, scorer)) as c:
        r = score_one(c, {"messages": bad[0], "response": "ok"})
        assert r.status_code == 422, r.text
        assert r.json()["detail"].startswith("items[].messages: the reward model's chat template refused")
        assert score_one(c, {"prompt": "hi", "response": "ok"}).status_code == 200
        assert metric(c, 'reward_errors_total{kind="template_refused"}') == 1


# --- truncation ------------------------------------------------------------------------------------------------


def test_truncation_keeps_the_scored_token_at_the_end(tiny_models, reference):
    with make_client(tiny_models, max_length=48) as c:
        body = score_one(c, {"prompt": "Summarise.", "response": LONG_ANSWER}).json()
        assert body["truncated"] == [True]
        assert metric(c, "reward_truncations_total") == 1
    messages = [{"role": "user", "content": "Summarise."}]
    assert body["scores"][0] == pytest.approx(reference(messages, LONG_ANSWER, keep_last=48), abs=1e-5)


# --- bad input ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"items": [{"prompt": "hi"}]}, 422, "items.0.response"),  # missing response
        ({"items": [{"prompt": "", "response": "ok"}]}, 422, "'prompt' is empty"),  # empty prompt
        ({"items": [{"prompt": "hi", "response": "  "}]}, 422, "'response' is empty"),  # blank response
        ({"items": [{"prompt": 5, "response": "ok"}]}, 422, "items.0.prompt"),  # wrong type, not coerced
        (
            {"items": [{"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "response": "ok"}]},
            422,
            "exactly one",
        ),
        ({"items": [{"messages": [{"role": "user"}], "response": "ok"}]}, 422, "messages.0.content"),  # bad message
        ({"items": [{"messages": [], "response": "ok"}]}, 422, "'messages' is empty"),
        ({"items": []}, 422, "items"),  # nothing to score
        ({"items": [{"prompt": "hi", "response": 3}]}, 422, "items.0.response"),
        ({"items": "nope"}, 422, "items"),
        ({"items": [{"prompt": "a", "response": "b"}] * (MAX_ITEMS + 1)}, 422, "at most 4096 items"),
        ({"items": [{"prompt": "x" * (MAX_CHARS + 1), "response": "ok"}]}, 422, "prompt: String should have at most"),
        ({"items": [{"prompt": "a", "response": "y" * (MAX_CHARS + 1)}]}, 422, "items.0.response"),
    ],
)
def test_bad_input_gets_a_4xx_naming_the_field_and_the_server_keeps_serving(limited, body, status, needle):
    r = limited.post("/score_batch", json=body)
    assert r.status_code == status, r.text
    assert needle in json.dumps(r.json()["detail"])
    assert "Traceback" not in r.text
    assert score_one(limited, {"prompt": "hi", "response": "ok"}).status_code == 200


@pytest.fixture(scope="module")
def limited(tiny_models):
    with make_client(tiny_models) as c:
        yield c


def test_invalid_json_is_rejected_naming_it(limited):
    r = limited.post("/score_batch", content=b'{"items": [', headers={"content-type": "application/json"})
    assert r.status_code == 422 and "not valid JSON" in r.text


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
items = st.fixed_dictionaries(
    {},
    optional={
        "prompt": json_values | st.text(max_size=50),
        "messages": st.lists(
            st.fixed_dictionaries({}, optional={"role": json_values, "content": json_values}), max_size=3
        ),
        "response": json_values | st.text(max_size=50),
    },
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=items | st.fixed_dictionaries({"items": st.lists(items, max_size=4)}) | json_values)
def test_fuzzed_bodies_never_get_a_5xx(limited, body):
    r = limited.post("/score_batch", json=body)
    assert r.status_code < 500, r.text
    assert r.headers["content-type"].startswith("application/json")


def test_auth_token_is_required_when_configured(tiny_models):
    with make_client(tiny_models, auth_token="s3cret") as c:
        item = {"prompt": "hi", "response": "ok"}
        assert score_one(c, item).status_code == 401
        assert score_one(c, item, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert score_one(c, item, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/health").status_code == 200, "readiness probes need no token"
        assert "s3cret" not in c.get("/health").text


def test_cuda_out_of_memory_splits_the_micro_batch_and_the_server_keeps_serving(tiny_models, monkeypatch):
    cfg = Settings(model_path=str(tiny_models.reward_model), device="cpu")
    scorer = RewardScorer.load(cfg)
    real_forward = scorer.base.forward

    def forward_that_fits_two_rows(*args, input_ids=None, **kwargs):
        if input_ids.shape[0] > 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_forward(*args, input_ids=input_ids, **kwargs)

    items = [{"prompt": f"q{i}", "response": LONG_ANSWER[: 100 + i]} for i in range(9)]  # one micro-batch
    with TestClient(create_app(cfg, scorer)) as c:
        expected = c.post("/score_batch", json={"items": items}).json()["scores"]
        monkeypatch.setattr(scorer.base, "forward", forward_that_fits_two_rows)
        r = c.post("/score_batch", json={"items": items})
        assert r.status_code == 200
        assert r.json()["scores"] == pytest.approx(expected, abs=1e-5)
        assert metric(c, 'reward_errors_total{kind="cuda_oom_split"}') >= 3
        assert score_one(c, items[0]).status_code == 200


def test_a_nan_score_is_an_internal_error_never_a_score(tiny_models, monkeypatch):
    cfg = Settings(model_path=str(tiny_models.reward_model), device="cpu")
    scorer = RewardScorer.load(cfg)
    with TestClient(create_app(cfg, scorer), raise_server_exceptions=False) as c:
        monkeypatch.setattr(scorer.head, "forward", lambda hidden: torch.full((hidden.shape[0], 1), float("nan")))
        for count in (1, 3):
            r = c.post("/score_batch", json={"items": [{"prompt": "hi", "response": "ok"}] * count})
            assert r.status_code == 500 and "internal error" in r.json()["detail"], (count, r.text)
        assert metric(c, 'reward_errors_total{kind="internal"}') == 2


def test_a_compile_that_fails_at_warm_up_falls_back_to_eager_and_scores_the_same(tiny_models, caplog):
    cfg = Settings(model_path=str(tiny_models.reward_model), device="cpu", compile="off")
    eager = RewardScorer.load(cfg)
    seqs = [[5, 6, 7, 8] * 10, [9, 10] * 7]
    expected = eager.score_ids(seqs)

    def broken(*args, **kwargs):
        raise RuntimeError("inductor: no C++ compiler (simulated)")

    for layer in eager.base.layers:  # what a failed torch.compile looks like at the first call
        layer._compiled_call_impl = broken
    eager.kernels.compiled = True
    warm_up(eager)
    assert eager.compiled is False and "no C++ compiler (simulated)" in caplog.text
    assert eager.score_ids(seqs) == pytest.approx(expected, abs=1e-6)


def _compiled_as(layer, change):
    """What torch.compile leaves on a layer (`_compiled_call_impl`, run with the layer's hooks), computing its forward's
    output through `change`."""

    def call(*args, **kwargs):
        forward = type(layer).forward
        layer.forward = lambda *a, **k: change(forward(layer, *a, **k))
        try:
            return layer._call_impl(*args, **kwargs)
        finally:
            del layer.forward

    return call


@pytest.mark.parametrize("computes", ["the same", "otherwise"])
def test_compiled_layers_serve_only_where_they_compute_as_the_layers_do_at_warm_up(tiny_models, caplog, computes):
    scorer = RewardScorer.load(Settings(model_path=str(tiny_models.reward_model), device="cpu"))
    seqs = [[5, 6, 7, 8] * 10, [9, 10] * 7]
    expected = scorer.score_ids(seqs)
    scale = 1.0 if computes == "the same" else 1.1  # Inductor's fused kernels, right or wrong

    def change(out):
        return tuple(o * scale if k == 0 else o for k, o in enumerate(out)) if isinstance(out, tuple) else out * scale

    for layer in scorer.base.layers:
        layer._compiled_call_impl = _compiled_as(layer, change)
    scorer.kernels.compiled = True
    warm_up(scorer)
    if computes == "the same":
        assert scorer.compiled is True and scorer.checks["compile"] == 0.0
        assert all(layer._compiled_call_impl is not None for layer in scorer.base.layers)
    else:
        assert scorer.compiled is False and scorer.checks["compile"] > 0.05
        assert "REWARD_COMPILE: the compiled layers do not compute as the layers do" in caplog.text
    assert scorer.score_ids(seqs) == pytest.approx(expected, abs=1e-5)


# Per-token activations (bf16) of the benchmark's shapes and Qwen3-32B, from their public configs.
QWEN3 = {  # hidden, intermediate, q width, kv width, weights (bf16 GiB, embeddings included)
    "1.7B": (2048, 6144, 2048, 1024, 3.2),
    "8B": (4096, 12288, 4096, 1024, 14.1),
    "14B": (5120, 17408, 5120, 1024, 27.5),
    "32B": (5120, 25600, 8192, 1024, 61.0),
}


@pytest.mark.parametrize(
    "model, cap_gib, budget",
    [
        ("1.7B", 0, 32768),  # no cap: the measured default, activations far under 8 GiB
        ("8B", 0, 32768),
        ("14B", 0, 32768),
        ("32B", 0, 31744),  # 210 KiB a token: 32768 tokens would pass 8 GiB with the margin
        ("14B", 32, 23552),  # a GPU shared with training: 32 GiB for the server leave 4.5 beside the weights
        ("1.7B", 5, 24576),
    ],
)
def test_the_token_budget_follows_the_model_and_the_memory_it_may_use(model, cap_gib, budget):
    hidden, intermediate, q, kv, weights_gib = QWEN3[model]
    per_token = activation_bytes_per_token(hidden, intermediate, q, kv)
    assert model_token_budget(per_token, int(weights_gib * 2**30), int(cap_gib * 2**30)) == budget
    assert Planner.for_settings(Settings(), "cuda", pack=True, model_budget=budget).token_budget == budget
    assert Planner.for_settings(Settings(), "cpu", pack=True, model_budget=budget).token_budget == 8192


def test_a_memory_cap_that_leaves_no_room_beside_the_weights_is_refused_naming_the_setting():
    hidden, intermediate, q, kv, weights_gib = QWEN3["14B"]
    with pytest.raises(MemoryTooSmall, match=r"REWARD_GPU_MEMORY_GIB=27.6: the weights take 27.5 GiB.*at least 27.7"):
        model_token_budget(
            activation_bytes_per_token(hidden, intermediate, q, kv), int(27.5 * 2**30), int(27.6 * 2**30)
        )


def test_plain_text_fallback_when_the_tokenizer_has_no_chat_template(tiny_models, reference):
    cfg = Settings(model_path=str(tiny_models.reward_model), device="cpu")
    loaded = RewardScorer.load(cfg)
    loaded.tokenizer.chat_template = None
    scorer = RewardScorer(loaded.model, loaded.tokenizer, "cpu", cfg)
    with TestClient(create_app(cfg, scorer)) as c:
        assert c.get("/health").json()["format"] == "plain_text"
        got = score_of(c, {"prompt": "Question?", "response": " Answer."})
    tok = scorer.tokenizer
    ids = tok("Question? Answer.<|im_end|>", add_special_tokens=False)["input_ids"]
    with torch.inference_mode():
        expected = scorer.model(input_ids=torch.tensor([ids])).logits[0, 0].item()
    assert got == pytest.approx(expected, abs=1e-5)


# --- input formats (which of TRL's ways of building a training sequence) -------------------------------------------


@pytest.mark.parametrize(
    "settings, has_template, expected",
    [
        # the defaults with a chat template: TRL >= 0.24's apply_chat_template(tokenize=True), no special tokens
        ({}, True, ("conversation", True, False, False)),
        # the defaults without one: TRL's plain-text rule, tokenizer(prompt + completion + eos)
        ({}, False, ("conversation", False, True, True)),
        # completion: TRL <= 0.23's tokenizer(completion), special tokens added
        ({"input": "completion"}, True, ("completion", True, True, False)),
        # completion in plain text: the response as it is, no EOS (TRL <= 0.23 appended none)
        ({"input": "completion"}, False, ("completion", False, True, False)),
        # a plain-text dataset on a tokenizer that has a template: TRL never used the template for it
        ({"chat_template": "off"}, True, ("conversation", False, True, True)),
        # TRL <= 0.23 on conversations: tokenizer(templated text), a second BOS where the template writes one
        ({"add_special_tokens": "true"}, True, ("conversation", True, True, False)),
        # TRL <= 0.23 on a plain-text dataset without a prompt column: the text as it is
        ({"chat_template": "off", "append_eos": "false"}, True, ("conversation", False, True, False)),
        # explicit values win over auto; append_eos never applies through a chat template
        ({"add_special_tokens": "false", "append_eos": "true"}, True, ("conversation", True, False, False)),
    ],
)
def test_auto_input_settings_resolve_to_what_trl_did_for_that_input(settings, has_template, expected):
    from reward_score.server.inputs import InputFormat

    fmt = InputFormat.from_settings(replace(Settings(), **settings), has_template)
    assert (fmt.input, fmt.chat_template, fmt.add_special_tokens, fmt.append_eos) == expected


def test_completion_input_scores_the_response_as_the_assistant_turn_alone(tiny_models):
    """TRL <= 0.23 with a prompt column: what the conversation adds after the prompt's generation prompt."""
    with make_client(tiny_models, input="completion") as c:
        health = c.get("/health").json()
        assert (health["input"], health["add_special_tokens"]) == ("completion", True)
        got = score_of(c, {"prompt": "Question?", "response": "The answer."})
        system_last = score_one(c, {"messages": [{"role": "system", "content": "Be brief."}], "response": "ok"})
    scorer = RewardScorer.load(Settings(model_path=str(tiny_models.reward_model), device="cpu", input="completion"))
    text = scorer.render([{"role": "user", "content": "Question?"}], "The answer.")
    assert text == "The answer.<|im_end|>\n"
    ids = scorer.tokenizer(text)["input_ids"]  # TRL <= 0.23's _tokenize
    with torch.inference_mode():
        expected = scorer.model(input_ids=torch.tensor([ids])).logits[0, 0].item()
    assert got == pytest.approx(expected, abs=1e-5)
    assert system_last.status_code == 422 and "REWARD_INPUT=completion" in system_last.json()["detail"]


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory):
    """A tokenizer that adds a BOS itself, with Llama 3's template (which writes one too); no pad token."""
    from tests.trl_cases import build_base_model

    template = (
        "{% for m in messages %}{% set c = '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + m['content'] "
        "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set c = bos_token + c %}{% endif %}{{ c }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    )
    root = tmp_path_factory.mktemp("bos")
    return SimpleNamespace(
        chat=build_base_model(root / "chat", "llama3", template), plain=build_base_model(root / "plain", "llama3", None)
    )


def test_special_tokens_put_a_second_bos_before_the_templates_own_only_when_asked(bos_model):
    messages, response = [{"role": "user", "content": "hi"}], "hello"
    default = RewardScorer.load(Settings(model_path=str(bos_model.chat), device="cpu"))
    bos = default.tokenizer.bos_token_id
    text = default.render(messages, response)
    assert text.startswith("<|begin_of_text|><|start_header_id|>user")
    (plain,) = default.tokenize([text])
    assert plain[0] == bos and plain[1] != bos, "the default (TRL >= 0.24): the template's BOS alone"
    added = RewardScorer.load(Settings(model_path=str(bos_model.chat), device="cpu", add_special_tokens="true"))
    (doubled,) = added.tokenize([text])
    assert doubled == [bos, *plain], "TRL <= 0.23's tokenizer(text): one more BOS"


def test_trailing_pad_tokens_are_not_scored_as_the_models_own_forward_reads_past_them(bos_model):
    """No pad token: the model pads (and reads past) its EOS, so a plain text's appended EOS is not the scored one."""
    cfg = Settings(model_path=str(bos_model.plain), device="cpu")
    scorer = RewardScorer.load(cfg)
    eos = scorer.tokenizer.eos_token_id
    assert scorer.model.config.pad_token_id == eos
    (ids,) = scorer.tokenize([scorer.render([{"role": "user", "content": "Question:"}], " answer")])
    assert ids[0] == scorer.tokenizer.bos_token_id and ids[-1] == eos, "plain text: BOS added, EOS appended"
    with TestClient(create_app(cfg, scorer)) as c:
        got = score_of(c, {"prompt": "Question:", "response": " answer"})
    with torch.inference_mode():
        own = scorer.model(input_ids=torch.tensor([ids])).logits[0, 0].item()  # transformers' own reading
        before_eos = scorer.model(input_ids=torch.tensor([ids[:-1]])).logits[0, 0].item()
        at_eos = scorer.model.score(scorer.base(input_ids=torch.tensor([ids])).last_hidden_state)[0, -1, 0].item()
    assert got == pytest.approx(own, abs=1e-5) and own == pytest.approx(before_eos, abs=1e-5)
    assert abs(at_eos - own) > 1e-3, "the test would not tell the two readings apart"


# --- settings ----------------------------------------------------------------------------------------------------


def test_flags_win_over_the_environment_and_the_servers_own_names_are_read():
    env = {"REWARD_MODEL_PATH": "/m", "REWARD_DEVICE": "cuda:1", "REWARD_PORT": "8100", "REWARD_HOST": "127.0.0.1"}
    s = load_settings(["--port", "9001"], env)
    assert (s.model_path, s.device, s.port, s.host) == ("/m", "cuda:1", 9001, "127.0.0.1")


def test_the_launch_scripts_settings_are_not_read_as_the_servers_own():
    """The run script exports CONFIG_REWARD_SERVER_PORT as the FIRST of several ports; each server gets --port."""
    env = {"CONFIG_REWARD_MODEL_PATH": "/m", "CONFIG_REWARD_DEVICE": "cuda:1", "CONFIG_REWARD_SERVER_PORT": "8100"}
    s = load_settings([], env)
    assert (s.model_path, s.device, s.port) == ("", "auto", 8000)


def test_a_launch_name_set_to_something_else_than_the_server_runs_with_is_reported_and_the_jobs_servers_say_nothing():
    from reward_score.server.settings import launch_names_not_read

    by_hand = {"CONFIG_REWARD_DEVICE": "cpu", "CONFIG_REWARD_INPUT": "completion", "REWARD_MODEL_PATH": "/m"}
    device, fmt = launch_names_not_read(load_settings([], by_hand), by_hand)
    assert device.startswith("CONFIG_REWARD_DEVICE=cpu is not read by this server (it reads REWARD_DEVICE or --device")
    assert "the launch scripts pass CONFIG_REWARD_DEVICE as --device): running with device=auto" in device
    assert fmt.startswith("CONFIG_REWARD_INPUT=completion is not read") and "input=conversation" in fmt
    # What helper_grpo_qwen3_4b.sh does: every CONFIG_REWARD_* of the job's environment also given as its flag.
    job = {"CONFIG_REWARD_MODEL_PATH": "/m", "CONFIG_REWARD_DEVICE": "cpu", "CONFIG_REWARD_INPUT": "conversation"}
    flags = ["--model-path", "/m", "--device", "cpu", "--input", "conversation"]
    assert launch_names_not_read(load_settings(flags, job), job) == []


@pytest.mark.parametrize(
    "env, needle",
    [
        ({"REWARD_PORT": "eighty"}, "REWARD_PORT"),
        ({"REWARD_DEVICE": "gpu"}, "REWARD_DEVICE"),
        ({"REWARD_MAX_LENGTH": "0"}, "REWARD_MAX_LENGTH"),
        ({"REWARD_INPUT": "prompt"}, "REWARD_INPUT must be conversation or completion"),
        ({"REWARD_ADD_SPECIAL_TOKENS": "yes"}, "REWARD_ADD_SPECIAL_TOKENS must be auto or true or false"),
        ({"REWARD_CHAT_TEMPLATE": "on"}, "REWARD_CHAT_TEMPLATE must be auto or off"),
        ({"REWARD_APPEND_EOS": "1"}, "REWARD_APPEND_EOS"),
        ({"REWARD_GPU_MEMORY_GIB": "-4"}, "REWARD_GPU_MEMORY_GIB"),
        ({"REWARD_MICRO_BATCH_COST": "-1"}, "REWARD_MICRO_BATCH_COST must be 0 (from the model)"),
        ({"REWARD_PACK": "on"}, "REWARD_PACK must be auto or off"),
    ],
)
def test_bad_settings_exit_naming_the_variable(env, needle, capsys):
    with pytest.raises(SystemExit) as exc:
        load_settings([], env)
    assert exc.value.code == 2 and needle in capsys.readouterr().err


def test_help_lists_the_input_format_settings_with_their_flags(capsys):
    with pytest.raises(SystemExit):
        load_settings(["--help"], {})
    out = " ".join(capsys.readouterr().out.split())
    for flag, env in (
        ("--input", "REWARD_INPUT"),
        ("--add-special-tokens", "REWARD_ADD_SPECIAL_TOKENS"),
        ("--chat-template", "REWARD_CHAT_TEMPLATE"),
        ("--append-eos", "REWARD_APPEND_EOS"),
    ):
        assert flag in out and (f"[{env}, default auto" in out or f"[{env}, default conversation" in out)
    assert load_settings(["--input", "completion"], {"REWARD_INPUT": "conversation"}).input == "completion"


def test_help_is_short_and_leads_with_the_model_device_port_and_format_and_help_all_lists_every_setting():
    from reward_score.server.settings import SETTINGS

    def run(*args):
        env = dict(os.environ, COLUMNS="80")
        cmd = [sys.executable, str(REPO / "reward_score" / "reward_server.py"), *args]
        return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)

    short = run("--help")
    assert short.returncode == 0, short.stderr
    lines = short.stdout.splitlines()
    assert len(lines) <= 50, f"--help is {len(lines)} lines"
    assert lines[0].startswith("usage: reward_server --model-path DIR [--device DEVICE] [--port PORT] [--input")
    flags = [line.split()[0] for line in lines if line.startswith("  --")]
    assert flags[:8] == [
        "--help-all",
        "--model-path",
        "--device",
        "--port",
        "--host",
        "--input",
        "--add-special-tokens",
        "--chat-template",
    ], flags
    text = " ".join(short.stdout.split())
    assert "default ]" not in text and "[REWARD_MODEL_PATH, required]" in text
    assert "--micro-batch-cost" not in text and "--pack" not in text, "the tuning settings wait for --help-all"
    every = run("--help-all")
    assert every.returncode == 0, every.stderr
    text = " ".join(every.stdout.split())
    for name, (env, _, _) in SETTINGS.items():
        assert f"--{name.replace('_', '-')} " in text and f"[{env}," in text, name
    # a setting --help does not show still parses
    assert load_settings(["--micro-batch-cost", "96", "--pack", "off"], {}).micro_batch_cost == 96


# --- the real process --------------------------------------------------------------------------------------------


def server_cmd(*args: str) -> list[str]:
    return [sys.executable, str(REPO / "reward_score" / "reward_server.py"), "--host", "127.0.0.1", *args]


def test_health_answers_only_once_the_model_can_score_and_reports_what_runs(tiny_models, tmp_path):
    port = free_port()
    server = start_http_server(
        server_cmd("--model-path", str(tiny_models.reward_model), "--port", str(port)), tmp_path / "rs.log", port
    )
    try:
        status, body = http_get(server.url + "/health")
        health = json.loads(body)
        assert status == 200
        assert health | {"model_path": None} == health | {
            "status": "ok",
            "device": "cpu",
            "dtype": "float32",
            "max_length": 4096,
            "model_path": None,
            "format": "chat_template",
            "input": "conversation",
            "add_special_tokens": False,
            "append_eos": False,
        }
        # Healthy means the first request needs no more loading: it is answered right away.
        import requests

        item = {"prompt": "hi", "response": "ok"}
        r = requests.post(server.url + "/score_batch", json={"items": [item]}, timeout=10)
        assert r.status_code == 200
    finally:
        # uvicorn shuts down cleanly, then re-raises SIGTERM so the exit status says how it ended.
        assert server.stop() in (0, -15)
    log = (tmp_path / "rs.log").read_text()
    assert "ready: model_path=" in log and "Finished server process" in log
    assert "format=conversation (chat template, without special tokens)" in log


def test_the_port_stays_closed_while_the_model_loads(tiny_models, tmp_path):
    port = free_port()
    slow = tmp_path / "slow_start.py"
    # Delay the model load: until the lifespan finishes, nothing may answer on the port.
    argv = [str(REPO / "reward_score" / "reward_server.py"), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--model-path", str(tiny_models.reward_model)]
    slow.write_text(
        "import sys, time, runpy\n"
        "import transformers\n"
        "orig = transformers.AutoModelForSequenceClassification.from_pretrained\n"
        "def slow(*a, **k):\n    time.sleep(3)\n    return orig(*a, **k)\n"
        "transformers.AutoModelForSequenceClassification.from_pretrained = slow\n"
        f"sys.argv = {argv!r}\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    proc = start_process([sys.executable, str(slow)], tmp_path / "slow.log")
    try:
        import time

        seen_refused = False
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                status, _ = http_get(f"http://127.0.0.1:{port}/health", timeout=1)
            except OSError:
                seen_refused = True
                time.sleep(0.1)
                continue
            assert status == 200, "the port answered before the model was ready"
            break
        assert seen_refused, "never saw the port closed during the load"
        assert status == 200
    finally:
        proc.stop()


@pytest.mark.parametrize(
    "make_path, needle",
    [
        (lambda tmp: tmp / "missing", "no such directory"),
        (lambda tmp: tmp, "no config.json"),
    ],
)
def test_a_broken_model_path_fails_at_start_with_a_clear_message(tmp_path, make_path, needle):
    proc = start_process(
        server_cmd("--model-path", str(make_path(tmp_path)), "--port", str(free_port())), tmp_path / "x.log"
    )
    assert proc.popen.wait(60) == 2
    assert needle in Path(proc.log).read_text()


def test_the_articles_config_names_alone_stop_the_server_naming_the_names_it_reads_and_how_the_job_passes_them(
    tiny_models, tmp_path
):
    """The article started its server as `CONFIG_REWARD_MODEL_PATH=... python3 reward_server.py`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("REWARD_")}
    env |= {"CONFIG_REWARD_MODEL_PATH": str(tiny_models.reward_model), "CONFIG_REWARD_DEVICE": "cuda"}
    proc = start_process(server_cmd("--port", str(free_port())), tmp_path / "x.log", env=env)
    assert proc.popen.wait(60) == 2
    log = " ".join(proc.log.read_text().split())
    assert "REWARD_MODEL_PATH (or --model-path) is not set" in log
    assert (
        f"CONFIG_REWARD_MODEL_PATH={tiny_models.reward_model} is not read by this server (it reads REWARD_MODEL_PATH"
        in log
    )
    assert "the launch scripts pass CONFIG_REWARD_DEVICE as --device): running with device=auto" in log


def test_a_model_that_cannot_load_exits_non_zero_before_serving(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"model_type": "qwen3", "architectures": ["Qwen3ForSequenceClassification"]}'
    )
    proc = start_process(server_cmd("--model-path", str(tmp_path), "--port", str(free_port())), tmp_path / "x.log")
    assert proc.popen.wait(120) != 0
    assert "Application startup failed" in proc.log.read_text()


def test_the_model_gets_its_mask_mapping_from_us_and_scores_the_same(tiny_models, client):
    assert client.get("/health").json()["mask_mapping"] is True
    cfg = Settings(model_path=str(tiny_models.reward_model), device="cpu")
    scorer = RewardScorer.load(cfg)
    seqs = [[5, 6, 7, 8] * 10, [9, 10] * 7, [11] * 3]
    built_by_transformers = scorer.score_ids(seqs)  # padded and packed micro-batches, transformers' own masks
    warm_up(scorer)
    assert scorer.mask_mapping is True
    assert scorer.score_ids(seqs) == pytest.approx(built_by_transformers, abs=1e-5)
    assert scorer.score_ids([seqs[0]]) == pytest.approx([built_by_transformers[0]], abs=1e-5)


@pytest.mark.parametrize("how", ["refuses", "misreads"])
def test_a_model_that_does_not_take_the_mask_mapping_builds_its_own_masks(tiny_models, monkeypatch, caplog, how):
    scorer = RewardScorer.load(Settings(model_path=str(tiny_models.reward_model), device="cpu"))
    seqs = [[5, 6, 7, 8] * 10, [9, 10] * 7, [11] * 3]
    expected = scorer.score_ids(seqs)
    forward = scorer.base.forward

    def older_model(*args, attention_mask=None, **kwargs):  # a forward written before per-layer mask mappings
        if isinstance(attention_mask, dict):
            if how == "refuses":
                raise AttributeError("'dict' object has no attribute 'ndim'")
            kwargs["inputs_embeds"] = scorer.base.embed_tokens(kwargs.pop("input_ids")) * 2  # runs, scores wrong
            attention_mask = attention_mask["full_attention"]
        return forward(*args, attention_mask=attention_mask, **kwargs)

    monkeypatch.setattr(scorer.base, "forward", older_model)
    warm_up(scorer)
    assert scorer.mask_mapping is False
    assert "does not take a per-layer mask mapping" in caplog.text
    assert scorer.score_ids(seqs) == pytest.approx(expected, abs=1e-6)


def test_a_deep_models_rounding_in_its_scores_does_not_cost_it_the_mask_mapping(tiny_models, monkeypatch):
    # Two right ways of running a deep bf16 model end in scores further apart than any tolerance that would still
    # catch a wrong one (a random Qwen3-14B on an H200: 0.08); here a head that moves every score by more than that.
    scorer = RewardScorer.load(Settings(model_path=str(tiny_models.reward_model), device="cpu"))
    head, calls = scorer.head, []

    def drifting(hidden):
        calls.append(1)
        return head(hidden) + 0.1 * len(calls)

    monkeypatch.setattr(scorer, "head", drifting)
    warm_up(scorer)
    assert scorer.mask_mapping is True


def test_models_with_sliding_window_layers_keep_transformers_masks(tiny_models):
    scorer = RewardScorer.load(Settings(model_path=str(tiny_models.reward_model), device="cpu"))
    scorer.model.config.layer_types = ["full_attention", "sliding_attention"]
    again = RewardScorer(scorer.model, scorer.tokenizer, "cpu", scorer.settings)
    assert again.can_map_mask is False
    warm_up(again)
    assert again.mask_mapping is False
