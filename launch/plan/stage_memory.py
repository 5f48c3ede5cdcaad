"""Each pipeline stage's peak in the Megatron update and its log-prob passes, from the policy's shape and the settings:
launch/plan/gpu_memory.py prints them beside the rollout's line, launch/plan/megatron_plan.py plans with them. The
formula's terms and what they were measured against: docs/training.md (GPU memory per role)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from launch.plan.settings import Settings

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


# One process's GPU memory outside torch's allocator (its CUDA context, cuBLAS's and NCCL's workspaces), the most any
# phase held: verl's Megatron worker at Qwen3-4B's stage-1 shape on one H100, device used less torch's reserved,
# 2.32 GiB after init, 3.15 in the log-prob pass, 3.65 in the update, fused or not
# (benchmarks/results/megatron_memory_h100_qwen3_4b_fused.json, `outside_torch_gib`). An H200's FSDP2 worker at 0.6B
# held 1.46 (verl_step_h200_qwen3_0p6b_1p7b.json). The allocator's own slack (reserved less allocated: 1.0-1.2 GiB in
# those updates) is not counted here.
WORKER_OVERHEAD = int(3.65 * GIB)


class GpuMemoryError(Exception):
    """A role's plan does not fit this GPU: the message names the setting that fits it."""


def stage_parameters(
    dims: ModelDims, *, stage: int, stages: int, value_head: bool = False, last: bool | None = None
) -> int:
    """The parameters of pipeline stage `stage` of `stages` (megatron-core's even layers, the embedding first, the
    output layer and the final norm last; `last` overrides what the stage's place gives, as stage_memory's does); a
    critic's last stage has verl's value head (hidden x 1) in place of the output layer
    (verl/models/mcore/model_initializer.py:89-94, value=True)."""
    layers = dims.layers // stages + (1 if stage < dims.layers % stages else 0)
    params = layers * dims.layer_params + (dims.vocab * dims.hidden if stage == 0 else 0)
    if stage == stages - 1 if last is None else last:
        output = dims.vocab * dims.hidden if not dims.tied or stages > 1 else 0  # a tied copy if PP > 1
        params += dims.hidden + (dims.hidden if value_head else output)  # the final norm and the head
    return params


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
        return cls(
            config.hidden_size,
            config.intermediate_size,
            heads * head_dim,
            kv_heads * head_dim,
            head_dim,
            config.num_hidden_layers,
            config.vocab_size,
            bool(getattr(config, "tie_word_embeddings", False)),
        )

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
# verl's fused kernels (FUSED_KERNELS, launch/plan/trainer_command.fused_kernels) keep no [tokens x vocab] logits; their
# Triton kernel works through the vocabulary in chunks (verl/utils/kernel/kernels.py): the forward's splits (:561) and
# the backward's d_logits chunk (:1525, its default BackwardEnum._Split_Dlogits_N, :138), in columns.
FUSED_FORWARD_SPLIT = 1024
FUSED_BACKWARD_CHUNK = 9504
# Bytes a token per query column that the TE-free layer spec keeps beside TE's where its attention is one SDPA per
# packed sequence, as in every measurement here (cpu/megatron_shims.py; ModelDims.activation_bytes): the attention's
# output a third time. The layer's, not the kernel's, but the fused update's peak holds it (fused_path_bytes), where
# verl's logits rise above it. TE's spec, or the varlen attention, would keep 0; the plan counts it.
TE_FREE_ATTENTION_BYTES = 2


