"""The model: load it, format and tokenize pairs, and run the micro-batches the planner lays out (padded rows, or
several sequences packed to a row), warm-up, per-layer compile and the choice of mask path. Any thread may call it;
the batcher (batcher.py) owns when. torch and transformers are imported only when a model loads, so `--help` and the
settings checks run without them."""

import contextlib
import logging
import random
import sys
import threading
import time
import types
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from reward_score.server.planner import (
    Planner,
    activation_bytes_per_token,
    model_micro_batch_cost,
    model_packs,
    model_token_budget,
)
from reward_score.server.settings import Settings

log = logging.getLogger("reward_server")


def _transformers_at_least(major: int, minor: int) -> bool:
    import transformers

    return tuple(int(p) for p in transformers.__version__.split(".")[:2]) >= (major, minor)


class InputTooLong(ValueError):
    """An item is longer than max_length under REWARD_TRUNCATION=reject, or cannot fit in memory alone."""


class ConversationRefused(ValueError):
    """The chat template raised on these messages (e.g. Qwen3's "No user query found in messages.")."""


@dataclass
class Encoded:
    ids: list[int]
    truncated: bool


@dataclass(frozen=True)
class InputFormat:
    """How a (messages, response) pair becomes token ids: one of the ways TRL's RewardTrainer built a training
    sequence from a preference dataset (a model scores best in the way it was trained).

    TRL >= 0.24 (reward_trainer.py `_prepare_dataset`): prompt + completion through `apply_chat_template(...,
    tokenize=True)`, which adds no special tokens; a plain-text dataset as `tokenizer(prompt + completion + eos)`.
    TRL <= 0.23 (`maybe_apply_chat_template`, then `_tokenize`: `tokenizer(chosen)`): with a `prompt` column only the
    completion, rendered as the text the chat template adds after the prompt's generation prompt, and always with the
    tokenizer's special tokens; plain text as it is, no EOS added."""

    input: str  # "conversation": prompt + response; "completion": the response alone
    chat_template: bool  # through the tokenizer's chat template; False: TRL's plain-text rule
    add_special_tokens: bool
    append_eos: bool  # plain text only

    @classmethod
    def from_settings(cls, settings: Settings, has_chat_template: bool) -> "InputFormat":
        """The `auto` values resolved: for each input, what the TRL versions that produce it did."""
        template = has_chat_template and settings.chat_template == "auto"
        if settings.add_special_tokens == "auto":
            # Only TRL >= 0.24's apply_chat_template(tokenize=True) tokenized without them; every tokenizer(text) adds.
            special = not (template and settings.input == "conversation")
        else:
            special = settings.add_special_tokens == "true"
        if settings.append_eos == "auto":
            eos = settings.input == "conversation"
        else:
            eos = settings.append_eos == "true"
        return cls(settings.input, template, special, eos and not template)

    def describe(self) -> str:
        how = "chat template" if self.chat_template else "plain text" + (" + EOS" if self.append_eos else "")
        special = "with" if self.add_special_tokens else "without"
        return f"{self.input} ({how}, {special} special tokens)"


# Layers whose forward we know (transformers 4.55 to 5.x): q/k/v and gate/up can each run as one matmul.
_FUSABLE_ATTENTION = ("Qwen3Attention", "Qwen2Attention", "LlamaAttention")
_FUSABLE_MLP = ("Qwen3MLP", "Qwen2MLP", "LlamaMLP")


def _fused_linear(torch, parts):
    """One Linear whose output is the parts' outputs side by side; each part's weight (and bias) becomes a view into
    it, so the model holds no second copy and the unfused forward still reads the same numbers."""
    weight = torch.cat([p.weight.detach() for p in parts])
    has_bias = parts[0].bias is not None
    bias = torch.cat([p.bias.detach() for p in parts]) if has_bias else None
    fused = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device="meta")
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = torch.nn.Parameter(bias, requires_grad=False)
    start = 0
    for part in parts:
        n = part.weight.shape[0]
        part.weight = torch.nn.Parameter(weight[start : start + n], requires_grad=False)
        if has_bias:
            part.bias = torch.nn.Parameter(bias[start : start + n], requires_grad=False)
        start += n
    return fused, [p.weight.shape[0] for p in parts]


