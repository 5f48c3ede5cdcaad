"""What one GPU of the job holds, from the settings: the rollout engine's share, a reward server's peak from its model's
size, what the trainer keeps there when the engine starts, and each pipeline stage's peak in the Megatron update. The
preflight prints the rollout's as one line:

    preflight: GPU memory per GPU (79.2 GiB, measured here): the trainer keeps 14.9 GiB at the rollout's start (...);
    a reward server ...; SGLang takes ROLLOUT_GPU_MEMORY=0.4 (auto) of the memory free at its start ...

The engines read the one setting differently (memory_line says how). A reward server holds its weights in bf16 and, at
its peak, the activations of one full micro-batch (reward_server_peak). Measured on one H200, the servers' peaks were
5.0, 17.8 and 30.8 GiB for the 1.7B, 8B and 14B shapes; this estimate says 5.5, 18.6 and 32.2 (benchmarks/HISTORY.md).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

from launch.plan.settings import Settings
from launch.plan.stage_memory import (
    GIB,
    WORKER_OVERHEAD,
    GpuMemoryError,
    ModelDims,
    RewardPeak,
    log_prob_line,
    stage_parameters,
    update_line,
)


def reward_server_peak(model_path: str, environ: Mapping[str, str]) -> RewardPeak:
    """A reward server's peak on a GPU, from the model's config (built on the meta device: nothing is loaded) and the
    memory cap the environment gives the server (REWARD_GPU_MEMORY_GIB)."""
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
    dims = ModelDims.from_config(config)
    per_token = activation_bytes_per_token(dims.hidden, dims.ffn, dims.q, dims.kv, 2)
    cap = int(server.gpu_memory_gib * GIB)
    tokens = model_token_budget(per_token, weights, cap)
    return RewardPeak(weights, int(ACTIVATION_MARGIN * per_token * tokens), tokens, cap)


def gpu_total() -> int | None:
    """The first visible GPU's memory in bytes, or None where there is none (a login node)."""
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


# --- the rollout engine's share, at its start --------------------------------------------------------------------


@dataclass(frozen=True)
class Resident:
    """What the trainer's worker holds on one GPU when the rollout engine starts: (what, bytes) pairs."""

    parts: tuple[tuple[str, int], ...]

    @property
    def total(self) -> int:
        return sum(b for _, b in self.parts)

    def describe(self) -> str:
        return ", ".join(f"{what} {b / GIB:.1f}" if b >= GIB / 20 else f"{what} <0.1" for what, b in self.parts if b)


