"""Reward function for verl 0.6.1: asks the reward server (reward_score/reward_server.py) to score each answer.

verl loads this file by path in its workers on any node, so it imports only the standard library and `requests`
(verl's own scorers for a rule part), and does nothing at import time. Entry points and settings: docs/reward.md.
"""

from __future__ import annotations

import asyncio
import fcntl
import importlib.util
import itertools
import json
import math
import os
import random
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields

import requests

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
EXTRA_KEYS = ("raw_score", "truncated", "penalized", "failed")  # the same numeric keys for every sample
REWARDS = ("rm", "rule", "rm+rule")
# What a rule part may score (verl's scorers: 0 or 1, DAPO's -1 or 1), for the job's reward range.
RULE_RANGE = (-1.0, 1.0)
BATCH_SIZE = 1024  # items per /score_batch request at most (the server takes 4096), a batch split over the servers
LOG_HEAD_CHARS = 300  # REWARD_LOG_TEXTS=head


@dataclass(frozen=True)
class Config:
    """One setting per field: its environment variable is REWARD_<FIELD> unless named in `_ENV_NAMES`."""

    reward: str = "rm"  # rm | rule | rm+rule (REWARD)
    rm_weight: float = 1.0  # rm+rule: score = rm_weight x the reward model's + rule_weight x the rule's
    rule_weight: float = 1.0
    function_path: str = ""  # the user's rule scorer (verl's custom_reward_function contract); empty: verl's
    function_name: str = "compute_score"
    server_urls: tuple[str, ...] = ("http://localhost:8000",)
    min_score: float = -40.0
    max_score: float = 30.0
    penalty: float = math.nan  # nan: the min score
    # The policy's chat template opens <think>; "auto" is the job's to resolve (launch/plan/thinking.py): None here.
    prompt_opens_think: bool | None = True
    on_failure: str = "raise"  # raise | min_score
    connect_timeout: float = 5.0
    read_timeout: float = 300.0
    retry_seconds: float = 180.0  # total time spent retrying one request before giving up
    breaker_seconds: float = 30.0  # after a spent budget, later calls fail at once for this long (0: off)
    coalesce_seconds: float = 0.02  # safe_hack_reward_async: samples awaited within this window share a request
    log_path: str = ""  # JSONL reward log; empty: no log
    log_texts: str = "head"  # full | head | none
    server_log: str = ""  # where the server logs are, for error messages (set by the launch scripts)
    auth_token: str = ""

    @property
    def penalty_score(self) -> float:
        return self.min_score if math.isnan(self.penalty) else self.penalty

    @property
    def opens_think(self) -> bool:
        if self.prompt_opens_think is None:
            raise ValueError(
                "REWARD_PROMPT_OPENS_THINK=auto reached the reward function unresolved: the job reads it from the "
                "policy's chat template and passes true or false as +custom_reward_function.reward_kwargs."
                "prompt_opens_think; outside the job set REWARD_PROMPT_OPENS_THINK=true or false"
            )
        return self.prompt_opens_think

    @property
    def score_range(self) -> tuple[float, float]:
        """The lowest and highest score a sample can get under REWARD (rule parts within RULE_RANGE)."""
        if self.reward == "rm":
            return self.min_score, self.max_score
        if self.reward == "rule":
            return RULE_RANGE
        parts = ((self.rm_weight, (self.min_score, self.max_score)), (self.rule_weight, RULE_RANGE))
        ends = [sorted((w * low, w * high)) for w, (low, high) in parts]
        return ends[0][0] + ends[1][0], ends[0][1] + ends[1][1]


_ENV_NAMES = {
    "server_urls": "REWARD_SERVER_URLS",
    "auth_token": "REWARD_SERVER_TOKEN",
    "server_log": "REWARD_SERVER_LOG",
    "reward": "REWARD",
}


