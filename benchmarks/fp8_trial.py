"""Would FP8 weights and activations make the reward server faster on Hopper, and score the same? The trial the
server's REWARD_DTYPE=fp8 would have to pass before it exists (issue #28's bar: >= 1.3x the bf16 throughput on the
benchmark's step, and the pairwise order of the step's scores the same as bf16's on >= 99.5% of pairs).

In-process, the server's own RewardScorer (fused projections, per-layer compile, its planner), the benchmark's model
and fresh-length workload (docs/reward-benchmark.md). The step is scored in bf16 `--repeat` times, then every linear
layer of every decoder layer (qkv, o, gate/up, down) becomes an FP8 one: weights quantised per output channel once,
activations per token on the fly, the product through torch._scaled_mm with both scales (row-wise, bf16 out), the
layers compiled again; the embedding, norms, attention and score head stay bf16. The step is then scored the same way.
Each mode first scores another step's shapes (compile and kernel choice are not timed).

    python -m benchmarks.fp8_trial --shape qwen3-8b --out fp8_8b.json           # an H100/H200
    python -m benchmarks.fp8_trial --shape tiny --device cpu --samples 48 --repeat 1 --out x.json   # smoke run
"""

import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.reward_bench import build_model, save_result, scorer_parser, scorer_step  # noqa: E402
from reward_score.server.runner import RewardScorer  # noqa: E402
from reward_score.server.settings import Settings  # noqa: E402
from reward_score.server.warmup import warm_up  # noqa: E402

SPEEDUP_BAR = 1.3
AGREEMENT_BAR = 0.995
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@functools.cache
def fp8_linear_class(torch):
    """One class for every layer (a class per layer would make torch.compile recompile the shared layer code for
    each, and give up after eight): `linear` (y = x W^T + b) as an FP8 matmul, W in e4m3 with one scale per output
    channel, x quantised per row (token) when called, the product scaled back to x's dtype by torch._scaled_mm."""
    fp8 = torch.float8_e4m3fn
    top = torch.finfo(fp8).max

    class Fp8Linear(torch.nn.Module):
        def __init__(self, linear):
            super().__init__()
            w = linear.weight.detach().float()
            scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / top
            # _scaled_mm takes its second operand column-major: W^T as a view of the row-major quantised W.
            self.register_buffer("weight_t", (w / scale).to(fp8).t())
            self.register_buffer("scale_w", scale.t().contiguous())
            self.bias = linear.bias

        def forward(self, x):
            rows = x.reshape(-1, x.shape[-1])
            scale = rows.abs().amax(dim=1, keepdim=True).float().clamp(min=1e-12) / top
            q = (rows.float() / scale).clamp(-top, top).to(fp8)
            out = torch._scaled_mm(q, self.weight_t, scale_a=scale, scale_b=self.scale_w, bias=self.bias,
                                   out_dtype=x.dtype)  # fmt: skip
            return out.reshape(*x.shape[:-1], out.shape[-1])

    return Fp8Linear


def to_fp8(scorer: RewardScorer) -> int:
    """Every decoder layer's linear layers as FP8 ones (recompiled where the scorer compiles); returns how many."""
    torch = scorer.torch
    compiled = scorer.compiled
    scorer.kernels.uncompile()
    torch._dynamo.reset()
    count = 0
    for layer in scorer.base.layers:
        for path in LINEARS:
            parent_name, name = path.split(".")
            parent = getattr(layer, parent_name)
            if isinstance(getattr(parent, name, None), torch.nn.Linear):
                setattr(parent, name, fp8_linear_class(torch)(getattr(parent, name)))
                count += 1
    if compiled:
        scorer.kernels.compile()
    return count


def pairwise_agreement(a: list[float], b: list[float]) -> float:
    """The share of pairs (i, j) that `b` orders as `a` does, over the pairs `a` does not tie."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    i, j = np.triu_indices(len(x), k=1)
    da, db = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
    untied = da != 0
    return float((da[untied] == db[untied]).mean()) if untied.any() else 1.0


def reference_scores(model_dir: Path, device: str, seqs: list[list[int]]) -> list[float]:
    """`seqs` scored in float32 (no TF32, no compile, no fused projections): how far bf16 itself is from exact."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, attn_implementation="sdpa")
    model = model.float().to(device).eval()
    settings = Settings(model_path=str(model_dir), device=device, compile="off", fuse="off")
    scores = RewardScorer(model, AutoTokenizer.from_pretrained(model_dir), device, settings).score_ids(seqs)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return scores