def trainer_resident(cfg, policy: ModelDims, critic: ModelDims | None = None) -> list[Resident]:
    """What the trainer keeps on each GPU of the hybrid engine when the rollout engine starts and sizes itself, one
    entry per pipeline stage (one for FSDP, which shards everything over all the GPUs), by the composed config's
    offload settings. verl 0.6.1 initialises the critic and the reference first and the actor with its rollout last
    (verl/trainer/ppo/ray_trainer.py:749-765); sync SGLang starts inside the actor's init_model
    (megatron_workers.py:510-512, fsdp_workers.py:812), async SGLang after it (ray_trainer.py:767-775,
    agent_loop.py:686), so either sees every role's init done. What each init leaves on the GPU:
    Megatron (verl/workers/megatron_workers.py): the actor's bf16 weights and fp32 gradient buffer unless
    actor.megatron.param_offload (:492-493; 2P + 4P of the stage, / TP), its optimizer unless optimizer_offload
    (:495-496; fp32 main weights and Adam's moments, 12P / (TP x DP), held from its first update on, when the engine
    resumes into the size it took at its start); the reference's bf16 weights unless ref.megatron.param_offload
    (:531-532); PPO's critic as the actor, unless critic.megatron.param_offload / optimizer_offload (:1035-1038).
    FSDP (verl/workers/fsdp_workers.py, FSDP2 shards over all N GPUs): the actor's fp32 parameters (:311-313)
    unless actor.fsdp_config.param_offload (:797-798) or offload_policy (:513-514), its optimizer (Adam's moments,
    8P / N) unless optimizer_offload (:801-802); never the reference, which FSDP keeps in host memory whatever its
    settings (:490-492, 518); the critic's fp32 parameters (:1249-1250) and optimizer unless
    critic.model.fsdp_config.param_offload / optimizer_offload (:1465-1469). Every GPU also carries the worker
    process's own WORKER_OVERHEAD."""
    actor, ref = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.ref
    has_ref = bool(actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)  # verl/trainer/main_ppo.py:231-232
    has_critic = critic is not None  # given where verl builds one (gpu_memory_line: need_critic)
    gpus = cfg.trainer.n_gpus_per_node * cfg.trainer.nnodes
    if actor.strategy == "megatron":
        pp, tp = actor.megatron.pipeline_model_parallel_size, actor.megatron.tensor_model_parallel_size
        dp = max(1, gpus // (pp * tp))
        out = []
        for stage in range(pp):
            p = stage_parameters(policy, stage=stage, stages=pp) // tp
            c = stage_parameters(critic, stage=stage, stages=pp, value_head=True) // tp if has_critic else 0
            parts = [
                ("actor weights", 0 if actor.megatron.param_offload else 2 * p),
                ("actor gradients", 0 if actor.megatron.param_offload else 4 * p),
                ("actor optimizer", 0 if actor.megatron.optimizer_offload else 12 * p // dp),
                ("reference", 2 * p if has_ref and not ref.megatron.param_offload else 0),
            ]
            if has_critic:
                m = cfg.critic.megatron
                parts += [
                    ("critic weights and gradients", 0 if m.param_offload else 6 * c),
                    ("critic optimizer", 0 if m.optimizer_offload else 12 * c // dp),
                ]
            out.append(Resident((*parts, ("process", WORKER_OVERHEAD))))
        return out
    p = stage_parameters(policy, stage=0, stages=1) // gpus
    c = stage_parameters(critic, stage=0, stages=1, value_head=True) // gpus if has_critic else 0
    offloaded = actor.fsdp_config.param_offload or actor.fsdp_config.get("offload_policy", False)
    parts = [
        ("actor weights", 0 if offloaded else 4 * p),
        ("actor optimizer", 0 if actor.fsdp_config.optimizer_offload else 8 * p),
    ]
    if has_critic:
        f = cfg.critic.model.fsdp_config
        parts += [
            ("critic weights", 0 if f.param_offload else 4 * c),
            ("critic optimizer", 0 if f.optimizer_offload else 8 * c),
        ]
    return [Resident((*parts, ("process", WORKER_OVERHEAD)))]


def _gib(values: list[float]) -> str:
    """`a` or, where the values differ (pipeline stages), `a-b`, in GiB with one decimal."""
    lo, hi = f"{min(values) / GIB:.1f}", f"{max(values) / GIB:.1f}"
    return lo if lo == hi else f"{lo}-{hi}"


def _reward_servers(s: Settings, peak: RewardPeak | None, replicas: int, reward_gpus: list[str]) -> str:
    """Where the reward servers run and what one holds, for the memory line."""
    if peak is None:
        return "no reward server (REWARD=rule)" if not s.uses_reward_model else "reward servers on the CPU"
    if s.separate_reward_node:
        return f"reward servers on their own node, {replicas} x {peak.describe()}, one per GPU"
    return f"a reward server {peak.describe()} on the head's GPU {','.join(reward_gpus)} (CONFIG_REWARD_GPUS)"


def _refuse_short(total: int | None, share: float, name: str, held: int, what: str, shared: bool) -> None:
    """vLLM's own check at its start, where `held` bytes of the GPU are taken: GpuMemoryError naming the share that
    fits, where the GPU's size is known and less than `share` of it is free."""
    if total is None or total - held >= share * total:
        return
    fix = f"set ROLLOUT_GPU_MEMORY={math.floor((total - held) / total * 100) / 100:g} or less"
    if shared:
        fix += (
            ", or cap the reward server (REWARD_GPU_MEMORY_GIB) or give it a node of its own "
            "(CONFIG_USE_SEPARATE_REWARD_NODE=true)"
        )
    raise GpuMemoryError(
        f"vLLM takes {name} of the whole GPU, {share * total / GIB:.1f} GiB, but {what} leaves "
        f"{(total - held) / GIB:.1f} GiB of this GPU's {total / GIB:.1f} free at its start: vLLM 0.10.0 refuses to "
        "start ('Free memory on device ... is less than desired GPU memory utilization', "
        f"vllm/v1/worker/gpu_worker.py:166-176); {fix}"
    )


def memory_line(
    s: Settings, peak: RewardPeak | None, total: int | None, resident: list[Resident], replicas: int = 1
) -> str:
    """The preflight's one line: per GPU, what the rollout engine takes, beside what the trainer and the reward
    servers hold there when it starts. `peak`: one reward server's (None: they run on the CPU); `resident`: the
    trainer's at the engine's start, per pipeline stage (trainer_resident; not read with one_step_off); `replicas`:
    servers on a separate reward node; `total`: the GPU's bytes (None: no GPU here, the line gives shares).

    SGLang 0.5.2 (mem_fraction_static) takes its share of the memory FREE when it starts: it measures the free memory
    before loading (python/sglang/srt/model_executor/model_runner.py:665-669, the least over a tensor-parallel
    group's GPUs) and sizes its KV cache to what loading left of that share (:1123-1125), so weights and cache fill
    mem_fraction_static x free. vLLM 0.10.0 (gpu_memory_utilization) takes its share of the whole GPU and refuses to
    start where less than that is free (vllm/v1/worker/gpu_worker.py:163-176, 246). Either gives it back for the
    update (free_cache_engine) and takes the same again for the next rollout. With one_step_off the rollout GPUs hold
    the engine alone (hybrid_engine=False, the recipe's own pool) and the trainer's GPUs no engine; the head's reward
    server sits on whichever of the two Ray gives its GPU to. Where the GPU's size is known and vLLM would refuse to
    start, GpuMemoryError names the share that fits."""
    where = f"{total / GIB:.1f} GiB, measured here" if total is not None else "no GPU here: shares of one"
    share = s.rollout_gpu_memory
    name = f"ROLLOUT_GPU_MEMORY={share:g}" + (" (auto)" if s.rollout_gpu_memory_setting == "auto" else "")
    reward_gpus = [g.strip() for g in s.reward_gpus.split(",") if g.strip()]
    shared = peak is not None and not s.separate_reward_node  # a reward server on some of the head's GPUs
    reward = _reward_servers(s, peak, replicas, reward_gpus)
    server = peak.total if shared else 0

    def whole() -> str:  # a share of the whole GPU (vLLM)
        return f"{share * total / GIB:.1f} GiB" if total is not None else f"{share:.0%}"

    if s.trainer_mode == "one_step_off":
        parts = [
            f"one_step_off: the {s.rollout_gpus_per_node} rollout GPU(s) a node hold vLLM alone, {name} of the whole "
            f"GPU (gpu_memory_utilization): {whole()}",
            f"the {s.training_gpus_per_node} trainer GPU(s) a node hold no rollout engine",
            reward,
        ]
        if shared:
            what = f"the reward server on the head's GPU {','.join(reward_gpus)} (a rollout GPU where Ray gives it to"
            _refuse_short(total, share, name, server, what + " the rollout's pool)", shared)
            free = f"{(total - server) / GIB:.1f} GiB" if total is not None else f"GPU - {server / GIB:.1f} GiB"
            parts.append(f"a rollout GPU with it has {free} free at vLLM's start")
        return f"GPU memory per GPU ({where}): " + "; ".join(parts)

    held = [r.total for r in resident]
    fullest = max(resident, key=lambda r: r.total)
    parts = [
        f"the trainer keeps {_gib(held)} GiB at the rollout's start ({fullest.describe()}: verl's offload settings)",
        reward,
    ]
    others = s.gpus_per_node - len(reward_gpus) if shared else 0
    if s.rollout_engine == "sglang":

        def takes(extra: int) -> str:  # SGLang's share of what is free beside the trainer and `extra` bytes
            if total is None:
                return f"{share:.0%} x (GPU - {_gib([h + extra for h in held])} GiB)"
            free = [total - h - extra for h in held]
            return f"{share:g} x {_gib(free)} = {_gib([share * f for f in free])} GiB"

        engine = f"SGLang takes {name} of the memory free at its start (mem_fraction_static): "
        if shared:
            group = " and the rest of its tensor-parallel group" if s.rollout_tp > 1 else ""
            engine += f"{takes(server)} on GPU {','.join(reward_gpus)}{group}"
            engine += f", {takes(0)} on the {others} other(s)" if others > 0 else ""
        else:
            engine += f"{takes(0)} on every GPU"
    else:
        what = f"what the trainer keeps ({_gib(held)} GiB)" + (
            f" and the reward server ({server / GIB:.1f} GiB) on GPU {','.join(reward_gpus)}" if shared else ""
        )
        _refuse_short(total, share, name, max(held) + server, what, shared)
        engine = f"vLLM takes {name} of the whole GPU (gpu_memory_utilization): {whole()} on every GPU"
    parts.append(engine + "; given back for the update (free_cache_engine)")
    return f"GPU memory per GPU ({where}): " + "; ".join(parts)


# --- the Megatron actor's update, per pipeline stage ----------------------------------------------------------------


# --- what the preflight prints (launch/plan/preflight.py), from the settings and the composed config ---------------


def reward_peak(settings: Settings) -> RewardPeak | None:
    """One reward server's peak on a GPU (reward_server_peak), None where the servers run on the CPU or none runs."""
    if settings.reward_device == "cpu" or not settings.uses_reward_model:
        return None
    return reward_server_peak(settings.reward_model_path, os.environ)


def gpu_memory_line(settings: Settings, peak, cfg) -> str:
    """What each GPU holds when the rollout engine starts (memory_line): the trainer's resident parts by the composed
    config's offload settings (trainer_resident), the reward servers' peak, and what the engine takes."""
    from transformers import AutoConfig
    from verl.trainer.ppo.utils import need_critic

    resident = []
    if settings.trainer_mode != "one_step_off":  # its rollout GPUs hold nothing of the trainer's
        policy = ModelDims.from_config(AutoConfig.from_pretrained(settings.model_path))
        critic = ModelDims.from_config(AutoConfig.from_pretrained(cfg.critic.model.path)) if need_critic(cfg) else None
        resident = trainer_resident(cfg, policy, critic)
    return memory_line(settings, peak, gpu_total(), resident, settings.reward_replicas)


def megatron_update_lines(settings: Settings, peak, fused: bool) -> list[str]:
    """Each pipeline stage's peak during the actor's update and during the log-prob passes (update_line,
    log_prob_line: this module's formula, measured in benchmarks/results/megatron_memory_*.json); refused where this
    GPU is known to be too small. `fused`: FUSED_KERNELS as the trainer command has it."""
    from transformers import AutoConfig

    dims, total = ModelDims.from_config(AutoConfig.from_pretrained(settings.model_path)), gpu_total()
    return [update_line(settings, dims, total, peak, fused), log_prob_line(settings, dims, total, peak, fused)]