def _fused_attention_forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
    """The attention of Qwen3/Qwen2/Llama as transformers writes it, with q, k and v from one matmul. A KV cache (never
    used by the server) takes the original forward."""
    if kwargs.get("past_key_values") is not None or kwargs.get("past_key_value") is not None:
        return type(self).forward(self, hidden_states, position_embeddings, attention_mask, **kwargs)
    for name in ("past_key_values", "past_key_value", "cache_position"):
        kwargs.pop(name, None)
    module = sys.modules[type(self).__module__]
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q, k, v = self.qkv_proj(hidden_states).split(self.qkv_sizes, dim=-1)
    q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
    if hasattr(self, "q_norm"):  # Qwen3 normalises each head of q and k
        q, k = self.q_norm(q), self.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    cos, sin = position_embeddings
    q, k = module.apply_rotary_pos_emb(q, k, cos, sin)
    implementation = self.config._attn_implementation
    if implementation == "eager":
        attention = module.eager_attention_forward
    else:
        attention = module.ALL_ATTENTION_FUNCTIONS[implementation]
    if getattr(self, "sliding_window", None) is not None:
        kwargs["sliding_window"] = self.sliding_window
    out, weights = attention(
        self, q, k, v, attention_mask, dropout=0.0, scaling=self.scaling, **kwargs
    )  # fmt: skip
    out = out.reshape(*input_shape, -1).contiguous()
    return self.o_proj(out), weights


