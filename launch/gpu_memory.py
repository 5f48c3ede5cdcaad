"""What one GPU of the job holds, from the settings: the rollout engine's share, a reward server's peak from its model's
size, and what is left for the training side. The preflight prints it as one line:

    preflight: GPU memory per GPU (79.2 GiB, measured here): rollout 40% = 31.7 GiB (ROLLOUT_GPU_MEMORY); ...

The rollout engine's share is of the whole GPU (SGLang's mem_fraction_static, vLLM's gpu_memory_utilization: its
weights and KV cache), held while it generates and given back for the update (free_cache_engine). A reward server
holds its weights in bf16 and, at its peak, the activations of one full micro-batch: the estimate the server's own
planner sizes its token budget by (reward_score/server/planner.py), capped by REWARD_GPU_MEMORY_GIB. Measured on one
H200, the servers' peaks were 5.0, 17.8 and 30.8 GiB for the 1.7B, 8B and 14B shapes; this estimate says 5.5, 18.6
and 32.2 (benchmarks/README.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from launch.settings import Settings, megatron_reference_offloaded, token_budget

GIB = 2**30


@dataclass(frozen=True)
class RewardPeak:
    weights: int  # bytes, bf16
    activations: int  # bytes at a full micro-batch, with the planner's margin
    tokens: int  # the micro-batch's token budget
    cap: int  # REWARD_GPU_MEMORY_GIB in bytes, 0: none

    @property
    def total(self) -> int:
        peak = self.weights + self.activations
        return min(peak, self.cap) if self.cap else peak

    def describe(self) -> str:
        text = (
            f"~{self.total / GIB:.1f} GiB peak ({self.weights / GIB:.1f} GiB weights + "
            f"{self.activations / GIB:.1f} GiB activations at {self.tokens} tokens"
        )
        return text + (f", capped by REWARD_GPU_MEMORY_GIB={self.cap / GIB:g})" if self.cap else ")")


def reward_server_peak(model_path: str, environ: Mapping[str, str]) -> RewardPeak:
    """A reward server's peak on a GPU, from the model's config (built on the meta device: nothing is loaded) and the
    server's own settings in the environment (REWARD_TOKEN_BUDGET, REWARD_GPU_MEMORY_GIB)."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from reward_score.server.planner import ACTIVATION_MARGIN, activation_bytes_per_token, model_token_budget
    from reward_score.server.settings import load_settings

    server = load_settings([], dict(environ))
    config = AutoConfig.from_pretrained(model_path)
    config.num_labels = 1
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config)
    weights = sum(p.numel() for p in model.parameters()) * 2  # bf16 on a GPU (reward_score/server/runner.py)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    per_token = activation_bytes_per_token(
        config.hidden_size, config.intermediate_size, heads * head_dim, kv_heads * head_dim, 2
    )
    cap = int(server.gpu_memory_gib * GIB)
    tokens = server.token_budget or model_token_budget(per_token, weights, cap)
    return RewardPeak(weights, int(ACTIVATION_MARGIN * per_token * tokens), tokens, cap)


def gpu_total() -> int | None:
    """The first visible GPU's memory in bytes, or None where there is none (a login node)."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def _gib(share: float, minus: int, total: int | None) -> str:
    """`share` of a GPU less `minus` bytes, in GiB where the GPU's size is known, else as a share."""
    if total is not None:
        return f"{(share * total - minus) / GIB:.1f} GiB"
    return f"{share:.0%}" + (f" - {minus / GIB:.1f} GiB" if minus else "")


