"""Reward model server: scores (prompt, response) pairs exactly as TRL trained the model, batched across requests.

    python reward_score/reward_server.py --model-path /models/Unsafe-Reward-Qwen3-1.7B --port 8000
    CONFIG_REWARD_MODEL_PATH=... CONFIG_REWARD_DEVICE=cuda:0 python -m reward_score.reward_server

API
    GET  /health       200 {model_path, device, dtype, max_length, ...} once the model is loaded and warmed up
                       (401 if an Authorization header is sent with another token);
                       before that the port is closed (the model loads before uvicorn binds it).
    POST /score        {"prompt": str | "messages": [{role, content}], "response": str} -> {"score", "truncated"}
    POST /score_batch  {"items": [ ...same items... ]} -> {"scores": [...], "truncated": [...]} in order
    GET  /metrics      Prometheus text

How a pair is scored (what TRL's RewardTrainer did at training time): the reward model tokenizer's own chat template
over [user prompt (or the given messages), assistant response], no generation prompt, tokenized without adding special
tokens again. A tokenizer without a chat template falls back to TRL's plain-text rule (prompt + response + EOS), and
the server says so at start. Over-long input keeps its LAST `max_length` tokens (the score is read from the last
token), or is rejected with 413 when `REWARD_TRUNCATION=reject`.

Throughput: requests are rendered and tokenized off the event loop, all that wait in one pass; then one GPU thread
plans every waiting row into micro-batches (sorted by length, padded to a multiple of `REWARD_PAD_MULTIPLE` tokens: a
bounded set of shapes, each under `REWARD_TOKEN_BUDGET` tokens; where lengths are mixed, several short sequences share
a row, each with its own positions and a block-diagonal causal mask), keeps two of them on the GPU, answers each
request as soon as its own rows are scored, and plans the next micro-batch from whatever waits then, oldest request
first. When idle it waits at most `REWARD_MAX_WAIT_MS` for a burst to gather; while one micro-batch runs, the next goes
in behind it once a full budget or `REWARD_MAX_WAIT_MS` has passed. Every score is read at the row's last real token.
Launching does not wait for the running micro-batch (pinned inputs; the model gets its mask mapping from us, not one
built by transformers that synchronises). A CUDA out-of-memory error splits the micro-batch and retries. The event
loop never runs model code.

Settings come from the environment (names below); each has a command-line flag that wins (`--help`).
"""

import argparse
import asyncio
import collections
import concurrent.futures
import contextlib
import hmac
import importlib.util
import logging
import math
import os
import queue
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger("reward_server")


# --- settings ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Settings:
    """Every setting: (environment variable, flag, help) in `_SETTINGS` below."""

    model_path: str = ""
    device: str = "auto"
    host: str = "0.0.0.0"
    port: int = 8000
    max_length: int = 4096
    truncation: Literal["left", "reject"] = "left"
    token_budget: int = 0  # 0: 32768 on a GPU, 8192 on the CPU
    max_batch_rows: int = 256
    pad_multiple: int = 64
    max_wait_ms: float = 20.0
    quiet_ms: float = 2.0
    compile: str = "auto"
    max_items: int = 4096
    max_chars: int = 262_144
    max_body_bytes: int = 64 * 1024 * 1024
    auth_token: str = ""
    log_level: str = "info"

    def effective_token_budget(self, device: str) -> int:
        return self.token_budget or (32768 if device.startswith("cuda") else 8192)


_SETTINGS: dict[str, tuple[str, str]] = {
    "model_path": ("CONFIG_REWARD_MODEL_PATH", "folder of the reward model (config.json, weights, tokenizer)"),
    "device": ("CONFIG_REWARD_DEVICE", "cpu | cuda | cuda:N | auto (cuda if available)"),
    "host": ("REWARD_SERVER_HOST", "address to bind (0.0.0.0: reachable from the other nodes)"),
    "port": ("CONFIG_REWARD_SERVER_PORT", "port to listen on"),
    "max_length": ("REWARD_MAX_LENGTH", "tokens scored per pair; longer input keeps its last tokens"),
    "truncation": ("REWARD_TRUNCATION", "left: keep the last max_length tokens; reject: answer 413"),
    "token_budget": ("REWARD_TOKEN_BUDGET", "padded tokens per forward (0: 32768 on GPU, 8192 on CPU)"),
    "max_batch_rows": ("REWARD_MAX_BATCH_ROWS", "rows per forward at most"),
    "pad_multiple": ("REWARD_PAD_MULTIPLE", "pad each batch to a multiple of this many tokens"),
    "max_wait_ms": ("REWARD_MAX_WAIT_MS", "longest the GPU thread gathers requests into one batch"),
    "quiet_ms": ("REWARD_QUIET_MS", "gathering stops early once no request arrived for this long"),
    "compile": ("REWARD_COMPILE", "auto (per-layer torch.compile on GPU) | layers | off"),
    "max_items": ("REWARD_MAX_ITEMS", "items per /score_batch request at most"),
    "max_chars": ("REWARD_MAX_CHARS", "characters per prompt, message or response at most"),
    "max_body_bytes": ("REWARD_MAX_BODY_BYTES", "request body size at most"),
    "auth_token": ("REWARD_SERVER_TOKEN", "if set, requests need 'Authorization: Bearer <token>'"),
    "log_level": ("REWARD_LOG_LEVEL", "debug | info | warning"),
}