def _fused_mlp_forward(self, x):
    gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
    return self.down_proj(self.act_fn(gate) * up)


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
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # The model's own forward reads its score at the last token that is not config.pad_token_id (transformers'
        # sequence classification, which is what TRL trained): trailing ones are dropped before scoring (`fit`).
        self.read_pad_id = getattr(model.config, "pad_token_id", None)
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        self.format = InputFormat.from_settings(settings, self.has_chat_template)
        # The fast path reads the score at each row's last real token itself: no reliance on pad_token_id detection
        # (a response may contain the pad token's text), and the head runs on B rows instead of B x L.
        self.base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        self.head = getattr(model, "score", None)
        # Packing needs the fast path and an attention that takes a boolean 4D mask as given (sdpa); with
        # REWARD_PACK=auto only models small enough for it to pay (planner.PACK_UP_TO_PARAMS).
        attention = getattr(model.config, "_attn_implementation", None)
        self.non_embedding_params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
        self.can_pack = (self.base is not None and self.head is not None and attention == "sdpa"
                         and settings.pack == "auto" and model_packs(self.non_embedding_params))  # fmt: skip
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.model_budget = None
        if device.startswith("cuda") and not settings.token_budget and self.activation_bytes_per_token():
            # planner.MemoryTooSmall (a ValueError) when REWARD_GPU_MEMORY_GIB leaves no room: the server exits naming it
            self.model_budget = model_token_budget(
                self.activation_bytes_per_token(), self.weight_bytes, int(settings.gpu_memory_gib * 2**30)
            )
        # A bigger model's token takes longer, so one more forward costs fewer of its tokens: narrower micro-batches
        # with less padding pay (on the CPU the cost stays MICRO_BATCH_COST).
        model_cost = model_micro_batch_cost(self.non_embedding_params) if device.startswith("cuda") else None
        self.planner = Planner.for_settings(
            settings, device, pack=self.can_pack, model_budget=self.model_budget, model_cost=model_cost
        )
        # Hand the model its per-layer mask mapping ourselves (warm_up checks the model takes it and scores the same)?
        layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
        self.can_map_mask = (self.base is not None and self.head is not None and layer_types == {"full_attention"}
                             and bool(getattr(self.base, "layers", None)))  # fmt: skip
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
        self.on_packed = None  # metrics hook: a micro-batch ran packed (several sequences to a row)
        self.compiled = False
        self.fused: list = []  # the attention and MLP modules running fused projections
        self.warm_up_s: dict[str, float] = {}

    def activation_bytes_per_token(self) -> int | None:
        """planner.activation_bytes_per_token for this model's dimensions and dtype (None where the config does not
        name them: the budget then stays at its default)."""
        c = self.model.config
        if not all(hasattr(c, n) for n in ("hidden_size", "intermediate_size", "num_attention_heads")):
            return None
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        dtype_bytes = next(self.model.parameters()).element_size()
        return activation_bytes_per_token(
            c.hidden_size, c.intermediate_size, heads * head_dim, kv_heads * head_dim, dtype_bytes
        )

    @classmethod
    def load(cls, settings: Settings) -> "RewardScorer":
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        device = settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"--device {device} (REWARD_DEVICE) but torch sees no CUDA device; use cpu or auto")
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        tokenizer = AutoTokenizer.from_pretrained(settings.model_path)
        # transformers < 4.56 (the vLLM base image holds 4.55.4) names the argument torch_dtype
        dtype_arg = "dtype" if _transformers_at_least(4, 56) else "torch_dtype"
        model = AutoModelForSequenceClassification.from_pretrained(
            settings.model_path, **{dtype_arg: dtype}, num_labels=1, attn_implementation="sdpa"
        )
        if model.config.pad_token_id is None:
            model.config.pad_token_id = (
                tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            )
        model.to(device).eval()
        if device.startswith("cuda") and settings.cudnn_attention == "off":
            # torch 2.11 takes cuDNN's attention on an H200 for both of our calls, and cuDNN builds a plan for every
            # new shape; flash and mem-efficient attention build none. A/B on an H200 (1.7B, benchmarks/README.md):
            # the same throughput either way, so torch's choice stays the default.
            torch.backends.cuda.enable_cudnn_sdp(False)
        if device.startswith("cuda") and settings.gpu_memory_gib:
            # The caching allocator stays under the cap; a micro-batch that would cross it is split (as on any OOM).
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, settings.gpu_memory_gib * 2**30 / total), device)
        scorer = cls(model, tokenizer, device, settings)
        if settings.fuse == "auto":
            scorer.fuse_projections()
        if settings.compile == "layers" or (settings.compile == "auto" and device.startswith("cuda")):
            scorer.compile_layers()
        return scorer

    def fuse_projections(self) -> int:
        """q/k/v as one projection and gate/up as one in every layer we know the forward of (the layout serving
        engines use): one larger matmul instead of three and two. Built from the loaded weights, whose tensors become
        views into the fused ones (no extra memory). warm_up checks the scores are unchanged. Returns the modules
        fused."""
        torch = self.torch
        for layer in getattr(self.base, "layers", None) or []:
            attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
            if type(attention).__name__ in _FUSABLE_ATTENTION and not hasattr(attention, "qkv_proj"):
                module = sys.modules[type(attention).__module__]
                if all(hasattr(module, n) for n in ("apply_rotary_pos_emb", "eager_attention_forward",
                                                    "ALL_ATTENTION_FUNCTIONS")):  # fmt: skip
                    with torch.no_grad():
                        attention.qkv_proj, attention.qkv_sizes = _fused_linear(
                            torch, [attention.q_proj, attention.k_proj, attention.v_proj]
                        )
                    attention.forward = types.MethodType(_fused_attention_forward, attention)
                    self.fused.append(attention)
            if type(mlp).__name__ in _FUSABLE_MLP and not hasattr(mlp, "gate_up_proj"):
                with torch.no_grad():
                    mlp.gate_up_proj, _ = _fused_linear(torch, [mlp.gate_proj, mlp.up_proj])
                mlp.forward = types.MethodType(_fused_mlp_forward, mlp)
                self.fused.append(mlp)
        if not self.fused:
            log.info("REWARD_FUSE: no layer of this model (%s) is one we fuse; separate projections",
                     type(self.model).__name__)  # fmt: skip
        return len(self.fused)

    def _set_fused(self, on: bool) -> None:
        """Run the fused forwards (on) or transformers' own over the same weights (off)."""
        for module in self.fused:
            if on:
                fused = _fused_attention_forward if hasattr(module, "qkv_proj") else _fused_mlp_forward
                module.forward = types.MethodType(fused, module)
            else:
                module.__dict__.pop("forward", None)

    def unfuse_projections(self) -> None:
        self._set_fused(False)
        for module in self.fused:
            for name in ("qkv_proj", "gate_up_proj"):
                if hasattr(module, name):
                    delattr(module, name)
        self.fused = []

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    # -- formatting ---------------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> bool:
        """Pairs are rendered through the tokenizer's chat template (else TRL's plain-text rule)."""
        return self.format.chat_template

    def render(self, messages: list[dict[str, str]], response: str, fmt: InputFormat | None = None) -> str:
        """The exact text the reward model was trained on for this conversation, in `fmt` (default: the server's)."""
        fmt = fmt or self.format
        if fmt.chat_template:
            try:
                return self._render_template(messages, response, fmt.input == "completion")
            except self._template_error as exc:  # the template's own raise_exception(...): a wrong conversation
                raise ConversationRefused(f"the reward model's chat template refused these messages: {exc}") from None
        # TRL's plain-text rule: prompt then completion (>= 0.24) or the completion alone (<= 0.23 with a prompt
        # column), EOS appended where TRL appended it.
        eos = self.tokenizer.eos_token or ""
        text = response if fmt.input == "completion" else "\n".join(m["content"] for m in messages) + response
        return text + eos if fmt.append_eos and not text.endswith(eos) else text

    def _render_template(self, messages: list[dict[str, str]], response: str, completion: bool) -> str:
        apply = self.tokenizer.apply_chat_template
        full = apply(
            [*messages, {"role": "assistant", "content": response}], tokenize=False, add_generation_prompt=False
        )
        if not completion:
            return full
        # TRL <= 0.23's apply_chat_template (data_utils.py): the prompt with its generation prompt (or its last
        # assistant message continued), then the completion is what the whole conversation adds after the longest
        # common prefix of the two (Qwen3: "<think>\n\n</think>\n\n" + response + "<|im_end|>\n").
        last = messages[-1]["role"] if messages else None
        if last not in ("user", "assistant"):
            raise ConversationRefused(
                f"REWARD_INPUT=completion needs the prompt's last message from the user or the assistant, as TRL did "
                f"(it raised 'Invalid role in the last message'); got {last!r}"
            )
        prompt = apply(messages, tokenize=False, add_generation_prompt=last == "user",
                       continue_final_message=last == "assistant")  # fmt: skip
        common = 0
        for a, b in zip(prompt, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]

    def tokenize(self, texts: list[str], fmt: InputFormat | None = None) -> list[list[int]]:
        """Token ids of each text, with or without the tokenizer's special tokens as `fmt` says; any thread. The
        Rust tokenizer encodes a list on every core without holding the GIL; `encode_batch_fast` (tokenizers >= 0.21)
        also skips the character offsets nobody reads here. Both are what `tokenizer(text)` calls."""
        special = (fmt or self.format).add_special_tokens
        if self.backend is not None:
            encode = getattr(self.backend, "encode_batch_fast", None) or self.backend.encode_batch
            return [e.ids for e in encode(texts, add_special_tokens=special)]
        with self._slow_lock:
            return self.tokenizer(texts, add_special_tokens=special)["input_ids"]

    def fit(self, ids: list[int], where: str) -> Encoded:
        """`ids` as scored: without trailing pad tokens (the model's forward would read its score before them, and a
        causal model's score there does not depend on them), within max_length: over-long input keeps its last
        tokens, or is refused under REWARD_TRUNCATION=reject."""
        end = len(ids)
        while end > 1 and ids[end - 1] == self.read_pad_id:
            end -= 1
        ids = ids[:end] if end < len(ids) else ids
        limit = self.settings.max_length
        if len(ids) <= limit:
            return Encoded(ids, False)
        if self.settings.truncation == "reject":
            raise InputTooLong(f"{where} is {len(ids)} tokens; the limit is {limit} (REWARD_MAX_LENGTH)")
        return Encoded(ids[-limit:], True)

    def encode(self, texts: list[str]) -> list[Encoded]:
        return [self.fit(ids, f"item {i}") for i, ids in enumerate(self.tokenize(texts))]

    def score_ids(self, seqs: Sequence[Sequence[int]]) -> list[float]:
        """Scores in input order: every micro-batch is launched before the first result is read."""
        plan = self.planner.plan([len(s) for s in seqs])
        launched = [(rows, self.launch([seqs[i] for i in rows])) for rows in plan]
        scores = [0.0] * len(seqs)
        for rows, handle in launched:
            for i, v in zip(rows, handle.result(), strict=True):
                scores[i] = v
        return scores

    def launch(self, seqs: Sequence[Sequence[int]]) -> "Launched":
        """Start the forward of one micro-batch (split on CUDA out-of-memory) without waiting for it to finish."""
        torch = self.torch
        lengths = [len(s) for s in seqs]
        started = None
        if str(self.device).startswith("cuda"):
            # Timed on the GPU: started runs when the GPU reaches this micro-batch (after the one queued before it).
            started = torch.cuda.Event(enable_timing=True)
            started.record(torch.cuda.current_stream(self.device))
        with torch.inference_mode():
            parts = self._forward_split(list(range(len(seqs))), seqs, lengths)
            scores = torch.cat([p for _, p in parts]).float()
        order = [i for rows, _ in parts for i in rows]
        if scores.device.type != "cuda":
            return Launched(order, scores, None)
        # Copy the scores to pinned host memory behind the forward; the event says when they are there.
        host = torch.empty(scores.shape, dtype=scores.dtype, pin_memory=True)
        host.copy_(scores, non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)
        done.record(torch.cuda.current_stream(scores.device))
        layout = self.planner.layout(lengths)
        tokens = layout.width * (len(layout.bins) if layout.bins is not None else len(lengths))
        return Launched(order, host, done, started, tokens)

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
        layout = self.planner.layout([lengths[i] for i in rows])
        width = layout.width
        if layout.bins is not None:
            bins = [[rows[k] for k in members] for members in layout.bins]
            scores = self._forward_packed(rows, bins, seqs, lengths, width)
            if self.on_packed:
                self.on_packed()
            if self.on_forward:
                self.on_forward(len(bins), width, sum(lengths[i] for i in rows), time.perf_counter() - start)
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
        """Run the shapes served traffic starts with (one row, several rows, two lengths), so /health means ready;
        with REWARD_WARMUP=step (auto on a GPU) also a synthetic step at the full token budget (`_warm_up_step`). With
        REWARD_COMPILE this compiles; a failure there falls back to eager with a warning, never to a crash. The time of
        each part is in `warm_up_s`."""
        started = time.perf_counter()
        base = self.encode([self.render([{"role": "user", "content": "warm up"}], "ready")])[0].ids
        ids = (base * (1 + 200 // len(base)))[: min(200, self.settings.max_length)]
        self._check_fusion([ids, ids[: len(ids) // 2], ids[:37]])
        self._choose_mask_path([ids, ids[: len(ids) // 2]])
        self.warm_up_s["checks"] = time.perf_counter() - started
        # Padded: one row, two rows, three equal rows. Packed (two or more sequences to a row): one row, two rows.
        shapes = [[ids], [ids, ids[: len(ids) // 2]], [ids[:100]] * 3, [ids[:37]], [ids[:150], ids[:40]],
                  [ids[:200], ids[:50], ids[:37]]]  # fmt: skip
        started = time.perf_counter()
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
        self.warm_up_s["shapes"] = time.perf_counter() - started
        step = self.settings.warmup == "step" or (self.settings.warmup == "auto" and self.device.startswith("cuda"))
        if step:
            started = time.perf_counter()
            self._warm_up_step(base)
            self.warm_up_s["step"] = time.perf_counter() - started

    def warm_up_lengths(self) -> list[list[int]]:
        """The synthetic step of `_warm_up_step`: sequence lengths (fixed seed) over 16..max_length, 3 token budgets
        in all, as one request; then 8 groups of 8 mixed lengths, as per-sample callers send them."""
        rng = random.Random(0)
        limit = max(16, self.settings.max_length)
        step: list[int] = []
        while sum(step) < 3 * self.planner.token_budget:
            step.append(rng.randint(16, limit))
        groups = [[rng.randint(16, min(limit, 2048)) for _ in range(8)] for _ in range(8)]
        return [step, *groups]

    def _warm_up_step(self, base: list[int]) -> None:
        """What the first real step would otherwise meet first: micro-batches at the full token budget, padded and
        packed, over many widths (the allocator grows to its peak; kernels meet large sizes), so that step runs at
        the speed of the next."""
        long = base * (1 + self.settings.max_length // len(base))
        for lengths in self.warm_up_lengths():
            self.score_ids([long[:n] for n in lengths])
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _eager_layers(self):
        """The decoder layers' own (uncompiled) forward while a path is checked, so that a compile failure is not
        mistaken for the path's."""
        layers = list(getattr(self.base, "layers", []))
        compiled = [getattr(layer, "_compiled_call_impl", None) for layer in layers]
        for layer in layers:
            layer._compiled_call_impl = None
        try:
            yield
        finally:
            for layer, call in zip(layers, compiled, strict=True):
                layer._compiled_call_impl = call

    def _first_layer_outputs(self, seqs: list[list[int]]) -> list:
        """Score `seqs` the way the model is set now; the first decoder layer's output of each micro-batch is where
        two ways of running the model are compared. A deep model's rounding in bf16 moves a score by more than any
        tolerance that would still catch a wrong path (a random Qwen3-14B on an H200: 0.08 on a score of 0.5 between
        two right mask paths, so the check refused the faster one), while a wrong path shows at the first layer."""
        outputs: list = []

        def record(module, args, out):
            outputs.append((out[0] if isinstance(out, tuple) else out).detach().float().cpu())

        hook = self.base.layers[0].register_forward_hook(record)
        try:
            self.score_ids(seqs)
        finally:
            hook.remove()
        return outputs

    def _differs(self, seqs: list[list[int]], expected: list) -> str:
        """Why running `seqs` the way the model is set now does not give `expected` (`_first_layer_outputs` of the
        model's own way): it raised, or the output is off by more than the dtype's rounding. Empty when it agrees."""
        try:
            got = self._first_layer_outputs(seqs)
        except Exception as exc:  # noqa: BLE001 - a forward the model does not take: the caller falls back
            return f"{type(exc).__name__}: {exc}"
        if len(got) != len(expected):
            return f"{len(got)} micro-batches instead of {len(expected)}"
        tolerance = 1e-4 if self.dtype == "float32" else 2e-2
        for a, b in zip(got, expected, strict=True):
            if a.shape != b.shape:
                return f"the first decoder layer's output has the shape {tuple(a.shape)}, not {tuple(b.shape)}"
            drift = ((a - b).norm() / b.norm().clamp(min=1e-12)).item()
            if drift > tolerance:
                return f"the first decoder layer's output is {drift:.2%} off (rounding in {self.dtype}: <= {tolerance:.2%})"
        return ""

    def _check_fusion(self, seqs: list[list[int]]) -> None:
        """Keep the fused projections only where they score as the model's own forward does."""
        if not self.fused:
            return
        with self._eager_layers():
            self._set_fused(False)
            expected = self._first_layer_outputs(seqs)
            self._set_fused(True)
            why = self._differs(seqs, expected)
            if why:
                log.warning("REWARD_FUSE: the fused projections do not score as the model does (%s); serving "
                            "separate projections", why)  # fmt: skip
                self.unfuse_projections()

    def _choose_mask_path(self, seqs: list[list[int]]) -> None:
        """Use the mask mapping where the model takes it and scores as it does building its own mask."""
        if not self.can_map_mask:
            return
        with self._eager_layers():
            expected = self._first_layer_outputs(seqs)
            self.mask_mapping = True
            why = self._differs(seqs, expected)
            if why:
                log.warning("the model does not take a per-layer mask mapping (%s); transformers builds masks", why)
                self.mask_mapping = False


class Launched:
    """A micro-batch on its way through the GPU: `ready()` without blocking, `result()` scores in launch order,
    `gpu_seconds()` how long the GPU took once it is done (None where not timed), `tokens` as run (with padding)."""

    def __init__(self, order: list[int], scores, event, started=None, tokens: int = 0):
        self.order, self.scores, self.event = order, scores, event
        self.started, self.tokens = started, tokens

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def gpu_seconds(self) -> float | None:
        if self.started is None or self.event is None or not self.event.query():
            return None
        return self.started.elapsed_time(self.event) / 1000

    def result(self) -> list[float]:
        if self.event is not None:
            self.event.synchronize()
        values = self.scores.tolist()
        out = [0.0] * len(values)
        for i, v in zip(self.order, values, strict=True):
            out[i] = v
        return out
