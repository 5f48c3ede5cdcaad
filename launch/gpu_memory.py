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

from launch.settings import Settings

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
