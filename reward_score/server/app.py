"""HTTP: the FastAPI app, its request and response bodies, limits, authorization and Prometheus metrics. Handlers
validate, then hand conversations to the Preparer and ids to the Batcher: the event loop never runs model code."""

import asyncio
import concurrent.futures
import contextlib
import functools
import hmac
import logging
from typing import Annotated, Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, StrictStr, model_validator
from starlette.concurrency import run_in_threadpool

from reward_score.server.batcher import Batcher, Preparer
from reward_score.server.inputs import ConversationRefused, InputTooLong
from reward_score.server.runner import RewardScorer
from reward_score.server.settings import Settings
from reward_score.server.warmup import warm_up

log = logging.getLogger("reward_server")


# --- bodies --------------------------------------------------------------------------------------------------

# Items per request (the client sends at most its BATCH_SIZE) and characters per string: pydantic's 422 names them.
MAX_ITEMS, MAX_CHARS = 4096, 262_144
Text = Annotated[StrictStr, Field(max_length=MAX_CHARS)]


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: StrictStr = Field(min_length=1, max_length=64)
    content: Text


class ScoreItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    prompt: Text | None = None
    messages: list[Message] | None = None
    response: Text

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (text) or 'messages' (a chat list)")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("'prompt' is empty")
        if self.messages is not None and not self.messages:
            raise ValueError("'messages' is empty")
        if not self.response.strip():
            raise ValueError("'response' is empty")
        return self

    def conversation(self) -> tuple[list[dict[str, str]], str]:
        """(messages before the answer, the answer): a bare prompt is one user turn."""
        messages = (
            [m.model_dump() for m in self.messages] if self.messages else [{"role": "user", "content": self.prompt}]
        )
        return messages, self.response


class ScoreBatchRequest(BaseModel):
    items: list[ScoreItem] = Field(min_length=1, max_length=MAX_ITEMS)


# A NaN or infinite score is a broken model, never a score: the caller gets a 500.
class ScoreBatchResponse(BaseModel):
    scores: list[FiniteFloat]
    truncated: list[bool]


# --- metrics -------------------------------------------------------------------------------------------------


class Metrics:
    """The Prometheus series /metrics serves, in a registry of this app's own (several apps may share a process)."""

    def __init__(self, peak_gpu_bytes):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("reward_requests", "by endpoint and status", ["endpoint", "status"], registry=r)
        self.padded = Counter("reward_padded_tokens", "tokens including padding", registry=r)
        self.truncated = Counter("reward_truncations", "pairs longer than max_length whose start was cut", registry=r)
        self.errors = Counter("reward_errors", "errors by kind", ["kind"], registry=r)
        self.batch = Histogram("reward_batch_rows", "rows per forward", buckets=[2**k for k in range(10)], registry=r)
        self.wait = Histogram("reward_queue_wait_seconds", "time a request waited for the GPU thread", registry=r)
        self.forward = Histogram("reward_forward_seconds", "time to launch one micro-batch forward", registry=r)
        self.packed = Counter("reward_packed_forwards", "micro-batches run packed", registry=r)
        self.gpu = Counter("reward_gpu_busy_seconds", "GPU time of the micro-batches (CUDA events)", registry=r)
        self.prepare = Histogram("reward_prepare_seconds", "time of one render-and-tokenize pass", registry=r)
        peak = Gauge("reward_gpu_memory_peak_bytes", "peak GPU memory reserved by this server", registry=r)
        peak.set_function(peak_gpu_bytes)

    def on_forward(self, rows: int, width: int, tokens: int, seconds: float) -> None:
        self.batch.observe(rows)
        self.forward.observe(seconds)
        self.padded.inc(rows * width)

    def text(self) -> bytes:
        return generate_latest(self.registry)


def _peak_gpu_bytes(scorer) -> float:
    if scorer is None or not scorer.device.startswith("cuda"):
        return 0.0
    return float(scorer.torch.cuda.max_memory_reserved(scorer.device))


# --- the app -------------------------------------------------------------------------------------------------