def load_settings(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Defaults, then the environment, then command-line flags (which win). Bad values exit with the name to fix."""
    environ = dict(os.environ if environ is None else environ)
    parser = argparse.ArgumentParser(
        prog="reward_server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    defaults = Settings()
    values: dict[str, Any] = {}
    for f in fields(Settings):
        env_name, help_text = _SETTINGS[f.name]
        kind = type(getattr(defaults, f.name))
        raw = environ.get(env_name)
        if raw not in (None, ""):
            try:
                values[f.name] = kind(raw)
            except ValueError:
                parser.error(f"{env_name}={raw!r} is not a valid {kind.__name__}")
        flag = "--" + f.name.replace("_", "-")
        default_shown = "(set)" if f.name == "auth_token" else getattr(defaults, f.name)
        parser.add_argument(
            flag, type=kind, default=None, help=f"{help_text} [env {env_name}; default {default_shown}]"
        )
    args = parser.parse_args(argv)
    values.update({k: v for k, v in vars(args).items() if v is not None})
    settings = replace(defaults, **values)
    problems = []
    if settings.compile not in ("auto", "layers", "off"):
        problems.append(f"REWARD_COMPILE must be auto, layers or off, got {settings.compile!r}")
    if settings.truncation not in ("left", "reject"):
        problems.append(f"REWARD_TRUNCATION must be 'left' or 'reject', got {settings.truncation!r}")
    if not (settings.device in ("auto", "cpu", "cuda") or settings.device.startswith("cuda:")):
        problems.append(f"CONFIG_REWARD_DEVICE must be cpu, cuda, cuda:N or auto, got {settings.device!r}")
    for name in ("max_length", "max_batch_rows", "pad_multiple", "max_items", "max_chars", "max_body_bytes"):
        if getattr(settings, name) < 1:
            problems.append(f"{_SETTINGS[name][0]} must be at least 1, got {getattr(settings, name)}")
    if problems:
        parser.error("; ".join(problems))
    return settings


def check_model_path(path: str) -> str | None:
    """Why `path` cannot be a reward model folder, or None. Checked before anything starts."""
    if not path:
        return "CONFIG_REWARD_MODEL_PATH (or --model-path) is not set: point it at the reward model's folder"
    folder = Path(path)
    if not folder.is_dir():
        return f"CONFIG_REWARD_MODEL_PATH={path}: no such directory"
    if not (folder / "config.json").is_file():
        return f"CONFIG_REWARD_MODEL_PATH={path}: no config.json there (is it the folder save_pretrained wrote?)"
    return None


# --- scoring -------------------------------------------------------------------------------------------------


class InputTooLong(ValueError):
    """An item is longer than max_length under REWARD_TRUNCATION=reject, or cannot fit in memory alone."""


class ConversationRefused(ValueError):
    """The chat template raised on these messages (e.g. Qwen3's "No user query found in messages.")."""


@dataclass
class Encoded:
    ids: list[int]
    truncated: bool


PACK_WHEN = 0.8  # pack a micro-batch's sequences several to a row when that needs at most 80% of the rows


class _Packer:
    """First-fit decreasing: sequences, fed longest first, go into the first row of `width` tokens with room left."""

    def __init__(self, width: int):
        self.width = width
        self.rooms: list[int] = []
        self.bins: list[list[int]] = []
        self.max_room = 0

    def slot(self, n: int) -> int:
        """The row a sequence of n tokens would go to (len(rooms): a new one)."""
        if n <= self.max_room:
            for b, room in enumerate(self.rooms):
                if n <= room:
                    return b
        return len(self.rooms)

    def add(self, i: int, n: int, slot: int) -> None:
        if slot == len(self.rooms):
            self.rooms.append(self.width - n)
            self.bins.append([i])
            self.max_room = max(self.max_room, self.width - n)
            return
        emptiest = self.rooms[slot] == self.max_room
        self.rooms[slot] -= n
        self.bins[slot].append(i)
        if emptiest:
            self.max_room = max(self.rooms)


class RewardScorer:
    """The model, its tokenizer and the formatting rule; `score_ids` runs micro-batched forwards (any thread)."""

    def __init__(self, model, tokenizer, device: str, settings: Settings):
        import jinja2
        import torch

        self.torch = torch
        self._template_error = jinja2.TemplateError
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.settings = settings
        self.token_budget = settings.effective_token_budget(device)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.chat_template = bool(getattr(tokenizer, "chat_template", None))
        # The fast path reads the score at each row's last real token itself: no reliance on pad_token_id detection
        # (a response may contain the pad token's text), and the head runs on B rows instead of B x L.
        self.base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        self.head = getattr(model, "score", None)
        # Packing needs the fast path and an attention that takes a boolean 4D mask as given (sdpa).
        attention = getattr(model.config, "_attn_implementation", None)
        self.can_pack = self.base is not None and self.head is not None and attention == "sdpa"
        # Hand the model its per-layer mask mapping ourselves (warm_up checks the model takes it and scores the same)?
        layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
        self.can_map_mask = self.base is not None and self.head is not None and layer_types == {"full_attention"}
        self.mask_mapping = False
        # Inputs go to the GPU from pinned memory: a copy from pageable memory waits for the GPU to finish what is
        # queued before it, so launching the next micro-batch would wait for the running one.
        self.pin = device.startswith("cuda")
        self.backend = tokenizer.backend_tokenizer if getattr(tokenizer, "is_fast", False) else None
        if self.backend is not None:
            # Never mutated after this, so threads may encode concurrently.
            self.backend.no_truncation()
            self.backend.no_padding()
        self._slow_lock = threading.Lock()
        self.on_forward = None  # metrics hook: (rows, padded_len, real_tokens, seconds)
        self.on_oom = None  # metrics hook: a micro-batch was split after a CUDA out-of-memory error
        self.compiled = False

    @classmethod
    def load(cls, settings: Settings) -> "RewardScorer":
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        device = settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"CONFIG_REWARD_DEVICE={device} but torch sees no CUDA device; use cpu or auto")
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        tokenizer = AutoTokenizer.from_pretrained(settings.model_path)
        model = AutoModelForSequenceClassification.from_pretrained(
            settings.model_path, dtype=dtype, num_labels=1, attn_implementation="sdpa"
        )
        if model.config.pad_token_id is None:
            model.config.pad_token_id = (
                tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            )
        model.to(device).eval()
        scorer = cls(model, tokenizer, device, settings)
        if settings.compile == "layers" or (settings.compile == "auto" and device.startswith("cuda")):
            scorer.compile_layers()
        return scorer

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    # -- formatting ---------------------------------------------------------------------------------------------

    def render(self, messages: list[dict[str, str]], response: str) -> str:
        """The exact text the reward model was trained on for this conversation."""
        if self.chat_template:
            conversation = [*messages, {"role": "assistant", "content": response}]
            try:
                return self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=False)
            except self._template_error as exc:  # the template's own raise_exception(...): a wrong conversation
                raise ConversationRefused(f"the reward model's chat template refused these messages: {exc}") from None
        # TRL's plain-text rule: prompt then completion, EOS appended.
        eos = self.tokenizer.eos_token or ""
        text = "\n".join(m["content"] for m in messages) + response
        return text if text.endswith(eos) else text + eos

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, no special tokens added (the template has them); any thread. The Rust tokenizer
        encodes a list on every core without holding the GIL; `encode_batch_fast` (tokenizers >= 0.21) also skips the
        character offsets nobody reads here."""
        if self.backend is not None:
            encode = getattr(self.backend, "encode_batch_fast", None) or self.backend.encode_batch
            return [e.ids for e in encode(texts, add_special_tokens=False)]
        with self._slow_lock:
            return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def fit(self, ids: list[int], where: str) -> Encoded:
        """`ids` within max_length: over-long input keeps its last tokens, or is refused under REWARD_TRUNCATION=reject."""
        limit = self.settings.max_length
        if len(ids) <= limit:
            return Encoded(ids, False)
        if self.settings.truncation == "reject":
            raise InputTooLong(f"{where} is {len(ids)} tokens; the limit is {limit} (REWARD_MAX_LENGTH)")
        return Encoded(ids[-limit:], True)

    def encode(self, texts: list[str]) -> list[Encoded]:
        return [self.fit(ids, f"item {i}") for i, ids in enumerate(self.tokenize(texts))]

    # -- batching -----------------------------------------------------------------------------------------------

    def plan(self, lengths: Sequence[int]) -> list[list[int]]:
        """Group row indices into micro-batches, longest first, each within the token budget as it will run: padded
        rows, or rows packed several to a padded row where that saves at least a fifth of the rows (`_Packer`)."""
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        batches: list[list[int]] = []
        current: list[int] = []
        packer: _Packer | None = None
        for i in order:
            if packer is not None and len(current) < self.settings.max_batch_rows:
                slot = packer.slot(lengths[i])
                bins = len(packer.rooms) + (slot == len(packer.rooms))
                if self.can_pack and bins <= PACK_WHEN * (len(current) + 1):
                    rows = bins
                else:
                    rows = len(current) + 1
                if rows * packer.width <= self.token_budget:
                    current.append(i)
                    packer.add(i, lengths[i], slot)
                    continue
            if current:
                batches.append(current)
            current, packer = [i], _Packer(self.width_for(lengths[i]))
            packer.add(i, lengths[i], 0)
        if current:
            batches.append(current)
        return batches

    def padded_length(self, n: int) -> int:
        m = self.settings.pad_multiple
        return max(m, math.ceil(n / m) * m)

    def width_for(self, longest: int) -> int:
        """The padded width of a micro-batch whose longest row has `longest` tokens."""
        return min(self.padded_length(longest), max(longest, self.settings.max_length))

    def score_ids(self, seqs: Sequence[Sequence[int]]) -> list[float]:
        """Scores in input order: every micro-batch is launched before the first result is read."""
        launched = [(rows, self.launch([seqs[i] for i in rows])) for rows in self.plan([len(s) for s in seqs])]
        scores = [0.0] * len(seqs)
        for rows, handle in launched:
            for i, v in zip(rows, handle.result(), strict=True):
                scores[i] = v
        return scores

    def launch(self, seqs: Sequence[Sequence[int]]) -> "Launched":
        """Start the forward of one micro-batch (split on CUDA out-of-memory) without waiting for it to finish."""
        torch = self.torch
        lengths = [len(s) for s in seqs]
        with torch.inference_mode():
            parts = self._forward_split(list(range(len(seqs))), seqs, lengths)
            scores = torch.cat([p for _, p in parts]).float()
        order = [i for rows, _ in parts for i in rows]
        if scores.device.type != "cuda":
            return Launched(order, scores, None)
        # Copy the scores to pinned host memory behind the forward; the event says when they are there.
        host = torch.empty(scores.shape, dtype=scores.dtype, pin_memory=True)
        host.copy_(scores, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(scores.device))
        return Launched(order, host, done)

    def _forward_split(self, rows: list[int], seqs, lengths) -> list[tuple[list[int], Any]]:
        torch = self.torch
        try:
            return [(rows, self._forward(rows, seqs, lengths))]
        except torch.cuda.OutOfMemoryError:
            if len(rows) == 1:
                raise InputTooLong(
                    f"a single sequence of {lengths[rows[0]]} tokens does not fit in GPU memory; lower REWARD_MAX_LENGTH"
                ) from None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            half = len(rows) // 2
            log.warning("CUDA out of memory on %d rows; retrying as %d + %d", len(rows), half, len(rows) - half)
            if self.on_oom:
                self.on_oom()
            return self._forward_split(rows[:half], seqs, lengths) + self._forward_split(rows[half:], seqs, lengths)

    def _forward(self, rows: list[int], seqs, lengths):
        torch = self.torch
        start = time.perf_counter()
        width = self.width_for(max(lengths[i] for i in rows))
        if self.can_pack and len(rows) > 1:
            packer = _Packer(width)
            for i in sorted(rows, key=lambda i: -lengths[i]):
                packer.add(i, lengths[i], packer.slot(lengths[i]))
            if len(packer.bins) <= PACK_WHEN * len(rows):
                scores = self._forward_packed(rows, packer.bins, seqs, lengths, width)
                if self.on_forward:
                    tokens = sum(lengths[i] for i in rows)
                    self.on_forward(len(packer.bins), width, tokens, time.perf_counter() - start)
                return scores
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long, pin_memory=self.pin)
        for r, i in enumerate(rows):
            ids[r, : lengths[i]] = torch.as_tensor(seqs[i], dtype=torch.long)
        last = torch.tensor([lengths[i] - 1 for i in rows], dtype=torch.long, pin_memory=self.pin)
        ids, last = ids.to(self.device, non_blocking=True), last.to(self.device, non_blocking=True)
        if self.base is not None and self.head is not None:
            # Padding is on the right and attention is causal: a real token never attends to a later (pad) position,
            # so no mask is needed. Attention then takes the fused causal kernel, and the score is read at each row's
            # last real token.
            # use_cache=False: no KV cache (GBs at a 32k-token budget), and no per-layer cache state for compile to
            # guard on (with it, every layer recompiles until torch gives up and runs eager).
            hidden = self._hidden(ids)
            scores = self.head(hidden[torch.arange(len(rows), device=hidden.device), last])[:, 0]
        else:
            mask = (torch.arange(width)[None, :] < torch.as_tensor([lengths[i] for i in rows])[:, None]).long()
            scores = self.model(input_ids=ids, attention_mask=mask.to(self.device), use_cache=False).logits[:, 0]
        if self.on_forward:
            self.on_forward(len(rows), width, sum(lengths[i] for i in rows), time.perf_counter() - start)
        return scores

    def _forward_packed(self, rows: list[int], bins: list[list[int]], seqs, lengths, width: int):
        """Several sequences to a row: each restarts its positions and attends only to itself (a block-diagonal causal
        mask), so it scores exactly as alone; the score is read at each sequence's own last token."""
        torch = self.torch
        ids = torch.full((len(bins), width), self.pad_id, dtype=torch.long, pin_memory=self.pin)
        positions = torch.zeros((len(bins), width), dtype=torch.long, pin_memory=self.pin)
        # The padding after the last sequence: segment -1.
        segment = torch.full((len(bins), width), -1, dtype=torch.long, pin_memory=self.pin)
        where: dict[int, tuple[int, int]] = {}
        for b, members in enumerate(bins):
            offset = 0
            for k, i in enumerate(members):
                n = lengths[i]
                ids[b, offset : offset + n] = torch.as_tensor(seqs[i], dtype=torch.long)
                positions[b, offset : offset + n] = torch.arange(n)
                segment[b, offset : offset + n] = k
                where[i] = (b, offset + n - 1)
                offset += n
        row_of = torch.tensor([where[i][0] for i in rows], dtype=torch.long, pin_memory=self.pin)
        last = torch.tensor([where[i][1] for i in rows], dtype=torch.long, pin_memory=self.pin)
        ids, positions, segment, row_of, last = (
            t.to(self.device, non_blocking=True) for t in (ids, positions, segment, row_of, last)
        )
        # True where query position q may attend to key position k: same sequence, k <= q. The padding is a block
        # of its own (no fully masked query row: those give NaN, which would spread).
        causal = torch.ones((width, width), dtype=torch.bool, device=ids.device).tril()
        mask = (segment[:, :, None] == segment[:, None, :]) & causal
        hidden = self._hidden(ids, mask[:, None], positions)
        return self.head(hidden[row_of, last])[:, 0]

    def _hidden(self, ids, mask=None, positions=None):
        """The base model's last hidden states. No mask means causal attention over right-padded rows.

        With `mask_mapping` the mask goes in as the per-layer mapping the model would build ({"full_attention":
        mask}), so transformers builds none: for a missing mask it would look for packed sequences on the GPU and
        wait for the answer (transformers 5.x) or build a full mask and lose the fused causal kernel (4.56)."""
        attention = {"full_attention": mask} if self.mask_mapping else mask
        out = self.base(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False)
        return out.last_hidden_state

    def compile_layers(self) -> bool:
        """torch.compile each decoder layer (dynamic shapes): fused kernels, far fewer launches. False if unavailable."""
        torch = self.torch
        layers = getattr(self.base, "layers", None)
        if layers is None or not hasattr(torch, "compile") or not hasattr(layers[0], "compile"):
            log.warning(
                "REWARD_COMPILE: this model or torch %s cannot compile per layer; serving eager", torch.__version__
            )
            return False
        for layer in layers:
            layer.compile(dynamic=True)
        self.compiled = True
        return True

    def uncompile_layers(self) -> None:
        for layer in getattr(self.base, "layers", []):
            layer._compiled_call_impl = None
        self.compiled = False

    def warm_up(self) -> None:
        """Run the shapes served traffic starts with (one row, several rows, two lengths), so /health means ready.
        With REWARD_COMPILE this compiles; a failure there falls back to eager with a warning, never to a crash."""
        base = self.encode([self.render([{"role": "user", "content": "warm up"}], "ready")])[0].ids
        ids = (base * (1 + 200 // len(base)))[: min(200, self.settings.max_length)]
        self._choose_mask_path([ids, ids[: len(ids) // 2]])
        # Padded: one row, two rows, three equal rows. Packed (two or more sequences to a row): one row, two rows.
        shapes = [[ids], [ids, ids[: len(ids) // 2]], [ids[:100]] * 3, [ids[:37]], [ids[:150], ids[:40]],
                  [ids[:200], ids[:50], ids[:37]]]  # fmt: skip
        try:
            for seqs in shapes:
                self.score_ids(seqs)
        except Exception as exc:
            if not self.compiled:
                raise
            log.warning("REWARD_COMPILE: compiling failed (%s: %s); serving eager", type(exc).__name__, exc)
            self.uncompile_layers()
            for seqs in shapes:
                self.score_ids(seqs)

    def _choose_mask_path(self, seqs: list[list[int]]) -> None:
        """Use the mask mapping where the model takes it and scores as it does building its own mask. Decided
        eager, so that a compile failure is not mistaken for the model's answer."""
        if not self.can_map_mask:
            return
        layers = list(getattr(self.base, "layers", []))
        compiled = [getattr(layer, "_compiled_call_impl", None) for layer in layers]
        for layer in layers:
            layer._compiled_call_impl = None
        try:
            expected = self.score_ids(seqs)
            self.mask_mapping = True
            try:
                got, why = self.score_ids(seqs), ""
            except Exception as exc:  # noqa: BLE001 - a model whose forward does not take the mapping
                got, why = None, f"{type(exc).__name__}: {exc}"
            tolerance = 1e-4 if self.dtype == "float32" else 5e-2
            if got is not None and any(
                abs(a - b) > tolerance * max(1.0, abs(b)) for a, b in zip(got, expected, strict=True)
            ):
                why = f"scores {got} differ from {expected}"
            if why:
                log.warning("the model does not take a per-layer mask mapping (%s); transformers builds masks", why)
                self.mask_mapping = False
        finally:
            for layer, call in zip(layers, compiled, strict=True):
                layer._compiled_call_impl = call


class Launched:
    """A micro-batch on its way through the GPU: `ready()` without blocking, `result()` scores in launch order."""

    def __init__(self, order: list[int], scores, event):
        self.order, self.scores, self.event = order, scores, event

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def result(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        values = self.scores.tolist()
        out = [0.0] * len(values)
        for i, v in zip(self.order, values, strict=True):
            out[i] = v
        return out


# --- cross-request batching ----------------------------------------------------------------------------------


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


class Batcher:
    """One thread owns the model. It keeps the GPU busy with micro-batches planned over every row waiting, and
    answers each request as soon as its own rows are scored.

    Up to `depth` micro-batches are queued on the GPU: while one runs, the thread reads the finished one's scores,
    answers those callers and launches the next from whatever is waiting, new arrivals included; the next goes in
    behind a running one once a full token budget waits or its oldest row has waited `max_wait`. Each launch takes
    the micro-batch (of the length-sorted plan) holding the oldest waiting row, so no request waits behind later
    ones. When idle, the first request waits up to `max_wait` for others to join (stopping once `quiet` passes with
    nothing new)."""

    def __init__(self, scorer: RewardScorer, max_wait_s: float, quiet_s: float = 0.002, on_batch=None, depth: int = 2):
        self.scorer = scorer
        self.max_wait_s = max_wait_s
        self.quiet_s = quiet_s
        self.depth = depth
        self.on_batch = on_batch  # metrics hook: (jobs, queue_waits)
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
        """Take what is queued; keep taking while requests still arrive (a burst of concurrent callers lands over a
        few ms), up to `max_wait` after the first, stopping early once `quiet` passes with nothing new or there is
        plenty of work for the GPU."""
        jobs = [first]
        tokens = sum(len(s) for s in first.seqs)
        deadline = time.perf_counter() + self.max_wait_s
        while tokens < 4 * self.scorer.token_budget:
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
        # While the oldest micro-batch runs, take new requests. The next one goes in behind it once a full token
        # budget waits or the oldest waiting row has waited `max_wait` (by then the requests that the last answers
        # set off have landed), so the GPU neither idles between micro-batches nor runs them in small pieces.
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
        if time.perf_counter() - waiting[0][0].enqueued >= self.max_wait_s:
            return True
        return sum(len(j.seqs[i]) for j, i in waiting) >= self.scorer.token_budget

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
        plan = self.scorer.plan([len(j.seqs[i]) for j, i in waiting])
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
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)


Conversation = tuple[list[dict[str, str]], str]  # (messages before the answer, the answer)


class Preparer:
    """Renders and tokenizes requests off the event loop, all that are waiting in one pass.

    While a pass runs in a worker thread, new requests queue; the next pass takes them together. One pass over many
    texts is one `tokenize` call, which runs on every core without the GIL; tokenizing each single-item request on
    the event loop held it ~1.5 ms per request, most of what 64 per-sample callers waited on. A conversation the chat
    template refuses fails its own request only."""

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
                    if future.done():  # the caller went away
                        continue
                    if isinstance(result, BaseException):
                        future.set_exception(result)
                    else:
                        future.set_result(result)
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


# --- HTTP ----------------------------------------------------------------------------------------------------


def create_app(settings: Settings, scorer: RewardScorer | None = None):
    """The FastAPI app. The model loads in the lifespan (or `scorer` is used as given, for tests)."""
    from fastapi import FastAPI, HTTPException, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
    from pydantic import BaseModel, ConfigDict, Field, StrictStr, model_validator
    from starlette.concurrency import run_in_threadpool

    registry = CollectorRegistry()
    m_requests = Counter(
        "reward_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=registry
    )
    m_samples = Counter("reward_samples", "pairs scored", registry=registry)
    m_tokens = Counter("reward_tokens", "real tokens scored", registry=registry)
    m_padded = Counter("reward_padded_tokens", "tokens including padding", registry=registry)
    m_truncated = Counter("reward_truncations", "pairs longer than max_length whose start was cut", registry=registry)
    m_errors = Counter("reward_errors", "errors by kind", ["kind"], registry=registry)
    m_batch = Histogram(
        "reward_batch_rows", "rows per forward", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=registry
    )
    m_wait = Histogram("reward_queue_wait_seconds", "time a request waited for the GPU thread", registry=registry)
    m_forward = Histogram("reward_forward_seconds", "time to launch one micro-batch forward", registry=registry)
    m_prepare = Histogram(
        "reward_prepare_seconds", "time of one render-and-tokenize pass (all requests waiting)", registry=registry
    )
    m_peak = Gauge("reward_gpu_memory_peak_bytes", "peak GPU memory reserved by this server", registry=registry)
    m_peak.set_function(lambda: _peak_gpu_bytes(state.get("scorer")))

    class Message(BaseModel):
        model_config = ConfigDict(extra="forbid")
        role: StrictStr = Field(min_length=1, max_length=64)
        content: StrictStr

    class ScoreItem(BaseModel):
        model_config = ConfigDict(extra="ignore")
        prompt: StrictStr | None = None
        messages: list[Message] | None = None
        response: StrictStr

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

    class ScoreBatchRequest(BaseModel):
        items: list[ScoreItem] = Field(min_length=1)

    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app):
        active = scorer or await run_in_threadpool(RewardScorer.load, settings)

        def on_forward(rows, width, tokens, seconds):
            m_batch.observe(rows)
            m_forward.observe(seconds)
            m_tokens.inc(tokens)
            m_padded.inc(rows * width)

        active.on_forward = on_forward
        active.on_oom = lambda: m_errors.labels("cuda_oom_split").inc()
        await run_in_threadpool(active.warm_up)
        batcher = Batcher(
            active,
            settings.max_wait_ms / 1000,
            settings.quiet_ms / 1000,
            on_batch=lambda jobs, waits: [m_wait.observe(w) for w in waits],
        )
        batcher.start()
        # One pass at a time, in a thread of its own (cheaper to reach than anyio's pool, ~0.1 ms a pass).
        prepare_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="reward-prepare")

        async def in_prepare_thread(fn, *args):
            return await asyncio.get_running_loop().run_in_executor(prepare_thread, fn, *args)

        preparer = Preparer(
            active, in_prepare_thread, on_pass=lambda requests, items, seconds: m_prepare.observe(seconds)
        )
        state.update(scorer=active, batcher=batcher, preparer=preparer)
        log.info(
            "ready: model=%s device=%s dtype=%s compiled=%s mask_mapping=%s max_length=%d truncation=%s format=%s "
            "token_budget=%d",
            settings.model_path, active.device, active.dtype, active.compiled, active.mask_mapping, settings.max_length,
            settings.truncation,
            "chat template" if active.chat_template else "plain text (the tokenizer has no chat template)",
            active.token_budget,
        )  # fmt: skip
        try:
            yield
        finally:
            batcher.stop()
            prepare_thread.shutdown(wait=False)
            state.clear()

    app = FastAPI(title="reward model server", lifespan=lifespan)
    app.add_middleware(
        _BodyLimit, limit=settings.max_body_bytes, on_reject=lambda: m_errors.labels("body_too_large").inc()
    )

    def fail(status: int, kind: str, detail: str, endpoint: str) -> HTTPException:
        m_errors.labels(kind).inc()
        m_requests.labels(endpoint, str(status)).inc()
        return HTTPException(status_code=status, detail=detail)

    def authorize(request: Request, endpoint: str) -> None:
        if not settings.auth_token:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {settings.auth_token}".encode()):
            raise fail(
                401, "unauthorized", "missing or wrong 'Authorization: Bearer <token>' (REWARD_SERVER_TOKEN)", endpoint
            )

    def check_limits(items: list[ScoreItem], endpoint: str) -> None:
        if len(items) > settings.max_items:
            raise fail(
                413,
                "too_many_items",
                f"{len(items)} items; the limit is {settings.max_items} (REWARD_MAX_ITEMS)",
                endpoint,
            )
        for i, item in enumerate(items):
            where = f"items[{i}]." if endpoint == "/score_batch" else ""
            texts = [("prompt", item.prompt or "")] + [
                (f"messages[{k}].content", m.content) for k, m in enumerate(item.messages or [])
            ]
            for name, text in [*texts, ("response", item.response)]:
                if len(text) > settings.max_chars:
                    raise fail(
                        413, "string_too_long",
                        f"{where}{name} is {len(text)} characters; the limit is {settings.max_chars} (REWARD_MAX_CHARS)",
                        endpoint,
                    )  # fmt: skip

    async def score_items(items: list[ScoreItem], endpoint: str) -> tuple[list[float], list[bool]]:
        if "batcher" not in state:
            raise fail(503, "not_ready", "the model is not loaded yet", endpoint)
        conversations = [
            ([m.model_dump() for m in it.messages] if it.messages else [{"role": "user", "content": it.prompt}],
             it.response)
            for it in items
        ]  # fmt: skip
        try:
            ids = await state["preparer"].ids(conversations)
            encoded = [state["scorer"].fit(x, f"item {i}") for i, x in enumerate(ids)]
            scores = await state["batcher"].score([e.ids for e in encoded])
        except ConversationRefused as exc:
            where = "messages" if endpoint == "/score" else "items[].messages"
            raise fail(422, "template_refused", f"{where}: {exc}", endpoint) from None
        except InputTooLong as exc:
            raise fail(413, "too_long", str(exc), endpoint) from None
        truncated = [e.truncated for e in encoded]
        m_samples.inc(len(items))
        m_truncated.inc(sum(truncated))
        m_requests.labels(endpoint, "200").inc()
        return scores, truncated

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        # Name each bad field and why, without echoing the (possibly huge) input back.
        problems = []
        for err in exc.errors()[:20]:
            if err.get("type") == "json_invalid":
                problems.append(f"body: not valid JSON ({err.get('ctx', {}).get('error', 'decode error')})")
                continue
            where = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
            problems.append(f"{where}: {err.get('msg', 'invalid')}")
        m_errors.labels("invalid_request").inc()
        m_requests.labels(request.url.path, "422").inc()
        return JSONResponse(status_code=422, content={"detail": problems})

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        m_errors.labels("internal").inc()
        m_requests.labels(request.url.path, "500").inc()
        return JSONResponse(
            status_code=500, content={"detail": f"internal error ({type(exc).__name__}); see the server log"}
        )

    @app.get("/health")
    async def health(request: Request):
        # Open to probes without a token; a token that is sent must be ours, so a job polling its own port with its
        # token gets 401 from another job's server instead of taking it for its own.
        if "authorization" in request.headers:
            authorize(request, "/health")
        if "scorer" not in state:
            return JSONResponse(status_code=503, content={"status": "loading"})
        active: RewardScorer = state["scorer"]
        return {
            "status": "ok",
            "model_path": settings.model_path,
            "device": active.device,
            "dtype": active.dtype,
            "max_length": settings.max_length,
            "truncation": settings.truncation,
            "format": "chat_template" if active.chat_template else "plain_text",
            "compiled": active.compiled,
            "mask_mapping": active.mask_mapping,
            "auth": bool(settings.auth_token),
        }

    @app.post("/score")
    async def score(item: ScoreItem, request: Request):
        authorize(request, "/score")
        check_limits([item], "/score")
        scores, truncated = await score_items([item], "/score")
        return {"score": scores[0], "truncated": truncated[0]}

    @app.post("/score_batch")
    async def score_batch(body: ScoreBatchRequest, request: Request):
        authorize(request, "/score_batch")
        check_limits(body.items, "/score_batch")
        scores, truncated = await score_items(body.items, "/score_batch")
        return {"scores": scores, "truncated": truncated}

    @app.get("/metrics")
    async def metrics(request: Request):
        authorize(request, "/metrics")
        return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def _peak_gpu_bytes(scorer) -> float:
    if scorer is None or not scorer.device.startswith("cuda"):
        return 0.0
    return float(scorer.torch.cuda.max_memory_reserved(scorer.device))


class _BodyLimit:
    """Pure ASGI middleware: 413 for a body over `limit` bytes, by Content-Length or while it streams in."""

    def __init__(self, app, limit: int, on_reject=None):
        self.app, self.limit, self.on_reject = app, limit, on_reject

    def _error(self):
        from starlette.exceptions import HTTPException

        if self.on_reject:
            self.on_reject()
        return HTTPException(413, detail=f"request body over {self.limit} bytes (REWARD_MAX_BODY_BYTES)")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            from starlette.responses import JSONResponse

            error = self._error()
            return await JSONResponse({"detail": error.detail}, status_code=413)(scope, receive, send)
        received = 0

        async def limited_receive():
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    # An HTTPException passes through FastAPI's body parsing and becomes this 413.
                    raise self._error()
            return message

        await self.app(scope, limited_receive, send)


def main(argv: Sequence[str] | None = None) -> int:
    settings = load_settings(argv)
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    problem = check_model_path(settings.model_path)
    if problem:
        log.error("%s", problem)
        return 2
    # Many batch shapes come and go: expandable segments keep the allocator from fragmenting (set before torch loads).
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    shown = {k: ("(set)" if k == "auth_token" and v else v) for k, v in asdict(settings).items()}
    log.info("starting with %s", shown)
    import uvicorn

    # uvicorn takes uvloop and httptools (C parsers, less CPU per request) when they are installed.
    log.info(
        "HTTP: uvicorn %s, event loop %s, parser %s", uvicorn.__version__,
        "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "httptools" if importlib.util.find_spec("httptools") else "h11 (pure Python; pip install httptools)",
    )  # fmt: skip
    # uvicorn runs the lifespan (model load + warm-up) before it binds the port: until then, connections are refused.
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level, access_log=False
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