def load_config(kwargs: dict | None = None, environ: dict | None = None) -> Config:
    """Defaults, then the environment, then verl's reward_kwargs (which win). Bad values raise, naming the setting."""
    environ = os.environ if environ is None else environ
    kwargs = kwargs or {}
    known = {f.name for f in fields(Config)} | {"server_url"}
    if unknown := sorted(set(kwargs) - known):
        raise TypeError(f"unknown reward_kwargs {unknown}; known: {sorted(known)}")
    values = {}
    for f in fields(Config):
        env_name = _ENV_NAMES.get(f.name, f"REWARD_{f.name.upper()}")
        raw = kwargs.get(f.name, environ.get(env_name))
        if f.name == "server_urls" and raw in (None, ""):
            raw = kwargs.get("server_url", environ.get("REWARD_SERVER_URL"))  # the article's single URL
        if raw is None or raw == "":
            continue
        try:
            values[f.name] = _convert(f.name, raw)
        except ValueError as exc:
            raise ValueError(
                f"reward setting {f.name} ({env_name} or reward_kwargs.{f.name}) = {raw!r}: {exc}"
            ) from None
    config = Config(**values)
    if config.reward not in REWARDS:
        raise ValueError(f"REWARD={config.reward!r}: use rm (the reward model), rule (verl's scorers) or rm+rule")
    for name in ("rm_weight", "rule_weight"):
        if not math.isfinite(getattr(config, name)):
            raise ValueError(f"REWARD_{name.upper()}={getattr(config, name)}: use a finite number")
    for name, allowed in (("on_failure", ("raise", "min_score")), ("log_texts", ("full", "head", "none"))):
        if getattr(config, name) not in allowed:
            raise ValueError(f"REWARD_{name.upper()} must be {' or '.join(allowed)}, got {getattr(config, name)!r}")
    if config.min_score > config.max_score:
        raise ValueError(f"REWARD_MIN_SCORE ({config.min_score}) is above REWARD_MAX_SCORE ({config.max_score})")
    return config


def _convert(name: str, raw):
    kind = type(getattr(Config, name, None)) if name != "server_urls" else tuple
    if name == "prompt_opens_think" and str(raw).lower() == "auto":
        return None  # the settings block's default: the job resolves it (Config.opens_think)
    if name == "server_urls":
        urls = raw.split(",") if isinstance(raw, str) else list(raw)
        urls = tuple(u.strip().rstrip("/") for u in urls if u.strip())
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if not urls or bad:
            raise ValueError(f"expected http(s)://host:port[,http(s)://host:port...], got {bad or raw}")
        return urls
    if kind is bool:  # str(True) is "True": a bool from reward_kwargs reads as one
        if str(raw).lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
            return str(raw).lower() in ("1", "true", "yes", "on")
        raise ValueError("expected true or false")
    return kind(raw)


# --- what the reward model sees ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    text: str  # what the reward model scores; empty when penalized
    penalty_reason: str = ""  # why it gets the penalty instead of a score


def split_answer(response: str, prompt_opens_think: bool) -> Answer:
    """The answer after the reasoning, or the reason the response gets the penalty."""
    if THINK_CLOSE in response:
        answer = response.rsplit(THINK_CLOSE, 1)[1]
        if THINK_OPEN in answer:
            return Answer("", "stray_think_tag")
    elif THINK_OPEN in response:
        return Answer("", "unclosed_think")
    elif prompt_opens_think:
        return Answer("", "no_think_close")
    else:
        answer = response
    answer = answer.strip()
    if not answer:
        return Answer("", "empty_answer")
    return Answer(answer)


def reward_prompt(ground_truth, extra_info) -> dict:
    """The prompt part of a /score item: `messages` or `prompt`, from extra_info if the builder stored it there."""
    extra_info = extra_info if isinstance(extra_info, dict) else {}
    messages = extra_info.get("reward_messages")
    if messages is not None and len(messages) > 0:
        return {"messages": [{"role": str(m["role"]), "content": str(m["content"])} for m in messages]}
    text = extra_info.get("reward_prompt")
    if isinstance(text, str) and text.strip():
        return {"prompt": text}
    if isinstance(ground_truth, str) and ground_truth.strip():
        return {"prompt": ground_truth}
    raise ValueError(
        "no prompt for the reward model: the row has no extra_info.reward_messages / extra_info.reward_prompt and "
        f"an empty reward_model.ground_truth ({ground_truth!r}); rebuild the data with data_prep.build"
    )


# --- HTTP ----------------------------------------------------------------------------------------------------


class RewardServerError(RuntimeError):
    """The reward servers could not score: unreachable or failing past the retry budget."""


class RewardRequestRejected(RewardServerError):
    """A server answered 4xx: the request itself is wrong, so retrying or another server cannot help."""


_session: requests.Session | None = None
_session_lock = threading.Lock()
_next_server = itertools.count()


