"""Where the reward server's GPU time goes: the benchmark's step scored in-process by the server's own RewardScorer
(no HTTP), once as the batch path runs it (the whole step planned at once) and once as small groups (what per-sample
callers give the server: a few sequences per micro-batch), each timed and profiled with torch.profiler.

For each layout it prints the wall time, the share of the sustained matmul ceiling, the GPU's busy share (kernel time
over wall: the rest is the host launching), the kernel time by kind (matmuls, attention, compiled (Triton) fused
kernels, other elementwise kernels, copies) and the kernels that took longest. On a GPU it
also measures the copy bandwidth and sets the elementwise kernels' time against the fewest bytes their work must move
at that bandwidth (`elementwise_bytes_per_token`): how much faster any kernel for that work could be. The workload and
model are the benchmark's (docs/reward-benchmark.md).

    python -m benchmarks.forward_profile --out forward_profile.json                 # GPU
    python -m benchmarks.forward_profile --shape tiny --device cpu --samples 32 --out x.json   # smoke run
"""

import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.reward_bench import build_model, matmul_tflops, save_result, scorer_parser, scorer_step  # noqa: E402
from reward_score.server.runner import RewardScorer  # noqa: E402
from reward_score.server.settings import Settings  # noqa: E402
from reward_score.server.warmup import warm_up  # noqa: E402

KINDS = (  # first match wins; names as the CUDA kernels are called
    # Inductor's kernels are named after the ops they fuse, so one that feeds attention has "attention" in its name
    ("compiled (triton)", ("triton_",)),
    # before the matmuls: cuDNN's attention kernels are named sm90_ and wgmma like cuBLAS's matmuls
    ("attention", ("flash", "fmha", "attention", "efficient", "sdpa")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "cublas")),
    ("copy", ("memcpy", "memset", "copy")),
)
ELEMENTWISE = ("compiled (triton)", "other elementwise")


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, keys in KINDS:
        if any(k in low for k in keys):
            return kind
    return "other elementwise"


def kernels(prof) -> list[dict]:
    """Every kernel of the profile: name, kind, calls, device seconds; longest first."""
    out = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0.0)
        if us <= 0 or getattr(evt, "device_type", None) is None or "CUDA" not in str(evt.device_type):
            continue
        out.append({"name": evt.key, "kind": kind_of(evt.key), "calls": evt.count, "s": us / 1e6})
    return sorted(out, key=lambda k: -k["s"])


def kernel_times(found: list[dict]) -> dict[str, float]:
    """Device seconds by kind of kernel."""
    out: dict[str, float] = {}
    for k in found:
        out[k["kind"]] = out.get(k["kind"], 0.0) + k["s"]
    return out


def elementwise_bytes_per_token(config, dtype_bytes: int) -> int:
    """The fewest bytes the elementwise work between one decoder layer's matmuls moves per token, each tensor read
    once and written once, fused as far as a compiled layer fuses it: the input RMSNorm (read the hidden state h,
    write it normed), q and k normed per head and rotated (read and write q and k, read cos and sin), the residual add
    and post-attention RMSNorm (read two h, write two), SiLU-and-multiply (read gate and up, write one f), the last
    residual add (read two h, write one). Only fusing into the matmuls themselves would move fewer."""
    h, f = config.hidden_size, config.intermediate_size
    head = getattr(config, "head_dim", None) or h // config.num_attention_heads
    q = config.num_attention_heads * head
    kv = (getattr(config, "num_key_value_heads", None) or config.num_attention_heads) * head
    return dtype_bytes * (2 * h + 2 * (q + kv) + 2 * head + 4 * h + 3 * f + 3 * h)


