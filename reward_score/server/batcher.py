"""Cross-request batching: the thread that owns the model (`Batcher`: when to launch which planned micro-batch) and
the off-loop tokenizing of requests (`Preparer`)."""

import asyncio
import collections
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from reward_score.server.inputs import ConversationRefused
from reward_score.server.runner import Launched, RewardScorer

log = logging.getLogger("reward_server")


@dataclass(eq=False)
class _Job:
    seqs: list[list[int]]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float
    scores: list[float] = field(default_factory=list)
    left: int = 0  # rows not scored yet
    failed: bool = False


_Row = tuple[_Job, int]
# How long an idle GPU thread gathers a burst of requests, and the gap that ends it early (8 or 40 ms instead of 20:
# within run-to-run noise, benchmarks/HISTORY.md).
MAX_WAIT_S, QUIET_S = 0.020, 0.002


class Batcher:
    """One thread owns the model and keeps up to `depth` micro-batches on the GPU (docs/reward.md). The next goes in
    behind a running one once a full token budget waits or its oldest row has waited `max_wait`; each launch takes the
    planned micro-batch holding the oldest waiting row. When idle, a first request waits up to `max_wait` for others."""

    def __init__(
        self,
        scorer: RewardScorer,
        max_wait_s: float = MAX_WAIT_S,
        quiet_s: float = QUIET_S,
        on_batch=None,
        depth: int = 2,
        on_gpu=None,
    ):
        self.scorer = scorer
        self.planner = scorer.planner
        self.max_wait_s = max_wait_s
        self.quiet_s = quiet_s
        self.depth = depth
        self.on_batch = on_batch  # metrics hook: (jobs, queue_waits)
        self.on_gpu = on_gpu  # metrics hook: GPU seconds of a finished micro-batch (timed ones only)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="reward-gpu", daemon=True)
        self._stopping = False

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)

    async def score(self, seqs: list[list[int]]) -> list[float]:
        loop = asyncio.get_running_loop()
        job = _Job(seqs, loop.create_future(), loop, time.perf_counter())
        self._queue.put(job)
        return await job.future

    def _gather(self, first: _Job) -> list[_Job]:
        """Take what arrives within `max_wait` of the first, until `quiet` passes with nothing new or plenty waits."""
        jobs = [first]
        tokens = sum(len(s) for s in first.seqs)
        deadline = time.perf_counter() + self.max_wait_s
        while tokens < 4 * self.planner.token_budget:
            timeout = min(self.quiet_s, deadline - time.perf_counter())
            job = self._take(timeout)
            if job is None:
                return jobs
            jobs.append(job)
            tokens += sum(len(s) for s in job.seqs)
        return jobs

    def _take(self, timeout: float) -> _Job | None:
        """The next queued request, waiting at most `timeout` s; None if there is none or the server is stopping."""
        if self._stopping:
            return None
        try:
            job = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        except queue.Empty:
            return None
        if job is None:
            self._stopping = True  # finish what was accepted, then return
        return job

    def _run(self) -> None:
        waiting: list[_Row] = []
        flights: collections.deque[tuple[list[_Row], Launched]] = collections.deque()
        while True:
            try:
                if not self._step(waiting, flights):
                    return
            except BaseException as exc:  # the thread must not die with requests waiting on it
                log.exception("GPU thread: unexpected error; failing the requests it holds and serving on")
                held = {j for rows, _ in flights for j, _ in rows} | {j for j, _ in waiting}
                flights.clear()
                self._fail(held, exc, waiting)

    def _step(self, waiting: list[_Row], flights) -> bool:
        """Admit, launch, then wait for the oldest micro-batch and answer its requests. False: stop the thread."""
        if not waiting and not flights:
            if self._stopping:
                return False
            first = self._queue.get()
            if first is None:
                return False
            self._admit(self._gather(first), waiting)
        self._admit(self._queued(), waiting)
        while waiting and len(flights) < self.depth:
            self._launch(waiting, flights)
        if not flights:
            return True
        rows, handle = flights[0]
        # While the oldest micro-batch runs, take new requests and launch the next once it is due (`_due`).
        while not handle.ready():
            job = self._take(0.001)
            if job is not None:
                self._admit([job, *self._queued()], waiting)  # all that queued while a launch held this thread
            elif self._stopping:
                break
            if waiting and len(flights) < self.depth and self._due(waiting):
                self._launch(waiting, flights)
        flights.popleft()
        try:
            values = handle.result()
        except BaseException as exc:  # delivered to every request in this micro-batch, never swallowed
            self._fail({j for j, _ in rows}, exc, waiting)
            return True
        self._measured(handle)
        for (job, i), value in zip(rows, values, strict=True):
            if job.failed:
                continue
            job.scores[i] = value
            job.left -= 1
            if job.left == 0:
                _answer(job, job.scores, None)
        return True

    def _queued(self) -> list[_Job]:
        """Every request queued now, without waiting."""
        jobs = []
        while (job := self._take(0)) is not None:
            jobs.append(job)
        return jobs

    def _due(self, waiting: list[_Row]) -> bool:
        """A full token budget waits, or the oldest row has waited `max_wait`."""
        if sum(len(j.seqs[i]) for j, i in waiting) >= self.planner.token_budget:
            return True
        return time.perf_counter() - waiting[0][0].enqueued >= self.max_wait_s

    def _measured(self, handle) -> None:
        """A finished micro-batch's GPU time to the metrics hook (timed on a GPU only)."""
        seconds = getattr(handle, "gpu_seconds", lambda: None)()
        if seconds is not None and self.on_gpu:
            self.on_gpu(seconds)

    def _admit(self, jobs: list[_Job], waiting: list[_Row]) -> None:
        now = time.perf_counter()
        if self.on_batch:
            self.on_batch(jobs, [now - j.enqueued for j in jobs])
        for job in jobs:
            job.scores, job.left = [0.0] * len(job.seqs), len(job.seqs)
            if not job.seqs:
                _answer(job, [], None)
            waiting.extend((job, i) for i in range(len(job.seqs)))

    def _launch(self, waiting: list[_Row], flights) -> None:
        """Plan every waiting row; launch the micro-batch holding the oldest one and take its rows off `waiting`."""
        plan = self.planner.plan([len(j.seqs[i]) for j, i in waiting])
        oldest = waiting[0][0]
        chosen = next(rows for rows in plan if any(waiting[i][0] is oldest for i in rows))
        picked = set(chosen)
        rows = [waiting[i] for i in chosen]
        waiting[:] = [row for k, row in enumerate(waiting) if k not in picked]
        try:
            flights.append((rows, self.scorer.launch([j.seqs[i] for j, i in rows])))
        except BaseException as exc:
            self._fail({j for j, _ in rows}, exc, waiting)

    @staticmethod
    def _fail(jobs: set[_Job], exc: BaseException, waiting: list[_Row]) -> None:
        for job in jobs:
            job.failed = True
            _answer(job, None, exc)
        waiting[:] = [row for row in waiting if not row[0].failed]