def _get_session() -> requests.Session:
    """One pooled keep-alive session per process, never through a proxy: the reward servers are the job's own, and a
    cluster's http_proxy/all_proxy reach verl's workers."""
    global _session
    with _session_lock:
        if _session is None:
            session = requests.Session()
            session.trust_env = False  # no proxies from the environment (nor .netrc or REQUESTS_CA_BUNDLE)
            adapter = requests.adapters.HTTPAdapter(pool_connections=16, pool_maxsize=64, max_retries=0)
            session.mount("http://", adapter)
            session.mount("https://", adapter)
            _session = session
        return _session


def _beside(name: str):
    """A module of this folder, loaded by path: verl loads this file by path, outside any package."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"reward_score_client_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# Per server list, (when a request spent its retry budget, its error): REWARD_BREAKER_SECONDS (docs/reward.md).
_gave_up: dict[tuple[str, ...], tuple[float, str]] = {}


def _breaker_refusal(config: Config) -> str | None:
    """The refusal's words while this process has given up on these servers, else None."""
    opened, error = _gave_up.get(config.server_urls, (-math.inf, ""))
    age = time.monotonic() - opened
    if age >= config.breaker_seconds:  # never given up, cooled down, or off (0)
        return None
    return (
        f"{error} (this process gave up on them {age:.1f} s ago: failing at once instead of waiting the budget "
        f"again, for {config.breaker_seconds - age:.0f} s more, REWARD_BREAKER_SECONDS)"
    )


def post_json(config: Config, path: str, payload: dict) -> dict:
    """POST to one server after another until one answers 200 within `retry_seconds` (backoff with jitter, the last
    attempt at the deadline); a 4xx raises at once with the server's message."""
    if (refusal := _breaker_refusal(config)) is not None:
        raise RewardServerError(refusal)
    session = _get_session()
    headers = {"Authorization": f"Bearer {config.auth_token}"} if config.auth_token else {}
    servers = config.server_urls
    start = next(_next_server)
    deadline = time.monotonic() + config.retry_seconds
    last_error = "no attempt made"
    for attempt in itertools.count():
        url = servers[(start + attempt) % len(servers)] + path
        # A hanging connect may not overrun the budget; a server that accepted is scoring, so the read keeps its own.
        connect = max(0.5, min(config.connect_timeout, deadline - time.monotonic()))
        try:
            resp = session.post(url, json=payload, headers=headers, timeout=(connect, config.read_timeout))
        except (requests.ConnectionError, requests.Timeout) as exc:
            last_error = f"{url}: {type(exc).__name__}: {exc}"
        else:
            if resp.status_code == 200:
                _gave_up.pop(config.server_urls, None)
                return resp.json()
            if 400 <= resp.status_code < 500:
                raise RewardRequestRejected(f"{url} refused the request with {resp.status_code}: {resp.text[:500]}")
            last_error = f"{url}: HTTP {resp.status_code}: {resp.text[:300]}"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            where = config.server_log or "the reward server log in the job's log folder"
            error = (
                f"reward server(s) {', '.join(servers)} did not score within {config.retry_seconds:.0f} s "
                f"({attempt + 1} attempts); last error: {last_error}. Check {where}. "
                "Failing the step instead of inventing scores (REWARD_ON_FAILURE=min_score opts out)."
            )
            _gave_up[config.server_urls] = (time.monotonic(), error)
            raise RewardServerError(error)
        time.sleep(min(remaining, min(10.0, 0.25 * 2**attempt) * random.uniform(0.5, 1.0)))


# --- the reward log ------------------------------------------------------------------------------------------

_log_failure_reported = False


def write_log(config: Config, records: list[dict]) -> None:
    """Append one JSON line per sample under an exclusive lock; a failure is reported once, never raised."""
    global _log_failure_reported
    if not config.log_path or not records:
        return
    try:
        os.makedirs(os.path.dirname(os.path.abspath(config.log_path)), exist_ok=True)
        data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
        with open(config.log_path, "ab") as f:  # closing it flushes, then releases the lock
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(data)
    except OSError as exc:
        if not _log_failure_reported:
            _log_failure_reported = True
            print(
                f"[reward] cannot write the reward log {config.log_path}: {exc} (rewards are unaffected)",
                file=sys.stderr,
            )


# --- scoring -------------------------------------------------------------------------------------------------