def main(argv=None) -> int:
    parser = scorer_parser(__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--reference-samples",
        type=int,
        default=256,
        help="how many of the step's sequences are also scored in float32 (slow on a big model)",
    )
    parser.add_argument("--model-dir", type=Path, help="where the model is built (kept for a later run)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    import torch

    on_gpu = args.device.startswith("cuda")
    model_dir = args.model_dir or Path(tempfile.mkdtemp(prefix="fp8_trial_")) / "model"
    model_dir, params, words = build_model(args.shape, model_dir, args.device)
    scorer = RewardScorer.load(Settings(model_path=str(model_dir), device=args.device))
    warm_up(scorer)

    step, other = (scorer_step(scorer, seed, args.samples, words) for seed in (args.seed, args.seed + 100))
    tokens = sum(len(s) for s in step)

    def measure(mode: str) -> dict:
        scorer.score_ids(other)  # another step's shapes first: compile and pick kernels
        walls, scores = [], None
        if on_gpu:
            torch.cuda.reset_peak_memory_stats(args.device)
        for _ in range(args.repeat):
            if on_gpu:
                torch.cuda.synchronize(args.device)
            started = time.perf_counter()
            scores = scorer.score_ids(step)
            if on_gpu:
                torch.cuda.synchronize(args.device)
            walls.append(time.perf_counter() - started)
        wall = statistics.median(walls)
        row = {"mode": mode, "walls_s": walls, "median_wall_s": wall, "tflops": 2 * params * tokens / wall / 1e12,
               "peak_gib": torch.cuda.max_memory_allocated(args.device) / 2**30 if on_gpu else None}  # fmt: skip
        print(f"{mode}: median {wall:.3f} s of {[round(w, 3) for w in walls]}, {row['tflops']:.1f} TFLOP/s"
              + (f", peak {row['peak_gib']:.2f} GiB" if on_gpu else ""), flush=True)  # fmt: skip
        return row, scores

    started = time.perf_counter()
    reference = reference_scores(model_dir, args.device, step[: args.reference_samples])
    print(f"float32 reference: {len(reference)} sequences in {time.perf_counter() - started:.1f} s", flush=True)
    bf16, bf16_scores = measure(scorer.dtype)
    converted = to_fp8(scorer)
    print(f"{converted} linear layers now FP8 (e4m3, per-channel weights, per-token activations)", flush=True)
    fp8, fp8_scores = measure("fp8")
    speedup = bf16["median_wall_s"] / fp8["median_wall_s"]
    agreement = pairwise_agreement(bf16_scores, fp8_scores)
    spread = float(np.std(bf16_scores))
    error = float(np.mean(np.abs(np.asarray(fp8_scores) - np.asarray(bf16_scores))))
    n = len(reference)
    against_fp32 = {
        "bf16": pairwise_agreement(reference, bf16_scores[:n]),
        "fp8": pairwise_agreement(reference, fp8_scores[:n]),
    }
    print(
        f"pairwise order agreement with float32 on the first {n} sequences: bf16 {100 * against_fp32['bf16']:.2f}%, "
        f"fp8 {100 * against_fp32['fp8']:.2f}%"
    )
    keep = speedup >= SPEEDUP_BAR and agreement >= AGREEMENT_BAR
    print(f"speed-up {speedup:.2f}x (bar {SPEEDUP_BAR}x), pairwise order agreement {100 * agreement:.2f}% "
          f"(bar {100 * AGREEMENT_BAR}%), mean |fp8 - bf16| {error:.4f} against a score spread (std) of "
          f"{spread:.4f}: {'meets' if keep else 'misses'} the bar")  # fmt: skip
    out = {"shape": args.shape, "device": args.device, "samples": args.samples, "tokens": tokens,
           "params_non_embedding": params, "repeat": args.repeat, "compiled": scorer.compiled,
           "fp8_linear_layers": converted, "rows": [bf16, fp8], "speedup": speedup,
           "pairwise_agreement": agreement, "agreement_with_float32": against_fp32, "reference_samples": n,
           "mean_abs_score_error": error, "score_std": spread,
           "bar": {"speedup": SPEEDUP_BAR, "pairwise_agreement": AGREEMENT_BAR}, "meets_bar": keep}  # fmt: skip
    save_result(out, args.out, args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