def _answer(job: _Job, value, exc) -> None:
    """Hand a result to the request's event loop (from the GPU thread); a loop already closed has nobody waiting."""
    with contextlib.suppress(RuntimeError):
        job.loop.call_soon_threadsafe(_settle, job.future, value, exc)


def _settle(future: asyncio.Future, value, exc) -> None:
    if future.done():  # the caller went away
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)


Conversation = tuple[list[dict[str, str]], str]  # (messages before the answer, the answer)


class Preparer:
    """Renders and tokenizes requests off the event loop, all that wait in one pass: one `tokenize` call runs on every
    core without the GIL (on the loop, ~1.5 ms a request held it). A template's refusal fails its own request only."""

    def __init__(self, scorer: RewardScorer, run_in_thread, on_pass=None):
        self.scorer = scorer
        self.run_in_thread = run_in_thread  # (fn, *args) -> awaitable
        self.on_pass = on_pass  # metrics hook: (requests, items, seconds)
        self._waiting: list[tuple[list[Conversation], asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None

    async def ids(self, conversations: list[Conversation]) -> list[list[int]]:
        """The token ids of each conversation, in order; raises ConversationRefused for a template's refusal."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._waiting.append((conversations, future))
        if self._drainer is None:
            self._drainer = loop.create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._waiting:
                taken, self._waiting = self._waiting, []
                try:
                    results = await self.run_in_thread(self._pass, [convs for convs, _ in taken])
                except BaseException as exc:  # noqa: BLE001 - handed to every caller of this pass, never swallowed
                    results = [exc] * len(taken)
                for (_, future), result in zip(taken, results, strict=True):
                    _settle(future, result, result if isinstance(result, BaseException) else None)
        finally:
            self._drainer = None

    def _pass(self, requests: list[list[Conversation]]) -> list[list[list[int]] | BaseException]:
        started = time.perf_counter()
        texts: list[str] = []
        spans: list[tuple[int, int] | BaseException] = []
        for conversations in requests:
            try:
                rendered = [self.scorer.render(messages, response) for messages, response in conversations]
            except ConversationRefused as exc:
                spans.append(exc)
                continue
            spans.append((len(texts), len(texts) + len(rendered)))
            texts.extend(rendered)
        ids = self.scorer.tokenize(texts) if texts else []
        if self.on_pass:
            self.on_pass(len(requests), len(texts), time.perf_counter() - started)
        return [span if isinstance(span, BaseException) else ids[span[0] : span[1]] for span in spans]