def _result(config: Config, raw: float, *, penalized=False, truncated=False, failed=False) -> dict:
    score = config.penalty_score if penalized else min(max(raw, config.min_score), config.max_score)
    return {
        "score": float(score),
        "raw_score": float(raw),
        "truncated": float(truncated),
        "penalized": float(penalized),
        "failed": float(failed),
    }


rule_reward = _beside("rule_reward")  # REWARD=rule / rm+rule, the user's function (reward_score/rule_reward.py)
load_function, rule_score, _mixed = rule_reward.load_function, rule_reward.rule_score, rule_reward.mixed


def score_many(data_sources, solution_strs, ground_truths, extra_infos, config: Config) -> list[dict]:
    """Penalties locally, the rest in /score_batch chunks spread over the servers; by rule too (or only) by REWARD."""
    n = len(solution_strs)
    samples = zip(data_sources, solution_strs, ground_truths, extra_infos, strict=True)
    rules = [rule_score(config, *sample) for sample in samples] if config.reward != "rm" else [None] * n
    answers = [split_answer(str(r), config.opens_think) for r in solution_strs]
    if config.reward == "rule":  # no reward model: nothing to send, no prompt for it needed
        prompts, todo = [{"prompt": ""}] * n, []
    else:
        prompts = [reward_prompt(ground_truths[i], extra_infos[i]) for i in range(n)]
        todo = [i for i, a in enumerate(answers) if not a.penalty_reason]
    scored, failures = _score_on_servers(config, prompts, answers, todo)
    now = time.time()
    out, records = [], []
    for i, answer in enumerate(answers):
        if config.reward == "rule":
            result, status, reason = _mixed(config, None, rules[i]), "rule_error" if rules[i][1] else "ok", rules[i][1]
        elif answer.penalty_reason:
            result, status = _result(config, config.penalty_score, penalized=True), "penalty"
            reason = answer.penalty_reason
        elif i in scored:
            raw, truncated = scored[i]
            result, status, reason = _result(config, raw, truncated=truncated), "ok", ""
        else:  # only under REWARD_ON_FAILURE=min_score
            result, status, reason = _result(config, config.min_score, failed=True), "error", str(failures[0])[:300]
        if config.reward == "rm+rule":
            result, reason = _mixed(config, result, rules[i]), reason or rules[i][1]
        out.append(result)
        sample = (str(data_sources[i]), prompts[i], str(solution_strs[i]), answer.text)
        records.append(_record(config, now, sample, status, reason, result))
    if failures:
        failed = sum(1 for r in out if r["failed"])
        print(
            f"[reward] REWARD_ON_FAILURE=min_score: {failed} of {n} samples scored {config.min_score} "
            f"because the reward servers failed: {failures[0]}",
            file=sys.stderr,
        )
    write_log(config, records)
    return out


def _score_on_servers(config: Config, prompts: list[dict], answers: list[Answer], todo: list[int]):
    """({sample: (raw score, truncated)}, the outages min_score let through): one request per server where it fits."""
    size = max(1, min(BATCH_SIZE, math.ceil(len(todo) / len(config.server_urls))))
    chunks = [todo[k : k + size] for k in range(0, len(todo), size)]
    scored: dict[int, tuple[float, bool]] = {}
    failures: list[RewardServerError] = []

    def post(chunk: list[int]) -> None:
        try:
            items = [{**prompts[i], "response": answers[i].text} for i in chunk]
            body = post_json(config, "/score_batch", {"items": items})
            scores, truncated = body["scores"], body.get("truncated", [False] * len(chunk))
        except RewardServerError as exc:
            if config.on_failure == "raise" or isinstance(exc, RewardRequestRejected):  # a wrong request: never scored
                raise
            failures.append(exc)
            return
        scored.update({i: (float(s), bool(t)) for i, s, t in zip(chunk, scores, truncated, strict=True)})

    if len(chunks) == 1:
        post(chunks[0])
    elif chunks:
        with ThreadPoolExecutor(max_workers=min(len(chunks), 32)) as pool:
            list(pool.map(post, chunks))
    return scored, failures


