"""The model: load it and run the micro-batches the planner lays out, padded or packed, each decoder layer compiled.
torch and transformers are imported only when a model loads, so `--help` and the settings checks run without them."""

import contextlib
import logging
import time
from collections.abc import Sequence
from typing import Any

from reward_score.server.inputs import InputTooLong, PairEncoder
from reward_score.server.planner import (
    Planner,
    activation_bytes_per_token,
    model_micro_batch_cost,
    model_packs,
    model_token_budget,
)
from reward_score.server.settings import Settings

log = logging.getLogger("reward_server")


class NotARewardModel(RuntimeError):
    """The checkpoint holds no scoring head: transformers would score with a randomly initialized one."""


def head_problem(path: str) -> str | None:
    """What the model's config.json says against it as a reward model (architecture, num_labels), or None."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)  # num_labels: transformers' count (config.json omits it for 2 labels)
    where = f"the reward model {path} (CONFIG_REWARD_MODEL_PATH, --model-path) has in its config.json"
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith("ForSequenceClassification") for a in archs):
        return (
            f"{where} architectures={archs}: a reward model is a *ForSequenceClassification checkpoint with a "
            "one-output score head (as TRL's RewardTrainer saves it), not a causal LM or policy: point "
            "CONFIG_REWARD_MODEL_PATH at one"
        )
    if config.num_labels != 1:
        return (
            f"{where} num_labels={config.num_labels} (a classifier's head): a reward model scores with one output; "
            "save it with num_labels=1 and a one-row score head (for two labels, score.weight[1] - "
            "score.weight[0] scores their margin), or point CONFIG_REWARD_MODEL_PATH at a reward model"
        )
    return None


def refuse_without_head(path: str, model, missing_keys: Sequence[str]) -> None:
    """NotARewardModel where weights outside the base model (`score.weight`, ...) were missing from the checkpoint."""
    prefix = getattr(model, "base_model_prefix", "") + "."
    if head := sorted(k for k in missing_keys if not k.startswith(prefix)):
        saved_as = ", ".join(getattr(model.config, "architectures", None) or []) or "a model without a scoring head"
        raise NotARewardModel(
            f"the reward model path {path} (CONFIG_REWARD_MODEL_PATH, --model-path) is not a reward model: it holds "
            f"{saved_as}, without the scoring head {head} (transformers would initialize it at random, and every "
            "score would be noise). A reward model is a sequence-classification checkpoint with its score head and "
            "num_labels=1 (e.g. *ForSequenceClassification as TRL's RewardTrainer saves it), not a causal LM or policy"
        )


class LayerKernels:
    """torch.compile of each decoder layer (`base.layers`), on or off; warmup.py checks it before it serves."""

    def __init__(self, base):
        self.layers = list(getattr(base, "layers", None) or [])
        self.compiled = False

    def compile(self) -> None:
        if not self.layers:
            log.warning("REWARD_COMPILE: this model has no decoder layers to compile (base.layers); serving eager")
            return
        for layer in self.layers:
            layer.compile(dynamic=True)
        self.compiled = True

    def uncompile(self) -> None:
        for layer in self.layers:
            layer._compiled_call_impl = None
        self.compiled = False

    @contextlib.contextmanager
    def eager(self):
        """The layers uncompiled while a path is checked, so that a compile failure is not taken for the path's."""
        compiled = [getattr(layer, "_compiled_call_impl", None) for layer in self.layers]
        for layer in self.layers:
            layer._compiled_call_impl = None
        try:
            yield
        finally:
            for layer, call in zip(self.layers, compiled, strict=True):
                layer._compiled_call_impl = call