def copy_bandwidth(device: str, gib: float = 2.0, repeats: int = 20) -> float | None:
    """Device-to-device copy of a `gib` buffer: bytes read plus bytes written per second, the median of `repeats`."""
    if not device.startswith("cuda"):
        return None
    import torch

    src = torch.empty(int(gib * 2**30), dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for k in range(repeats + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if k >= 3:
            times.append(start.elapsed_time(end) / 1000)
    src = dst = None
    torch.cuda.empty_cache()
    return 2 * gib * 2**30 / statistics.median(times)


def main(argv=None) -> int:
    parser = scorer_parser(__doc__)
    parser.add_argument("--group", type=int, default=10, help="sequences per micro-batch in the small-groups layout")
    parser.add_argument("--compile", default="auto", help="REWARD_COMPILE for the scorer")
    parser.add_argument("--model-dir", type=Path, help="where the random checkpoint goes (reused if it is there)")
    parser.add_argument("--top", type=int, default=15, help="the longest kernels listed per layout")
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
    model_dir, params, words = build_model(args.shape, args.model_dir or work / "model", args.device)
    settings = Settings(model_path=str(model_dir), device=args.device, compile=args.compile)
    scorer = RewardScorer.load(settings)
    warm_up(scorer)
    on_gpu = args.device.startswith("cuda")
    padded: list[int] = []  # tokens each micro-batch computed, padding included
    scorer.on_forward = lambda rows, width, tokens, seconds: padded.append(rows * width)
    bandwidth = copy_bandwidth(args.device)
    per_token = elementwise_bytes_per_token(scorer.model.config, next(scorer.model.parameters()).element_size())
    layers = len(scorer.base.layers)

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
        padded.clear()
        with torch.profiler.profile(activities=activities) as prof:
            run(seqs)
            sync()
        found = kernels(prof) if on_gpu else []
        kinds = kernel_times(found)
        busy = sum(kinds.values())
        tflops = 2 * params * tokens / wall / 1e12
        elementwise = sum(kinds.get(k, 0.0) for k in ELEMENTWISE)
        # the elementwise work's fewest bytes (padding included: those tokens are computed) at the copy bandwidth
        floor = per_token * sum(padded) * layers / bandwidth if bandwidth else None
        results.append({
            "layout": name, "wall_s": wall, "tokens": tokens, "tokens_computed": sum(padded), "tflops": tflops,
            "pct_of_ceiling": 100 * tflops / ceiling["sustained"] if ceiling else None,
            "kernel_s": kinds, "gpu_busy_share": busy / wall if on_gpu else None,
            "elementwise_s": elementwise, "elementwise_floor_s": floor,
            "elementwise_floor_share": floor / elementwise if floor and elementwise else None,
            "top_kernels": found[: args.top],
        })  # fmt: skip
        r = results[-1]
        pct = f"{r['pct_of_ceiling']:.1f}% of ceiling" if ceiling else "no GPU ceiling"
        print(f"{name}: {wall:.3f} s, {tokens} tokens ({sum(padded)} computed), {tflops:.1f} TFLOP/s, {pct}")
        if on_gpu:
            print(f"  GPU busy {100 * busy / wall:.1f}% of the wall (profiled run)")
            for kind, s in sorted(kinds.items(), key=lambda x: -x[1]):
                print(f"  {kind:<20} {s:8.3f} s  {100 * s / busy:5.1f}% of kernel time")
            print(f"  elementwise kernels {elementwise:.3f} s; their fewest bytes ({per_token} a token a layer) at the "
                  f"copy bandwidth ({bandwidth / 1e12:.2f} TB/s): {floor:.3f} s, "
                  f"{100 * (r['elementwise_floor_share'] or 0):.0f}% of their time")  # fmt: skip
            for k in found[: args.top]:
                print(f"    {k['s']:7.3f} s {k['calls']:6d} x  {k['kind']:<18} {k['name'][:90]}")
    out = {"shape": args.shape, "device": args.device, "samples": args.samples, "params_non_embedding": params,
           "ceiling": ceiling, "copy_bandwidth_bytes_per_s": bandwidth, "elementwise_bytes_per_token": per_token,
           "compiled": scorer.compiled, "fused_modules": len(scorer.fused),
           "checks": scorer.checks, "command": "python -m benchmarks.forward_profile " + " ".join(
               sys.argv[1:] if argv is None else argv), "layouts": results}  # fmt: skip
    save_result(out, args.out, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