def _record(config: Config, now: float, sample: tuple, status: str, reason: str, result: dict) -> dict:
    """One line of the reward log; `sample`: (data_source, the reward model's prompt item, the response, the answer)."""
    data_source, prompt_item, response, answer = sample
    prompt = prompt_item.get("prompt") or json.dumps(prompt_item.get("messages"), ensure_ascii=False)
    texts = {"prompt": prompt, "response": response, "answer": answer} if config.log_texts != "none" else {}
    head = LOG_HEAD_CHARS if config.log_texts == "head" else None
    return {
        "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)),
        "epoch": now,
        "pid": os.getpid(),
        "data_source": data_source,
        "status": status,
        "reason": reason,
        **result,
        "prompt_chars": len(prompt),
        "response_chars": len(response),
        "answer_chars": len(answer),
        **{k: v[:head] for k, v in texts.items()},
    }


def _without_router(kwargs: dict) -> dict:
    """Without what verl's async rollout also passes (reward_router_address, reward_model_tokenizer)."""
    return {k: v for k, v in kwargs.items() if k not in ("reward_router_address", "reward_model_tokenizer")}


def safe_hack_reward(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """One sample (verl's naive and dapo managers)."""
    config = load_config(_without_router(kwargs))
    return score_many([data_source], [solution_str], [ground_truth], [extra_info], config)[0]


def safe_hack_reward_batch(data_sources, solution_strs, ground_truths, extra_infos, **kwargs) -> list[dict]:
    """The whole batch at once (verl's batch manager, sync rollout): a few /score_batch requests instead of N."""
    config = load_config(kwargs)
    return score_many(list(data_sources), list(solution_strs), list(ground_truths), list(extra_infos), config)


# --- verl's async reward loop --------------------------------------------------------------------------------------


class _Coalescer:
    """Samples awaited on one loop within `coalesce_seconds` share a `score_many` call, in the loop's executor."""

    def __init__(self, loop: asyncio.AbstractEventLoop, config: Config) -> None:
        self.loop, self.config = loop, config
        self.pending: list[tuple[tuple, asyncio.Future]] = []
        self.timer: asyncio.TimerHandle | None = None
        self.tasks: set[asyncio.Task] = set()  # the loop keeps only weak references to tasks

    def submit(self, sample: tuple) -> asyncio.Future:
        future = self.loop.create_future()
        self.pending.append((sample, future))
        if len(self.pending) >= BATCH_SIZE:
            self.flush()
        elif self.timer is None:
            self.timer = self.loop.call_later(self.config.coalesce_seconds, self.flush)
        return future

    def flush(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        batch, self.pending = self.pending, []
        if batch:
            task = self.loop.create_task(self._score(batch))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _score(self, batch: list[tuple[tuple, asyncio.Future]]) -> None:
        samples = [sample for sample, _ in batch]
        try:
            results = await self.loop.run_in_executor(None, _score_each, self.config, samples)
        except BaseException as exc:  # noqa: BLE001  (handed to every waiting caller, never lost)
            results = [exc] * len(batch)
        for (_, future), result in zip(batch, results, strict=True):
            if future.done():  # its caller was cancelled
                continue
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


def _score_each(config: Config, samples: list[tuple]) -> list:
    """`score_many` on the group; a result or an exception per sample, as separate calls would give: an outage fails
    every sample that needed a server, any other error is found by scoring the group again one by one."""
    try:
        return score_many(*(list(column) for column in zip(*samples, strict=True)), config)
    except Exception as exc:
        if len(samples) == 1:
            raise
        outage = exc if type(exc) is RewardServerError else None
    results = []
    for sample in samples:
        if outage is not None and not split_answer(str(sample[1]), config.opens_think).penalty_reason:
            results.append(outage)
            continue
        try:
            results.append(score_many(*([x] for x in sample), config)[0])
        except Exception as exc:  # this sample's own error, raised to its caller
            results.append(exc)
    return results


_coalescers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> {repr(Config): _Coalescer}
_coalescers_lock = threading.Lock()


async def safe_hack_reward_async(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict:
    """One sample, awaited by verl's async reward loop (sync managers do not await it): samples awaited together
    share one request (`coalesce_seconds`); results, failures and log as `safe_hack_reward`'s."""
    config = load_config(_without_router(kwargs))
    loop = asyncio.get_running_loop()
    with _coalescers_lock:
        per_loop = _coalescers.setdefault(loop, {})
        key = repr(config)  # not the Config itself: a NaN penalty parsed from the environment never equals itself
        coalescer = per_loop.get(key) or per_loop.setdefault(key, _Coalescer(loop, config))
    return await coalescer.submit((data_source, solution_str, ground_truth, extra_info))