class RewardScorer(PairEncoder):
    """The model and its tokenizer (the formatting rule is PairEncoder's); `score_ids` from any thread."""

    def __init__(self, model, tokenizer, device: str, settings: Settings):
        import torch

        super().__init__(tokenizer, settings, getattr(model.config, "pad_token_id", None))
        self.torch = torch
        self.model = model
        self.device = device
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        # The fast path reads the score at each row's last real token itself: the head runs on B rows, not B x L.
        self.base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        self.head = getattr(model, "score", None)
        self.fast = self.base is not None and self.head is not None
        # Packing needs the fast path and an attention that takes a boolean 4D mask as given (sdpa).
        attention = getattr(model.config, "_attn_implementation", None)
        self.non_embedding_params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
        packs = settings.pack == "auto" and model_packs(self.non_embedding_params)
        self.can_pack = self.fast and attention == "sdpa" and packs
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        self.model_budget = None
        if device.startswith("cuda") and (per_token := self.activation_bytes_per_token()):
            # planner.MemoryTooSmall when REWARD_GPU_MEMORY_GIB leaves no room: the server exits naming it.
            self.model_budget = model_token_budget(per_token, self.weight_bytes, int(settings.gpu_memory_gib * 2**30))
        model_cost = model_micro_batch_cost(self.non_embedding_params) if device.startswith("cuda") else None
        self.planner = Planner.for_settings(
            settings, device, pack=self.can_pack, model_budget=self.model_budget, model_cost=model_cost
        )
        # Hand the model its per-layer mask mapping ourselves (`_hidden`; warm-up checks it)?
        layer_types = set(getattr(model.config, "layer_types", None) or ["full_attention"])
        self.can_map_mask = self.fast and layer_types == {"full_attention"} and bool(getattr(self.base, "layers", None))
        self.mask_mapping = False
        # Pinned inputs: a copy from pageable memory would wait for the micro-batch running on the GPU.
        self.pin = device.startswith("cuda")
        self.on_forward = None  # metrics hook: (rows, padded_len, real_tokens, seconds)
        self.on_oom = None  # metrics hook: a micro-batch was split after a CUDA out-of-memory error
        self.on_packed = None  # metrics hook: a micro-batch ran packed (several sequences to a row)
        self.kernels = LayerKernels(self.base)
        self.warm_up_s: dict[str, float] = {}  # warmup.warm_up: seconds of each part
        self.checks: dict[str, float] = {}  # warm-up's checks: each way's largest relative difference at layer one

    def activation_bytes_per_token(self) -> int | None:
        """planner.activation_bytes_per_token for this model (None where the config does not name its dimensions)."""
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
        import transformers
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        device = settings.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RuntimeError(f"--device {device} (REWARD_DEVICE) but torch sees no CUDA device; use cpu or auto")
        if problem := head_problem(settings.model_path):
            raise NotARewardModel(problem)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        tokenizer = AutoTokenizer.from_pretrained(settings.model_path)
        # transformers < 4.56 (the vLLM base image holds 4.55.4) names the argument torch_dtype
        dtype_arg = "dtype" if tuple(map(int, transformers.__version__.split(".")[:2])) >= (4, 56) else "torch_dtype"
        model, loading = AutoModelForSequenceClassification.from_pretrained(
            settings.model_path,
            **{dtype_arg: dtype},
            num_labels=1,
            attn_implementation="sdpa",
            output_loading_info=True,
        )
        refuse_without_head(settings.model_path, model, loading["missing_keys"])
        if model.config.pad_token_id is None:
            model.config.pad_token_id = (
                tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            )
        model.to(device).eval()
        if device.startswith("cuda") and settings.gpu_memory_gib:
            # The caching allocator stays under the cap; a micro-batch that would cross it is split (as on any OOM).
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, settings.gpu_memory_gib * 2**30 / total), device)
        scorer = cls(model, tokenizer, device, settings)
        if settings.compile == "layers" or (settings.compile == "auto" and device.startswith("cuda")):
            scorer.kernels.compile()
        return scorer

    @property
    def compiled(self) -> bool:
        return self.kernels.compiled

    @property
    def dtype(self) -> str:
        return str(next(self.model.parameters()).dtype).removeprefix("torch.")

    def score_ids(self, seqs: Sequence[Sequence[int]]) -> list[float]:
        """Scores in input order; every micro-batch is launched before the first result is read."""
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
            # Recorded when the GPU reaches this micro-batch.
            started = torch.cuda.Event(enable_timing=True)
            started.record(torch.cuda.current_stream(self.device))
        with torch.inference_mode():
            parts = self._forward_split(list(range(len(seqs))), seqs, lengths)
            scores = torch.cat([p for _, p in parts]).float()
        order = [i for rows, _ in parts for i in rows]
        if scores.device.type != "cuda":
            return Launched(order, scores, None)
        # Scores to pinned host memory behind the forward; the event says when they are there.
        host = torch.empty(scores.shape, dtype=scores.dtype, pin_memory=True)
        host.copy_(scores, non_blocking=True)
        done = torch.cuda.Event(enable_timing=True)
        done.record(torch.cuda.current_stream(scores.device))
        return Launched(order, host, done, started)

    def _forward_split(self, rows: list[int], seqs, lengths) -> list[tuple[list[int], Any]]:
        torch = self.torch
        try:
            return [(rows, self._forward(rows, seqs, lengths))]
        except torch.cuda.OutOfMemoryError:
            if len(rows) == 1:
                raise InputTooLong(
                    f"a single sequence of {lengths[rows[0]]} tokens does not fit in GPU memory; lower "
                    "REWARD_MAX_LENGTH"
                ) from None
            torch.cuda.empty_cache()  # a no-op where CUDA never started
            half = len(rows) // 2
            log.warning("CUDA out of memory on %d rows; retrying as %d + %d", len(rows), half, len(rows) - half)
            if self.on_oom:
                self.on_oom()
            return self._forward_split(rows[:half], seqs, lengths) + self._forward_split(rows[half:], seqs, lengths)

    def _forward(self, rows: list[int], seqs, lengths):
        start = time.perf_counter()
        layout = self.planner.layout([lengths[i] for i in rows])
        width = layout.width
        if layout.bins is not None:
            bins = [[rows[k] for k in members] for members in layout.bins]
            scores = self._forward_packed(rows, bins, seqs, lengths, width)
            if self.on_packed:
                self.on_packed()
        else:
            scores = self._forward_padded(rows, seqs, lengths, width)
        if self.on_forward:
            as_run = len(layout.bins) if layout.bins is not None else len(rows)
            self.on_forward(as_run, width, sum(lengths[i] for i in rows), time.perf_counter() - start)
        return scores

    def _forward_padded(self, rows: list[int], seqs, lengths, width: int):
        """One sequence to a row, padded on the right; the score is read at each row's last real token."""
        torch = self.torch
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long, pin_memory=self.pin)
        for r, i in enumerate(rows):
            ids[r, : lengths[i]] = torch.as_tensor(seqs[i], dtype=torch.long)
        last = torch.tensor([lengths[i] - 1 for i in rows], dtype=torch.long, pin_memory=self.pin)
        ids, last = ids.to(self.device, non_blocking=True), last.to(self.device, non_blocking=True)
        if self.fast:
            # Right padding under causal attention needs no mask: attention takes the fused causal kernel.
            hidden = self._hidden(ids)
            scores = self.head(hidden[torch.arange(len(rows), device=hidden.device), last])[:, 0]
        else:
            mask = (torch.arange(width)[None, :] < torch.as_tensor([lengths[i] for i in rows])[:, None]).long()
            scores = self.model(input_ids=ids, attention_mask=mask.to(self.device), use_cache=False).logits[:, 0]
        return scores

    def _forward_packed(self, rows: list[int], bins: list[list[int]], seqs, lengths, width: int):
        """Several sequences to a row, each with its own positions under a block-diagonal causal mask: as alone."""
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
        """The base model's last hidden states. With `mask_mapping` the mask goes in as the per-layer mapping, so
        transformers builds none (5.x would wait on the GPU to look for packed sequences; 4.56 lose the causal kernel).
        use_cache=False: no KV cache, and no cache state for compile to guard on (every layer would recompile)."""
        attention = {"full_attention": mask} if self.mask_mapping else mask
        out = self.base(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False)
        return out.last_hidden_state


class Launched:
    """A micro-batch on its way through the GPU: `ready()` without blocking, `result()`, `gpu_seconds()` once done."""

    def __init__(self, order: list[int], scores, event, started=None):
        self.order, self.scores, self.event, self.started = order, scores, event, started

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