def memory_line(s: Settings, peak: RewardPeak | None, total: int | None, replicas: int = 1) -> str:
    """The preflight's one line: per GPU, the rollout's share, the reward servers' peak where they are, what is left.
    `peak`: one reward server's (None: they run on the CPU); `replicas`: servers on a separate reward node."""
    where = f"{total / GIB:.1f} GiB, measured here" if total is not None else "no GPU here: shares of one"
    rollout = f"rollout {s.rollout_gpu_memory:.0%}"
    if total is not None:
        rollout += f" = {s.rollout_gpu_memory * total / GIB:.1f} GiB"
    parts = [f"{rollout} (ROLLOUT_GPU_MEMORY)"]
    left = 1 - s.rollout_gpu_memory
    if peak is None:
        parts += ["reward servers on the CPU", f"left for training {_gib(left, 0, total)} on every GPU"]
    elif s.separate_reward_node:
        parts += [
            f"reward servers on their own node, {replicas} x {peak.describe()}, one per GPU",
            f"left for training {_gib(left, 0, total)} on every GPU",
        ]
    else:
        gpus = [g.strip() for g in s.reward_gpus.split(",") if g.strip()]
        others = s.gpus_per_node - len(gpus)
        parts += [
            f"a reward server {peak.describe()} on the head's GPU {','.join(gpus)} (CONFIG_REWARD_GPUS)",
            f"left for training {_gib(left, peak.total, total)} there"
            + (f", {_gib(left, 0, total)} on the {others} other(s)" if others > 0 else ""),
        ]
    return f"GPU memory per GPU ({where}): " + "; ".join(parts)


# --- the Megatron actor's update, per pipeline stage ----------------------------------------------------------------


@dataclass(frozen=True)
class ModelDims:
    """What the memory of a dense Qwen/Llama-style decoder depends on, from its config.json."""

    hidden: int
    ffn: int
    q: int  # query width: heads x head_dim
    kv: int  # key (and value) width: key/value heads x head_dim
    head_dim: int
    layers: int
    vocab: int
    tied: bool  # tie_word_embeddings

    @classmethod
    def from_config(cls, config) -> ModelDims:
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.hidden_size, config.intermediate_size, heads * head_dim, kv_heads * head_dim, head_dim,
                   config.num_hidden_layers, config.vocab_size, bool(getattr(config, "tie_word_embeddings", False)))  # fmt: skip

    @property
    def layer_params(self) -> int:
        """One layer: the fused qkv, the output projection, the gated MLP's two matrices, the two norms and the query
        and key norms (bias-free)."""
        h = self.hidden
        return h * (self.q + 2 * self.kv) + self.q * h + 3 * h * self.ffn + 2 * h + 2 * self.head_dim

    def activation_bytes(self, recompute: str) -> float:
        """Bytes per token one layer keeps for the backward of one micro-batch, in bf16, TP=1 (TP and sequence
        parallelism divide it). Without recompute, tensor by tensor (megatron-core 0.13's TE layer): each fused
        norm-linear its input and the normed output (2 x 2h, twice), the fused qkv output (q + 2kv: the query and key
        norms keep views of it), the rotated q and k (q + kv), the attention's output twice (2q: the kernel's own and
        the output projection's input), the MLP's up-projection (2 ffn), the SiLU output and the product the
        down-projection reads (ffn each): 2 x (4h + 4q + 3kv + 4ffn) bytes, 137,216 at Qwen3-4B's shape. Measured on
        one H200 through verl's worker (benchmarks/results/megatron_memory_h200_qwen3_4b.json, autograd's saved tensors
        per layer): 146,728 with the TE-free spec, which keeps a third copy of the attention's output (the per-sequence
        outputs and their concatenation, 2q = 8,192); an earlier probe's spec without it kept 138,500. TE's fused
        attention may share the kernel's output with the projection's input: then the formula is 2q (6%) above it.
        Full recompute keeps each layer's input alone (2h). Selective (core_attn) gives back the attention's own (the
        rotated q and k and the kernel's output)."""
        h, q, kv, f = self.hidden, self.q, self.kv, self.ffn
        off = 2 * (4 * h + 4 * q + 3 * kv + 4 * f)
        return {"off": off, "selective": off - 2 * (2 * q + kv), "full": 2 * h}[recompute]


