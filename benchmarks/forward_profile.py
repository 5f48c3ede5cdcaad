"""Where the reward server's GPU time goes: the benchmark's step scored in-process by the server's own RewardScorer
(no HTTP), once as the batch path runs it (the whole step planned at once) and once as small groups (what per-sample
callers give the server: a few sequences per micro-batch), each timed and profiled with torch.profiler.

For each layout it prints the wall time, the share of the sustained matmul ceiling, the GPU's busy share (kernel time
over wall: the rest is the host launching) and the kernel time by kind: matmuls, attention, compiled (Triton) fused
kernels, other elementwise kernels and copies. The workload and model are the benchmark's (docs/reward-benchmark.md).

    python -m benchmarks.forward_profile --out forward_profile.json                 # GPU
    python -m benchmarks.forward_profile --shape tiny --device cpu --samples 32 --out x.json   # smoke run
"""

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.reward_bench import SHAPES, build_model, machine_info, matmul_tflops, scorer_step  # noqa: E402
from reward_score.server.runner import RewardScorer  # noqa: E402
from reward_score.server.settings import Settings  # noqa: E402

KINDS = (  # first match wins; names as the CUDA kernels are called
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")),
    ("attention", ("flash", "fmha", "attention", "efficient", "sdpa")),
    ("compiled (triton)", ("triton",)),
    ("copy", ("memcpy", "memset", "copy")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other elementwise"


def kernel_times(prof) -> dict[str, float]:
    """Device seconds by kind of kernel, from the profiler's own kernel events."""
    out: dict[str, float] = {}
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0.0)
        if us <= 0 or getattr(evt, "device_type", None) is None or "CUDA" not in str(evt.device_type):
            continue
        kind = kind_of(evt.key)
        out[kind] = out.get(kind, 0.0) + us / 1e6
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=4321, help="workload seed (fresh lengths: not the warm-up's)")
    parser.add_argument("--group", type=int, default=10, help="sequences per micro-batch in the small-groups layout")
    parser.add_argument("--compile", default="auto", help="REWARD_COMPILE for the scorer")
    parser.add_argument(
        "--layouts",
        choices=("both", "batch", "small"),
        default="both",
        help="profile the batch path, the small groups, or both (a big model's small groups take long)",
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch

    work = Path(tempfile.mkdtemp(prefix="forward_profile_"))
    model_dir, params, words = build_model(args.shape, work / "model", args.device)
    scorer = RewardScorer.load(Settings(model_path=str(model_dir), device=args.device, compile=args.compile))
    scorer.warm_up()
    on_gpu = args.device.startswith("cuda")

    def sync():
        if on_gpu:
            torch.cuda.synchronize()

    layouts = [  # (--layouts name, printed name, how it scores a step); each keeps its seed whichever are run
        ("batch", "batch path (whole step planned at once)", lambda seqs: scorer.score_ids(seqs)),
        ("small", f"small groups ({args.group} sequences per call)", lambda seqs: [
            scorer.score_ids(seqs[i : i + args.group]) for i in range(0, len(seqs), args.group)
        ]),
    ]  # fmt: skip
    ceiling = matmul_tflops(args.device)
    results = []
    for k, (key, name, run) in enumerate(layouts):
        if args.layouts not in ("both", key):
            continue
        # shapes of another step first: compile and pick kernels
        run(scorer_step(scorer, args.seed + 100 + k, args.samples, words))
        seqs = scorer_step(scorer, args.seed + k, args.samples, words)
        tokens = sum(len(s) for s in seqs)
        sync()
        t = time.perf_counter()
        run(seqs)
        sync()
        wall = time.perf_counter() - t
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as prof:
            run(seqs)
            sync()
        kinds = kernel_times(prof) if on_gpu else {}
        busy = sum(kinds.values())
        tflops = 2 * params * tokens / wall / 1e12
        results.append({
            "layout": name, "wall_s": wall, "tokens": tokens, "tflops": tflops,
            "pct_of_ceiling": 100 * tflops / ceiling["sustained"] if ceiling else None,
            "kernel_s": kinds, "gpu_busy_share": busy / wall if on_gpu else None,
        })  # fmt: skip
        r = results[-1]
        pct = f"{r['pct_of_ceiling']:.1f}% of ceiling" if ceiling else "no GPU ceiling"
        print(f"{name}: {wall:.3f} s, {tokens} tokens, {tflops:.1f} TFLOP/s, {pct}")
        if on_gpu:
            print(f"  GPU busy {100 * busy / wall:.1f}% of the wall (profiled run)")
            for kind, s in sorted(kinds.items(), key=lambda x: -x[1]):
                print(f"  {kind:<20} {s:8.3f} s  {100 * s / busy:5.1f}% of kernel time")
    out = {"shape": args.shape, "device": args.device, "samples": args.samples, "params_non_embedding": params,
           "ceiling": ceiling, "compiled": scorer.compiled, "layouts": results}  # fmt: skip
    out.update(machine_info(args.device))
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