def fused_path_bytes(
    dims: ModelDims, *, tokens: int, tp: int, log_prob: bool, recompute: str = "full", tied_here: bool = False
) -> int:
    """What the last stage holds with verl 0.6.1's fused kernels beside the formula's weights, gradients, optimizer and
    activations, for one micro-batch of `tokens`, in bytes a token and bf16 where not said; h the hidden size,
    V = vocab / TP. The fused forward hands the final norm's output, gathered where TP > 1 (sequence parallel), to the
    kernel (verl/models/mcore/model_forward_fused.py:199-208), which keeps it for the backward beside the int64 label
    and three float32 (verl/utils/kernel/linear_cross_entropy.py:77-81). The kernel (verl/utils/kernel/kernels.py):
    - forward: each split of FUSED_FORWARD_SPLIT columns' max, sum and entropy term, float32 (:561-567; TP adds a copy
      of the max, :644), freed at its end: 2h + 4 x 3 (4) x splits;
    - backward: d_hidden (2h, :1426), d_weight (2 x V x h bytes in all, :1427), one d_logits chunk of
      FUSED_BACKWARD_CHUNK columns (:1525-1528) and beside it the last chunk's narrower copy (:1567-1569) or the 2h
      product d_hidden adds (:1576-1578); with the last layer's output and the final norm's (2h / TP each) and, where
      TP > 1, the gathered copy: 2h (4h) + 4h / TP + 2 x chunk + max(2 x last, 2h), while no layer is recomputed.
    At TP=1 neither is the peak at Qwen3's shapes (TP does not shrink the chunk: from TP=2 or 4 the backward is): a
    layer's own transients are, which verl's logits hide and the formula does not count otherwise (/ TP as the
    activations):
    - the log-prob pass (no_grad) peaks in a layer's MLP (megatron-core transformer/mlp.py:166-170): the input the
      block keeps, the attention block's output, the norm's (h each), the up-projection (2 ffn), SiLU's output and the
      product (ffn each): 2 x (3h + 4ffn);
    - the update peaks in the recomputed layer's MLP backward: its output and the output's gradient (h each), the
      gradients of the product, of SiLU's output and of the up-projection's second half less the product freed by
      then (2 ffn): 2 x (2h + 2ffn), with TE_FREE_ATTENTION_BYTES x q. d_weight is still held there where the output
      layer reads the embedding's weight on the one stage (`tied_here`, the benchmarks: autograd adds the embedding's
      gradient to it at the backward's end); else megatron-core's hook moves it into main_grad at once
      (distributed/distributed_data_parallel.py:486-507)."""
    h, ffn, vocab = dims.hidden, dims.ffn, -(-dims.vocab // tp)
    if log_prob:
        kernel = 2 * h + 4 * (3 + (tp > 1)) * -(-vocab // FUSED_FORWARD_SPLIT)
        return int(max(2 * (3 * h + 4 * ffn) / tp, kernel) * tokens)
    last = vocab - (-(-vocab // FUSED_BACKWARD_CHUNK) - 1) * FUSED_BACKWARD_CHUNK
    copy = 2 * last if last < FUSED_BACKWARD_CHUNK else 0
    kernel = 2 * h * (1 + (tp > 1)) + 4 * h / tp + 2 * FUSED_BACKWARD_CHUNK + max(copy, 2 * h)
    recomputed = dims.activation_bytes("off") / tp if recompute != "off" else 0  # counted, but not held by then
    layer = (4 * h + 4 * ffn + TE_FREE_ATTENTION_BYTES * dims.q) / tp
    d_weight = 2 * vocab * h
    return int(max(layer * tokens + (d_weight if tied_here else 0), (kernel - recomputed) * tokens + d_weight))


def _logits_bytes(
    dims: ModelDims,
    *,
    last: bool,
    fused: bool,
    tokens: int,
    tp: int,
    log_prob: bool,
    recompute: str = "full",
    tied_here: bool = False,
) -> int:
    """The last stage's logits path of one micro-batch: verl's logits (LOGITS_*), or the fused kernels'
    (fused_path_bytes)."""
    if not last:
        return 0
    if fused:
        return fused_path_bytes(dims, tokens=tokens, tp=tp, log_prob=log_prob, recompute=recompute, tied_here=tied_here)
    return int((LOGITS_LOG_PROB_BYTES if log_prob else LOGITS_UPDATE_BYTES) * tokens * dims.vocab / tp)


@dataclass(frozen=True)
class StageMemory:
    """One pipeline stage's GPU memory at the peak of the actor's update (or of its log-prob pass, `log_prob`), in bytes
    per GPU."""

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
    logits: int  # the last stage's logits path (the fused kernels' where `fused`)
    fused: bool = False
    process: int = 0  # outside torch's allocator (WORKER_OVERHEAD), where the plan counts it
    log_prob: bool = False  # the log-prob pass: no optimizer, no activations kept, the logits with the entropy

    @property
    def total(self) -> int:
        return (
            self.weights + self.grads + self.optimizer + self.reference + self.activations + self.logits + self.process
        )

    def describe(self) -> str:
        parts = [f"weights {self.weights / GIB:.1f}", f"grads {self.grads / GIB:.1f}"]
        if not self.log_prob:
            parts.append(f"optimizer {self.optimizer / GIB:.1f}")
        if self.reference:
            parts.append(f"reference {self.reference / GIB:.1f}")
        if not self.log_prob:
            parts.append(
                f"activations {self.activations / GIB:.1f} ({self.layers} layers x {self.in_flight} "
                f"micro-batch(es) of {self.tokens} tokens)"
            )
        if self.stage == self.stages - 1 and (self.logits or self.fused):
            logits = "logits with the entropy" if self.log_prob else "logits"
            parts.append(f"{'fused log-probs' if self.fused else logits} {self.logits / GIB:.1f}")
        if self.process:
            parts.append(f"process {self.process / GIB:.1f}")
        return f"stage {self.stage}: ~{self.total / GIB:.1f} GiB (" + ", ".join(parts) + ")"


def stage_memory(
    dims: ModelDims,
    *,
    stage: int,
    stages: int,
    tp: int,
    dp: int,
    tokens: int,
    recompute: str,
    micro_batches: int,
    reference_on_gpu: bool,
    fused_logits: bool = False,
    in_flight: int | None = None,
    last: bool | None = None,
    process: int = 0,
) -> StageMemory:
    """The update's peak on pipeline stage `stage` of `stages` (layers split evenly, megatron-core's default), as the
    StageMemory fields say. With recompute the layer being recomputed holds its full activations once, for one
    micro-batch, on top. `in_flight` and `last` override what the stage's place gives (the benchmarks' one-GPU
    stages)."""
    layers = dims.layers // stages + (1 if stage < dims.layers % stages else 0)
    last = (stage == stages - 1) if last is None else last
    params = stage_parameters(dims, stage=stage, stages=stages, last=last)
    in_flight = in_flight or max(1, min(stages - stage, micro_batches))
    per_token = dims.activation_bytes(recompute) * layers * in_flight
    if recompute != "off":
        per_token += dims.activation_bytes("off")
    tied = dims.tied and stages == 1  # the output layer reads the embedding's weight
    logits = _logits_bytes(
        dims, last=last, fused=fused_logits, tokens=tokens, tp=tp, log_prob=False, recompute=recompute, tied_here=tied
    )
    return StageMemory(
        stage=stage,
        stages=stages,
        layers=layers,
        in_flight=in_flight,
        tokens=tokens,
        weights=2 * params // tp,
        grads=4 * params // tp,
        optimizer=12 * params // tp // max(1, dp),
        reference=2 * params // tp if reference_on_gpu else 0,
        activations=int(per_token * tokens / tp),
        logits=logits,
        fused=fused_logits and last,
        process=process,
    )


def log_prob_stage(
    dims: ModelDims,
    *,
    stage: int,
    stages: int,
    tp: int,
    tokens: int,
    fused_logits: bool = False,
    reference_on_gpu: bool = False,
    process: int = 0,
) -> StageMemory:
    """The actor's log-prob pass on a stage (no_grad): its bf16 weights and float32 grad buffer stay on the GPU (the
    optimizer is offloaded), and on the last stage the logits path of one micro-batch with the entropy (the fused
    kernels' where `fused_logits`); the reference's weights where `reference_on_gpu`, the process's where given."""
    s = stage_memory(
        dims,
        stage=stage,
        stages=stages,
        tp=tp,
        dp=1,
        tokens=tokens,
        recompute="full",
        micro_batches=1,
        reference_on_gpu=reference_on_gpu,
        fused_logits=fused_logits,
        process=process,
    )
    logits = _logits_bytes(dims, last=stage == stages - 1, fused=fused_logits, tokens=tokens, tp=tp, log_prob=True)
    return replace(s, optimizer=0, activations=0, logits=logits, log_prob=True)


def update_plan(s: Settings, dims: ModelDims, fused: bool = False) -> list[StageMemory]:
    """Every pipeline stage of the actor's update with this job's settings (`fused`: FUSED_KERNELS as
    trainer_command.fused_kernels resolves it), the worker process's own WORKER_OVERHEAD included. The reference's
    bf16 weights (2P) are not there: the job sets ref.megatron.param_offload (launch/plan/trainer_command.py,
    _actor_overrides), and verl moves them to the GPU only for compute_ref_log_prob, back to host memory after it
    (verl/workers/megatron_workers.py:722-723, 733-734), before the update starts. Neither is PPO's critic's weights
    and gradients (critic.megatron.param_offload: loaded for compute_values and update_critic alone, :1078-1084,
    :1092-1093, :1111-1112). Without the offload verl keeps the reference's weights resident (stage_memory's
    reference_on_gpu)."""
    dp = max(1, s.train_nodes * s.training_gpus_per_node // max(1, s.actor_pp * s.actor_tp))
    return [
        stage_memory(
            dims,
            stage=k,
            stages=s.actor_pp,
            tp=s.actor_tp,
            dp=dp,
            tokens=s.token_budget,
            recompute=s.megatron_recompute,
            micro_batches=s.actor_pp,
            reference_on_gpu=False,
            fused_logits=fused,
            process=WORKER_OVERHEAD,
        )
        for k in range(s.actor_pp)
    ]


def _refuse_over(
    s: Settings, total: int | None, reward: RewardPeak | None, plan: list[StageMemory], what: str, fix: str
) -> None:
    """GpuMemoryError where the GPU's size is known and a stage's peak, with the reward server on the head's first
    GPU (stage 0's) where it sits there, is over it."""
    shared = reward is not None and not s.separate_reward_node and total is not None
    for p in plan:
        need = p.total + (reward.total if shared and p.stage == 0 else 0)
        if total is not None and need > total:
            with_reward = f" with the reward server's {reward.total / GIB:.1f}" if shared and p.stage == 0 else ""
            raise GpuMemoryError(
                f"{what} needs ~{need / GIB:.1f} GiB on pipeline stage {p.stage}{with_reward}, "
                f"over this GPU's {total / GIB:.1f} GiB ({p.describe()}): {fix}"
            )


def update_line(s: Settings, dims: ModelDims, total: int | None, reward: RewardPeak | None, fused: bool = False) -> str:
    """The preflight's line for the Megatron update, each stage's peak; refused (GpuMemoryError) where the GPU's
    size is known and a stage's peak, with the reward server on the head's first GPU (stage 0's) where it sits there,
    is over it. The rollout gives its memory back for the update (free_cache_engine)."""
    plan = update_plan(s, dims, fused)
    logits = (
        "verl's fused log-probs keep no logits"
        if fused
        else f"the logits alone take {LOGITS_UPDATE_BYTES:g} bytes x tokens x {dims.vocab} vocabulary"
    )
    _refuse_over(
        s,
        total,
        reward,
        plan,
        "the actor's update",
        f"set MEGATRON_RECOMPUTE=full (now {s.megatron_recompute}), lower MICRO_BATCH_PER_GPU (the micro-batch "
        f"is {plan[0].tokens} tokens; {logits}), or raise ACTOR_PP / ACTOR_TP (docs/training.md, the Megatron "
        "update's memory)",
    )
    return f"Megatron update per GPU (MEGATRON_RECOMPUTE={s.megatron_recompute}, ACTOR_PP={s.actor_pp}): " + "; ".join(
        p.describe() for p in plan
    )


def log_prob_line(
    s: Settings, dims: ModelDims, total: int | None, reward: RewardPeak | None, fused: bool = False
) -> str:
    """The preflight's line for the Megatron log-prob passes, each stage's peak: the actor's weights and grad buffer
    stay (log_prob_peak), the reference's bf16 weights come back from host memory for its own pass
    (ref.megatron.param_offload: megatron_workers.py:722-723), the last stage holds one micro-batch's logits path
    with the entropy (the old log-probs', :752; the reference asks none, :730, so its path is at most that), and the
    process its WORKER_OVERHEAD. An upper bound of both passes; refused as update_line refuses."""
    tokens = s.token_budget
    plan = [
        log_prob_stage(
            dims,
            stage=k,
            stages=s.actor_pp,
            tp=s.actor_tp,
            tokens=tokens,
            fused_logits=fused,
            reference_on_gpu=True,
            process=WORKER_OVERHEAD,
        )
        for k in range(s.actor_pp)
    ]
    _refuse_over(
        s,
        total,
        reward,
        plan,
        "the reference's log-prob pass",
        f"lower MICRO_BATCH_PER_GPU (a micro-batch is {tokens} tokens) or raise ACTOR_PP / ACTOR_TP",
    )
    return (
        f"Megatron log-prob passes per GPU (old log-probs with the entropy, the reference's weights loaded for "
        f"its pass; {tokens}-token micro-batches): " + "; ".join(p.describe() for p in plan)
    )