# The logits path of one micro-batch on the last stage, bytes per logit (tokens x vocab / TP), verl 0.6.1 without its
# fused kernels: the output layer's bf16 logits, Float16Module's float32 copy (megatron-core transformer/module.py,
# float16_to_fp32), and the log-softmax's float32 result the backward keeps and then writes its gradient beside
# (verl/utils/megatron/tensor_parallel.py, vocab_parallel_log_probs_from_logits). Measured on one H200 through verl's
# worker at Qwen3-4B's shape (benchmarks/results/megatron_memory_h200_qwen3_4b.json): see docs/training.md.
LOGITS_UPDATE_BYTES = 8.0
# The log-prob pass (no_grad) with the entropy verl's worker always asks for (megatron_workers.py:752).
LOGITS_LOG_PROB_BYTES = 12.0


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's GPU memory at the peak of the actor's update, in bytes per GPU."""

    stage: int
    stages: int
    layers: int
    in_flight: int  # micro-batches whose activations are held at once (1F1B: stages - stage)
    tokens: int  # a micro-batch's token budget
    weights: int  # bf16
    grads: int  # megatron-core's grad buffer, float32 (grad_reduce_in_fp32, verl/utils/megatron_utils.py:141)
    optimizer: int  # float32 main weights and Adam's two moments, over DP (distributed optimizer); loaded back for it
    reference: int  # the reference's bf16 weights where they stay on the GPU
    activations: int
    logits: int  # the last stage's logits path

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.reference + self.activations + self.logits

    def describe(self) -> str:
        parts = [f"weights {self.weights / GIB:.1f}", f"grads {self.grads / GIB:.1f}",
                 f"optimizer {self.optimizer / GIB:.1f}"]  # fmt: skip
        if self.reference:
            parts.append(f"reference {self.reference / GIB:.1f}")
        parts.append(f"activations {self.activations / GIB:.1f} ({self.layers} layers x {self.in_flight} "
                     f"micro-batch(es) of {self.tokens} tokens)")  # fmt: skip
        if self.logits:
            parts.append(f"logits {self.logits / GIB:.1f}")
        return f"stage {self.stage}: ~{self.total / GIB:.1f} GiB (" + ", ".join(parts) + ")"


def stage_memory(dims: ModelDims, *, stage: int, stages: int, tp: int, dp: int, tokens: int, recompute: str,
                 micro_batches: int, reference_on_gpu: bool, fused_logits: bool = False,
                 in_flight: int | None = None, last: bool | None = None) -> StageMemory:  # fmt: skip
    """The update's peak on pipeline stage `stage` of `stages` (layers split evenly, megatron-core's default), as the
    StageMemory fields say. With recompute the layer being recomputed holds its full activations once, for one
    micro-batch, on top. `in_flight` and `last` override what the stage's place gives (the benchmark's one-GPU stages)."""
    layers = dims.layers // stages + (1 if stage < dims.layers % stages else 0)
    params = layers * dims.layer_params
    first, last = stage == 0, (stage == stages - 1) if last is None else last
    embedding = dims.vocab * dims.hidden
    params += embedding if first else 0
    params += embedding if last and (not dims.tied or stages > 1) else 0  # the output layer (a tied copy if PP > 1)
    params += dims.hidden if last else 0  # the final norm
    in_flight = in_flight or max(1, min(stages - stage, micro_batches))
    per_token = dims.activation_bytes(recompute) * layers * in_flight
    if recompute != "off":
        per_token += dims.activation_bytes("off")
    logits = 0 if (not last or fused_logits) else int(LOGITS_UPDATE_BYTES * tokens * dims.vocab / tp)
    return StageMemory(
        stage=stage, stages=stages, layers=layers, in_flight=in_flight, tokens=tokens,
        weights=2 * params // tp, grads=4 * params // tp, optimizer=12 * params // tp // max(1, dp),
        reference=2 * params // tp if reference_on_gpu else 0,
        activations=int(per_token * tokens / tp), logits=logits,
    )  # fmt: skip


def log_prob_peak(dims: ModelDims, *, stage: int, stages: int, tp: int, tokens: int, fused_logits: bool = False) -> int:
    """The actor's log-prob pass on a stage (no_grad): its bf16 weights and float32 grad buffer stay on the GPU (the
    optimizer is offloaded), and on the last stage the logits path of one micro-batch with the entropy."""
    s = stage_memory(dims, stage=stage, stages=stages, tp=tp, dp=1, tokens=tokens, recompute="full", micro_batches=1,
                     reference_on_gpu=False, fused_logits=True)  # fmt: skip
    last = stage == stages - 1
    logits = 0 if (not last or fused_logits) else int(LOGITS_LOG_PROB_BYTES * tokens * dims.vocab / tp)
    return s.weights + s.grads + logits


def update_plan(s: Settings, dims: ModelDims) -> list[StageMemory]:
    """Every pipeline stage of the actor's update with this job's settings. The reference's bf16 weights (2P) are not
    there: the job sets ref.megatron.param_offload (launch/settings.py, REF_PARAM_OFFLOAD), and verl moves them to the
    GPU only for compute_ref_log_prob, back to host memory after it (verl/workers/megatron_workers.py:722-723,
    733-734), before the update starts. Neither is PPO's critic's weights and gradients (critic.megatron.param_offload:
    loaded for compute_values and update_critic alone, :1078-1084, :1092-1093, :1111-1112). Without the offload
    verl keeps the reference's weights resident, and they count."""
    dp = max(1, s.train_nodes * s.training_gpus_per_node // max(1, s.actor_pp * s.actor_tp))
    return [
        stage_memory(
            dims,
            stage=k,
            stages=s.actor_pp,
            tp=s.actor_tp,
            dp=dp,
            tokens=token_budget(s),
            recompute=s.megatron_recompute,
            micro_batches=s.actor_pp,
            reference_on_gpu=not megatron_reference_offloaded(s),
        )  # fmt: skip
        for k in range(s.actor_pp)
    ]


def update_line(s: Settings, dims: ModelDims, total: int | None, reward: RewardPeak | None) -> str:
    """The preflight's line for the Megatron update, each stage's peak; refused (UpdateMemoryError) where the GPU's
    size is known and a stage's peak, with the reward server on the head's first GPU (stage 0's) where it sits there,
    is over it. The rollout gives its memory back for the update (free_cache_engine)."""
    plan = update_plan(s, dims)
    line = f"Megatron update per GPU (MEGATRON_RECOMPUTE={s.megatron_recompute}, ACTOR_PP={s.actor_pp}): " + "; ".join(
        p.describe() for p in plan
    )
    if total is None:
        return line
    shared = reward is not None and not s.separate_reward_node
    for p in plan:
        need = p.total + (reward.total if shared and p.stage == 0 else 0)
        if need > total:
            with_reward = f" with the reward server's {reward.total / GIB:.1f}" if shared and p.stage == 0 else ""
            raise UpdateMemoryError(
                f"the actor's update needs ~{need / GIB:.1f} GiB on pipeline stage {p.stage}{with_reward}, over this "
                f"GPU's {total / GIB:.1f} GiB ({p.describe()}): set MEGATRON_RECOMPUTE=full (now "
                f"{s.megatron_recompute}), lower MICRO_BATCH_PER_GPU (the micro-batch is {p.tokens} tokens; the "
                f"logits alone take {LOGITS_UPDATE_BYTES:g} bytes x tokens x {dims.vocab} vocabulary), or raise "
                f"ACTOR_PP / ACTOR_TP (docs/training.md, the Megatron update's memory)"
            )
    return line


class UpdateMemoryError(Exception):
    pass