class _Server:
    """What the routes share: the settings, the metrics, and (while the lifespan runs) scorer, batcher and preparer."""

    def __init__(self, settings: Settings, scorer: RewardScorer | None):
        self.settings, self.given = settings, scorer
        self.state: dict[str, Any] = {}
        self.metrics = Metrics(lambda: _peak_gpu_bytes(self.state.get("scorer")))

    @contextlib.asynccontextmanager
    async def lifespan(self, app):
        """Load (or take) the model, warm it up and start the two threads: uvicorn binds the port only after this."""
        metrics = self.metrics
        active = self.given or await run_in_threadpool(RewardScorer.load, self.settings)
        active.on_forward = metrics.on_forward
        active.on_oom = lambda: metrics.errors.labels("cuda_oom_split").inc()
        active.on_packed = metrics.packed.inc
        await run_in_threadpool(warm_up, active)
        batcher = Batcher(
            active, on_batch=lambda jobs, waits: [metrics.wait.observe(w) for w in waits], on_gpu=metrics.gpu.inc
        )
        batcher.start()
        # One pass at a time, in a thread of its own (cheaper to reach than anyio's pool, ~0.1 ms a pass).
        prepare_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward-prepare")
        in_prepare_thread = functools.partial(asyncio.get_running_loop().run_in_executor, prepare_thread)
        preparer = Preparer(
            active, in_prepare_thread, on_pass=lambda requests, items, seconds: metrics.prepare.observe(seconds)
        )
        self.state.update(scorer=active, batcher=batcher, preparer=preparer)
        # /health's body, the format in words.
        no_template = "" if active.has_chat_template else ": the tokenizer has no chat template"
        ready = _health(self.settings, active) | {"format": active.format.describe() + no_template}
        log.info("ready: %s", " ".join(f"{k}={v}" for k, v in ready.items() if k != "status"))
        try:
            yield
        finally:
            batcher.stop()
            prepare_thread.shutdown(wait=False)
            self.state.clear()

    def fail(self, status: int, kind: str, detail: str, endpoint: str) -> HTTPException:
        self.metrics.errors.labels(kind).inc()
        self.metrics.requests.labels(endpoint, str(status)).inc()
        return HTTPException(status_code=status, detail=detail)

    def authorize(self, request: Request, endpoint: str) -> None:
        token = self.settings.auth_token
        if not token:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            raise self.fail(
                401, "unauthorized", "missing or wrong 'Authorization: Bearer <token>' (REWARD_SERVER_TOKEN)", endpoint
            )

    async def score_items(self, items: list[ScoreItem]) -> tuple[list[float], list[bool]]:
        """Tokenize in the preparer's thread, fit each to max_length, score on the GPU thread: (scores, truncated)."""
        state = self.state
        endpoint = "/score_batch"
        try:
            ids = await state["preparer"].ids([it.conversation() for it in items])
            encoded = [state["scorer"].fit(x) for x in ids]
            scores = await state["batcher"].score([e.ids for e in encoded])
        except ConversationRefused as exc:
            raise self.fail(422, "template_refused", f"items[].messages: {exc}", endpoint) from None
        except InputTooLong as exc:
            raise self.fail(413, "too_long", str(exc), endpoint) from None
        truncated = [e.truncated for e in encoded]
        self.metrics.truncated.inc(sum(truncated))
        self.metrics.requests.labels(endpoint, "200").inc()
        return scores, truncated


def _health(settings: Settings, active: RewardScorer) -> dict[str, Any]:
    """/health's body once the model is loaded: what the server scores with, as resolved."""
    return {
        "status": "ok",
        "model_path": settings.model_path,
        "device": active.device,
        "dtype": active.dtype,
        "max_length": settings.max_length,
        "format": "chat_template" if active.format.chat_template else "plain_text",
        "input": active.format.input,
        "add_special_tokens": active.format.add_special_tokens,
        "append_eos": active.format.append_eos,
        "compiled": active.compiled,
        "mask_mapping": active.mask_mapping,
        "token_budget": active.planner.token_budget,
        "micro_batch_cost": active.planner.micro_batch_cost,
        "pack": active.planner.pack,
        "warm_up_s": active.warm_up_s,
        "checks": active.checks,
        "auth": bool(settings.auth_token),
    }


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    """422 naming each bad field (without echoing the input back), 500 naming only the exception's type, counted."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        problems = []
        for err in exc.errors()[:20]:
            if err.get("type") == "json_invalid":
                problems.append(f"body: not valid JSON ({err.get('ctx', {}).get('error', 'decode error')})")
                continue
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {err.get('msg', 'invalid')}")
        metrics.errors.labels("invalid_request").inc()
        metrics.requests.labels(request.url.path, "422").inc()
        return JSONResponse(status_code=422, content={"detail": problems})

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        metrics.errors.labels("internal").inc()
        metrics.requests.labels(request.url.path, "500").inc()
        return JSONResponse(
            status_code=500, content={"detail": f"internal error ({type(exc).__name__}); see the server log"}
        )


def _add_routes(app: FastAPI, server: _Server) -> None:
    @app.get("/health")
    async def health(request: Request):
        # Open to probes without a token; a token that is sent must be ours, so a job polling its own port with its
        # token gets 401 from another job's server instead of taking it for its own.
        if "authorization" in request.headers:
            server.authorize(request, "/health")
        return _health(server.settings, server.state["scorer"])

    @app.post("/score_batch", response_model=ScoreBatchResponse)
    async def score_batch(body: ScoreBatchRequest, request: Request):
        server.authorize(request, "/score_batch")
        scores, truncated = await server.score_items(body.items)
        return ScoreBatchResponse(scores=scores, truncated=truncated)

    @app.get("/metrics")
    async def metrics_endpoint(request: Request):
        server.authorize(request, "/metrics")
        return PlainTextResponse(server.metrics.text(), media_type=CONTENT_TYPE_LATEST)


def create_app(settings: Settings, scorer: RewardScorer | None = None) -> FastAPI:
    """The FastAPI app; the model loads in the lifespan unless `scorer` is given (tests)."""
    server = _Server(settings, scorer)
    app = FastAPI(title="reward model server", lifespan=server.lifespan)
    _add_error_handlers(app, server.metrics)
    _add_routes(app, server)
    return app
