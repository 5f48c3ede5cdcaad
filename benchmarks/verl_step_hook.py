"""What benchmarks/gpu_job.py adds in verl's Ray workers (CPU_RUN_THEN_HOOK: gpu_job.measure_phases), and what the
Megatron benchmark borrows: the hybrid worker's phases wrapped so that each call prints its peak memory, one line a
call (PHASE_PREFIX and JSON, read back from verl's console), call N of each phase profiled where PROFILE_ENV says N;
a profile's GPU time by kernel kind; verl's fused forward reading a tied weight on one stage."""

from __future__ import annotations

import functools
import json
import os
import time

PHASE_PREFIX = "verl_step phase: "  # what the hook prints, one JSON object a call
PHASES = ("generate_sequences", "compute_log_prob", "compute_ref_log_prob", "update_actor")


def fused_forward_reads_the_tied_weight() -> None:
    """The benchmarks' one-GPU models are one pipeline stage with tied embeddings, where verl 0.6.1's fused forward
    stops: it passes `model.output_layer.weight` (verl/models/mcore/model_forward_fused.py:201), which megatron-core
    leaves None when the output layer shares the embedding's weight on one stage. For the call alone it reads the
    embedding's weight, as verl 0.7.0's fix does and as the last of two or more stages holds it anyway (its own copy,
    megatron-core gpt_model.py ~211): the measured stage is then the default plan's last stage in what it computes
    and keeps. Benchmarks only: the job leaves the kernels off at ACTOR_PP=1 with tied embeddings."""
    from verl.models.mcore import model_forward_fused as fused

    forward = fused._fused_GPTModel_forward
    if getattr(forward, "reads_the_tied_weight", False):
        return

    @functools.wraps(forward)
    def reads_tied(model, *args, **kwargs):
        output = model.output_layer
        if output is None or output.weight is not None:
            return forward(model, *args, **kwargs)
        output.__dict__["weight"] = model.embedding.word_embeddings.weight  # a plain attribute, as megatron's None is
        try:
            return forward(model, *args, **kwargs)
        finally:
            output.__dict__["weight"] = None

    reads_tied.reads_the_tied_weight = True
    fused._fused_GPTModel_forward = reads_tied


# VERL_STEP_PROFILE=N: call N of each phase runs under torch.profiler, its summary a JSON file in VERL_STEP_PROFILE_DIR
PROFILE_ENV, PROFILE_DIR_ENV = "VERL_STEP_PROFILE", "VERL_STEP_PROFILE_DIR"
# Kernel names by kind, first match wins (CUDA kernels' names as the profiler reports them)
KERNEL_KINDS = (
    ("memcpy", ("memcpy",)),
    ("memset", ("memset",)),
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("fused log-prob (triton)", ("efficient_entropy", "entropy_kernel", "linear_cross")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "sm90_", "sm80_", "wgmma", "splitk")),
    ("triton", ("triton",)),
    (
        "elementwise and reductions",
        (
            "elementwise",
            "reduce",
            "vectorized",
            "unrolled",
            "softmax",
            "norm",
            "cat",
            "copy",
            "index",
            "scatter",
            "gather",
            "fill",
        ),
    ),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, needles in KERNEL_KINDS if any(n in low for n in needles)), "other")


def profile_summary(prof, wall: float) -> dict:
    """A profiled call's GPU time by kernel kind, its busiest kernels and CPU operators, beside its wall seconds.
    Read from the profiler's raw events: its key_averages() builds an event tree first, which took minutes for the
    update's recomputed backward (~10^6 events). So CPU operators are ranked by their total (inclusive) seconds."""
    from torch._C._autograd import DeviceType

    kernels: dict[str, list] = {}
    cpu: dict[str, list] = {}
    spans = []  # the GPU's busy intervals (ns): its idle time is the wall less their union
    for e in prof.profiler.kineto_results.events():
        into = cpu if e.device_type() == DeviceType.CPU else kernels
        entry = into.setdefault(e.name(), [0.0, 0])
        entry[0] += e.duration_ns() / 1e9
        entry[1] += 1
        if into is kernels:
            spans.append((e.start_ns(), e.start_ns() + e.duration_ns()))
    covered, last = 0, 0
    for start, end in sorted(spans):
        covered += max(0, end - max(start, last))
        last = max(last, end)
    kinds: dict[str, float] = {}
    for name, (s, _) in kernels.items():
        kinds[kernel_kind(name)] = kinds.get(kernel_kind(name), 0.0) + s
    busy = sum(kinds.values())
    top = sorted(kernels.items(), key=lambda k: -k[1][0])[:25]
    top_cpu = sorted(cpu.items(), key=lambda k: -k[1][0])[:15]
    return {
        "wall_s": round(wall, 3),
        "gpu_kernel_s": round(busy, 3),
        "gpu_busy_share": round(busy / wall, 3),
        "gpu_idle_s": round(max(0.0, wall - covered / 1e9), 3),
        "by_kind_s": {k: round(v, 3) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "s": round(s, 4), "calls": c, "kind": kernel_kind(n)} for n, (s, c) in top],
        "top_cpu_ops": [{"name": n[:120], "total_s": round(s, 4), "calls": c} for n, (s, c) in top_cpu],
    }


def _measure_phases(module: str) -> None:
    """Wrap the hybrid worker's phase methods; verl calls them on the instance by name (single_controller/ray/
    base.py:697-699) and reads their dispatch attributes, which functools.wraps copies, from the class."""
    import importlib

    cls = importlib.import_module(f"verl.workers.{module}").ActorRolloutRefWorker
    for name in PHASES:
        setattr(cls, name, _measured(name, getattr(cls, name)))


def _measured(name: str, method):
    calls = [0]

    @functools.wraps(method)
    def measured(self, *args, **kwargs):
        from verl.utils.device import get_torch_device

        device = get_torch_device()
        reset = getattr(device, "reset_peak_memory_stats", None)  # torch.cpu has none: a CPU reports 0
        if reset is not None:
            device.synchronize()
            reset()
        before = device.memory_allocated()
        calls[0] += 1
        # generation is left out: HF generate's per-token kernels make a profile that takes minutes to summarise
        profiled = os.environ.get(PROFILE_ENV) == str(calls[0]) and reset is not None and name != "generate_sequences"
        began = time.monotonic()
        if profiled:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                out = method(self, *args, **kwargs)
                device.synchronize()
        else:
            out = method(self, *args, **kwargs)
        if reset is not None:
            device.synchronize()
        record = {
            "phase": name,
            "call": calls[0],
            "role": getattr(self, "role", None),
            "pid": os.getpid(),
            "seconds": time.monotonic() - began,
            "allocated_before_gib": before / 2**30,
            "peak_allocated_gib": device.max_memory_allocated() / 2**30,
            "peak_reserved_gib": device.max_memory_reserved() / 2**30,
        }
        if profiled:
            folder = os.environ.get(PROFILE_DIR_ENV) or "."
            os.makedirs(folder, exist_ok=True)
            summary = record | {"profile": profile_summary(prof, record["seconds"])}
            with open(os.path.join(folder, f"{name}_call{calls[0]}_{os.getpid()}.json"), "w") as f:
                json.dump(summary, f, indent=1)
            record["profiled"] = True
        print(PHASE_PREFIX + json.dumps(record), flush=True)
        return out

    return measured
