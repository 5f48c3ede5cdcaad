"""The Megatron update's plans on one GPU through verl 0.6.1's own worker at Qwen3-4B's PP=2 stage shapes: each plan's
(stage, fused kernels or logits, MEGATRON_RECOMPUTE, the optimizer offloaded or not, micro-batch tokens) peak memory,
seconds per 1,000 tokens, MFU and status; --profile: a warm update's GPU time by kernel kind. launch/plan/
megatron_plan.py's table is its result (product_table). One process per group (stage1: the last stage, its logits;
stage1-fused; stage0: the first stage, two micro-batches in flight under 1F1B) builds verl's worker once and changes
plan by plan only what the plan changes: megatron-core's recompute (read at each forward; checkpoint_core_attention for
selective), the token budget, the worker's offload flag. A plan out of memory ends its recompute's larger sizes. Each
record splits the update_actor call into its micro-batches' rate (seconds_per_1k_tokens, mfu: what a job's many
micro-batches run at) and what the call pays once (fixed_seconds: the optimizer's copies and step, verl's cleanup).

    python -m benchmarks.megatron_plan --out DIR --profile     # one GPU: Qwen3-4B's shape, every plan (~8 min)
    python -m benchmarks.megatron_plan --shape tiny --out DIR  # a CPU, tiny model (what the test runs)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks import common

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30
GROUPS = ("stage1", "stage1-fused", "stage0")
# Each group's plans, in the order they run: (recompute, micro-batch sizes in sequences, offload kept for these sizes
# only: the others run once more with the optimizer on the GPU). Within a recompute the sizes grow; the first out of
# memory ends them.
PLANS = {
    "stage1": [("full", (1, 2, 3, 4), (4,)), ("selective", (1, 2, 3, 4), ()), ("off", (1, 2, 3), (1,))],
    "stage1-fused": [("full", (4, 8), ()), ("selective", (2, 4), ()), ("off", (1, 2, 3), (2,))],
    "stage0": [("full", (1, 2, 3, 4), (4,)), ("selective", (1, 2, 3, 4), ()), ("off", (1, 2, 3), ())],
}
# --quick: the last stage's plans of one short run (the first stage and the fused kernels left out)
QUICK = {"stage1": [("full", (1, 2, 4), (4,)), ("selective", (2, 4), ()), ("off", (1, 2), ())]}
# The plans the profile runs (--profile): the default's, on verl's logits and on its fused kernels.
PROFILED = {("stage1", "full", 4, True), ("stage1-fused", "full", 4, True)}
UPDATE_SEQUENCES = 8  # sequences per measured update (9 where a micro-batch holds 3, so that each is full)


# The public Qwen3-4B config's dimensions; the tiny shape for the CPU.
SHAPES = {k: common.SHAPES[k] for k in ("qwen3-4b", "tiny")}
# Dense bf16 peak of the cards the benchmarks ran on, TFLOP/s (NVIDIA's data sheets, without sparsity): H100 SXM and
# H200 share the H100's tensor cores and clocks.
DENSE_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}


# --- the model ----------------------------------------------------------------------------------------------------


def build_policy(shape: str, layers: int, out: Path, device: str) -> dict:
    """A Qwen3 checkpoint of SHAPES[shape] with `layers` layers, random weights (bf16 on a GPU), tied embeddings as
    Qwen3-4B's, and the benchmarks' word-level tokenizer padded to the vocabulary."""
    tokenizer = common.build_tokenizer(SHAPES[shape]["vocab_size"])
    dims = SHAPES[shape] | {"num_hidden_layers": layers}
    model = common.random_policy(dims, tokenizer, device)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return {"params": sum(p.numel() for p in model.parameters()), **dims}


# --- the worker, the job's own -----------------------------------------------------------------------------------


def worker_config(policy: Path, fused: bool, lengths: tuple[int, int] | None, on_gpu: bool):
    """verl's trainer config as the job composes it (launch/plan/trainer_command.py) for the settings block's defaults
    on this machine's one GPU, one pipeline stage, the reference plan (full recompute, 4 x 6144 tokens, the optimizer
    offloaded; run_group changes them plan by plan) and, where given, the lengths."""
    from benchmarks.common import block_defaults
    from launch.plan.preflight import compose, split_command
    from launch.plan.settings import Settings
    from launch.plan.trainer_command import trainer_argv

    env = block_defaults(str(REPO)) | {
        "CONTAINER": "none",
        "CONFIG_MODEL_PATH": str(policy),
        "CONFIG_REWARD_MODEL_PATH": str(policy),
        "CONFIG_TRAIN_FILE": "train.parquet",
        "CONFIG_TEST_FILE": "test.parquet",
        "CONFIG_OUTPUT_DIR": "ckpt",
        "CONFIG_GPUS_PER_NODE": "1",
        "STRATEGY": "megatron",
        "ACTOR_PP": "1",
        "ACTOR_TP": "1",
        "MEGATRON_RECOMPUTE": "full",
        "FUSED_KERNELS": "off",  # the fused group adds verl's own key below: a tied one-stage policy blocks the knob
        "OPTIMIZER_OFFLOAD": "on",
        "MICRO_BATCH_PER_GPU": "4",
    }
    if lengths:
        env |= {"MAX_PROMPT_LENGTH": str(lengths[0]), "MAX_RESPONSE_LENGTH": str(lengths[1])}
    extra = [] if on_gpu else __import__("cpu.megatron_shims", fromlist=["overrides"]).overrides()
    extra += ["actor_rollout_ref.model.use_fused_kernels=True"] if fused else []
    s = Settings.from_env(env)
    _, path, name, overrides = split_command(trainer_argv(s, extra=extra))
    cfg = compose(name, [*overrides, "actor_rollout_ref.actor.optim.total_training_steps=1"], path)
    return cfg, s


def full_length_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0) -> dict:
    """Rows of prompt + response tokens with no padding: each micro-batch holds exactly the token budget."""
    import torch

    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(10, vocab, (rows, prompt + response), generator=g)
    attention_mask = torch.ones_like(input_ids)
    position_ids = torch.arange(prompt + response).expand(rows, -1).clone()
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        responses=input_ids[:, prompt:],
        response_mask=attention_mask[:, prompt:],
    )


@contextlib.contextmanager
def meter(device: str):
    """A phase's seconds and, on a GPU, torch's peak allocated and reserved (its counters reset at the phase's start)
    and the device's used memory (cudaMemGetInfo: this process's CUDA context, cuBLAS and NCCL workspaces and torch's
    reserved pool together, as nvidia-smi counts it) sampled every 20 ms: the dict it yields, filled at the end."""
    import torch

    record, c, cuda = {}, torch.cuda, device == "cuda"
    device_peak, stop = [0], threading.Event()

    def sample() -> None:
        while True:
            free, total = c.mem_get_info()
            device_peak[0] = max(device_peak[0], total - free)
            if stop.wait(0.02):
                return

    if cuda:
        c.synchronize()
        c.reset_peak_memory_stats()
        before = c.memory_allocated()
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
    began = time.monotonic()
    yield record
    if cuda:
        c.synchronize()
        stop.set()
        sampler.join()
    record["seconds"] = round(time.monotonic() - began, 3)
    if cuda:
        record |= {
            "allocated_before_gib": before / GIB,
            "peak_allocated_gib": c.max_memory_allocated() / GIB,
            "peak_reserved_gib": c.max_memory_reserved() / GIB,
            "allocated_after_gib": c.memory_allocated() / GIB,
            "peak_device_used_gib": device_peak[0] / GIB,
            "outside_torch_gib": (device_peak[0] - c.max_memory_reserved()) / GIB,
        }


def case_worker(cfg, on_gpu: bool, fused: bool):
    """verl's Megatron actor worker for one case, on this process's one rank, with the shims this machine needs."""
    from launch.plan.procs import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    from cpu import megatron_shims

    megatron_shims.install_without_te() if on_gpu else megatron_shims.install()
    if on_gpu and fused:  # one stage with tied embeddings: the kernel gets the weight a PP=2 last stage holds
        from benchmarks.verl_step_hook import fused_forward_reads_the_tied_weight

        fused_forward_reads_the_tied_weight()
    from verl.workers.megatron_workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    # A job's worker is the hybrid actor_rollout, which alone reads the offload settings (megatron_workers.py:272-283:
    # role "actor" keeps everything on the GPU); this one holds no rollout engine, so they are set as that branch does
    megatron = worker.config.actor.megatron
    worker._is_offload_param = megatron.get("param_offload", False)
    worker._is_offload_grad = megatron.get("grad_offload", False)
    worker._is_offload_optimizer = megatron.get("optimizer_offload", False)
    return worker


def policy_once(shape: str, reuse: bool, policy: Path, layers: int, device: str) -> dict:
    """The random-weight policy, built in a process of its own (or kept from --work with --reuse-policy): its shape."""
    began = time.monotonic()
    build = [
        sys.executable,
        "-c",
        f"import json, sys; from pathlib import Path; from benchmarks.megatron_plan import build_policy; "
        f"print(json.dumps(build_policy({shape!r}, {layers}, Path({str(policy)!r}), {device!r})))",
    ]
    built_json = policy.parent / "policy.json"
    if not (reuse and built_json.exists()):
        built = subprocess.run(build, cwd=REPO, capture_output=True, text=True, check=False)
        if built.returncode:
            raise SystemExit(f"building the policy failed:\n{built.stderr[-3000:]}")
        built_json.write_text(built.stdout.strip().splitlines()[-1])
    return json.loads(built_json.read_text()) | {"build_s": round(time.monotonic() - began, 1)}


@dataclass(frozen=True)
class Plan:
    stage: str
    fused: bool
    recompute: str
    optimizer_offload: bool
    micro_batch_tokens: int


def group_plans(group: str, sequence: int, on_gpu: bool, quick: bool = False) -> list[tuple[str, list[Plan]]]:
    """The group's plans, one list per recompute family (on a CPU, micro-batches of one and two sequences)."""
    stage, fused = group.split("-")[0], group.endswith("fused")
    families = []
    for recompute, sizes, on_gpu_sizes in (QUICK if quick else PLANS)[group]:
        sizes = sizes if on_gpu else tuple(k for k in sizes if k <= 2)
        plans = []
        for k in sizes:
            plans.append(Plan(stage, fused, recompute, True, k * sequence))
            if k in on_gpu_sizes or not on_gpu:
                plans.append(Plan(stage, fused, recompute, False, k * sequence))
        families.append((recompute, plans))
    return families


# --- timing what an update_actor call pays once ---------------------------------------------------------------------


# What an update_actor call pays once, beside its micro-batches; gc.collect runs inside the offload and the cleanup.
FIXED = ("optimizer load", "optimizer offload", "optimizer step", "empty cache")


class Phases:
    """Seconds of each of FIXED and of gc.collect in the calls made while active (each wrapped with a device sync on
    both sides, so its GPU work is its own)."""

    def __init__(self, worker, device: str) -> None:
        import torch
        from verl.workers import megatron_workers

        self.seconds: dict[str, float] = {}
        self.sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
        self.targets = [
            (megatron_workers, "load_megatron_optimizer", "optimizer load"),
            (megatron_workers, "offload_megatron_optimizer", "optimizer offload"),
            (megatron_workers, "aggressive_empty_cache", "empty cache"),
            (worker.actor.actor_optimizer, "step", "optimizer step"),
            (gc, "collect", "gc.collect"),
        ]

    def _timed(self, name: str, function):
        def call(*args, **kwargs):
            self.sync()
            began = time.perf_counter()
            result = function(*args, **kwargs)
            self.sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - began
            return result

        return call

    @contextlib.contextmanager
    def active(self):
        saved = [(owner, attr, getattr(owner, attr)) for owner, attr, _ in self.targets]
        for owner, attr, name in self.targets:
            setattr(owner, attr, self._timed(name, getattr(owner, attr)))
        try:
            yield self.seconds
        finally:
            for owner, attr, original in saved:
                setattr(owner, attr, original)


# --- the plan's knobs on a built worker ------------------------------------------------------------------------------


def apply(worker, plan: Plan) -> None:
    """Set the plan on the worker: recompute on megatron-core's config and attention layers, the token budget, and
    the optimizer where the plan keeps it (loaded to the GPU now, or sent back)."""
    from verl.utils.megatron_utils import load_megatron_optimizer, offload_megatron_optimizer, unwrap_model

    gpt = unwrap_model(worker.actor_module[0])
    config = gpt.config
    config.recompute_granularity = {"full": "full", "selective": "selective", "off": None}[plan.recompute]
    for layer in gpt.decoder.layers:
        layer.self_attention.checkpoint_core_attention = plan.recompute == "selective"
    object.__setattr__(worker.actor.config, "ppo_max_token_len_per_gpu", plan.micro_batch_tokens)  # a frozen field
    if worker._is_offload_optimizer and not plan.optimizer_offload:
        load_megatron_optimizer(worker.actor_optimizer)
    elif not worker._is_offload_optimizer and plan.optimizer_offload:
        offload_megatron_optimizer(worker.actor_optimizer)
    worker._is_offload_optimizer = plan.optimizer_offload


def stage1_update(worker, batch: dict, rows: int):
    """One update_actor call of `rows` full sequences, one mini-batch (every micro-batch, then one step)."""
    import torch
    from verl import DataProto

    sign = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0)[:, None]
    tensors = {k: v[:rows] for k, v in batch.items()}
    old = torch.zeros(rows, tensors["responses"].shape[1])
    tensors |= dict(old_log_probs=old, ref_log_prob=old, advantages=sign * tensors["response_mask"].float())
    worker.config.actor.ppo_mini_batch_size = worker.actor.config.ppo_mini_batch_size = rows
    meta = {"temperature": 1.0, "global_token_num": tensors["attention_mask"].sum(-1).tolist()}
    worker.update_actor(DataProto.from_dict(tensors=tensors, meta_info=meta))


def stage0_update(worker, batch: dict, rows: int, plan: Plan, device: str):
    """The first stage's update as 1F1B runs it (two micro-batches in flight, random gradients for the next stage's,
    benchmarks/megatron_memory.py until 07cac6f), then verl's optimizer handling as update_actor does it."""
    import torch
    from verl.models.mcore.util import preprocess_packed_seqs
    from verl.workers import megatron_workers

    model = worker.actor_module[0]
    per_micro = plan.micro_batch_tokens // batch["input_ids"].shape[1]

    def forward(i: int):
        part = slice(i * per_micro, (i + 1) * per_micro)
        ids, mask, pos = (batch[k][part].to(device) for k in ("input_ids", "attention_mask", "position_ids"))
        packed, params = preprocess_packed_seqs(ids, mask, pre_process=True)
        return model(input_ids=packed.contiguous(), attention_mask=None, position_ids=pos, packed_seq_params=params)

    if worker._is_offload_optimizer:
        megatron_workers.load_megatron_optimizer(worker.actor_optimizer)
    outs = []
    for i in range(rows // per_micro):
        outs.append(forward(i))
        if len(outs) == 2 or i == rows // per_micro - 1:
            torch.autograd.backward(outs[0], torch.randn_like(outs[0]) * 1e-3)
            del outs[0]
    while outs:
        torch.autograd.backward(outs[0], torch.randn_like(outs[0]) * 1e-3)
        del outs[0]
    worker.actor.actor_optimizer.step()
    worker.actor_optimizer.zero_grad()
    model.zero_grad_buffer()
    if worker._is_offload_optimizer:
        megatron_workers.offload_megatron_optimizer(worker.actor_optimizer)
    megatron_workers.aggressive_empty_cache(force_sync=True)


# --- the profile: one update's GPU time by kind ---------------------------------------------------------------------


def profiled(update, device: str) -> dict:
    """One update under torch.profiler: its GPU time by kernel kind and the GPU's idle time (the wall less the union of
    its kernels), benchmarks/verl_step_hook.profile_summary. Recompute is no kernel kind: the table has it as the
    difference between the recompute plans at one micro-batch size."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.verl_step_hook import profile_summary

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        began = time.perf_counter()
        update()
        torch.cuda.synchronize() if device == "cuda" else None
        wall = time.perf_counter() - began
    return profile_summary(prof, wall)


# --- one group, in its own process ----------------------------------------------------------------------------------


def run_group(group: str, policy: Path, out: Path, lengths, profile: bool, quick: bool = False) -> None:
    """Every plan of `group` on one worker; `out` (JSON lines) gets a record as each plan ends."""
    import torch

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    fused = group.endswith("fused")
    cfg, s = worker_config(policy, fused, lengths, on_gpu)
    worker = case_worker(cfg, on_gpu, fused)
    with meter(device) as m:
        worker.init_model()
    from verl.utils.megatron_utils import unwrap_model

    worker.actor_module[0].train()
    gpt = unwrap_model(worker.actor_module[0])
    sequence = s.max_prompt_length + s.max_response_length
    stage = group.split("-")[0]
    if stage == "stage0":
        gpt.post_process = False  # megatron-core's first-stage GPTModel: the decoder's hidden states out
    batch = full_length_batch(3 * UPDATE_SEQUENCES, s.max_prompt_length, s.max_response_length, gpt.vocab_size)
    with out.open("a") as f:
        f.write(json.dumps({"group": group, "init": m, "sequence": sequence}) + "\n")
    warm = True
    families = group_plans(group, sequence, on_gpu, quick)
    if group == "stage1":  # the first plan again with Python's heap frozen (gc.freeze): what gc.collect costs an update
        families.append(("gc.freeze", [families[0][1][0]]))
    for family, plans in families:
        if family == "gc.freeze":
            gc.freeze()
        for plan in plans:
            k = plan.micro_batch_tokens // sequence
            rows = UPDATE_SEQUENCES if UPDATE_SEQUENCES % k == 0 else 3 * k
            record = {**asdict(plan), "tokens_per_update": rows * sequence, "gc_frozen": family == "gc.freeze"}
            try:
                apply(worker, plan)

                if stage == "stage1":
                    update = functools.partial(stage1_update, worker, batch, rows)
                else:
                    update = functools.partial(stage0_update, worker, batch, rows, plan, device)
                if warm:
                    update()  # the group's first update: Adam's state, cuBLAS's and Triton's first calls
                    warm = False
                phases = Phases(worker, device)
                with phases.active() as seconds, meter(device) as m:
                    update()
                record |= {"status": "ok", "measured": m, "phases": dict(seconds)}
                if profile and (group, plan.recompute, k, plan.optimizer_offload) in PROFILED:
                    try:
                        record["profile"] = profiled(update, device)
                    except Exception as exc:  # the plan's figures stand; the profile says why it is missing
                        record["profile_error"] = f"{type(exc).__name__}: {exc}"
            except torch.OutOfMemoryError as exc:
                record |= {"status": "out of memory", "error": str(exc).splitlines()[0][:300]}
                warm = True
            finally:
                worker.actor_optimizer.zero_grad()
                gc.collect()
                torch.cuda.empty_cache() if on_gpu else None
            with out.open("a") as f:
                f.write(json.dumps(record) + "\n")
            print(f"[megatron_plan] {group} {plan}: {record['status']}", flush=True)
            if record["status"] != "ok":
                break  # the larger micro-batches of this recompute hold more


# --- the driver -----------------------------------------------------------------------------------------------------


def stage_params(dims, stage: str) -> int:
    """The stage's matmul weights: its layers, and on stage 1 the output layer (the logits' matmul)."""
    return dims.layers * dims.layer_params + (dims.vocab * dims.hidden if stage == "stage1" else 0)


def finish(record: dict, dims, peak_tflops: float | None) -> dict:
    """A plan's figures: its peak, the forward-backward rate (the update less what it pays once), and utilisation."""
    if record.get("status") != "ok":
        return record
    m, phases = record["measured"], record["phases"]
    fixed = sum(v for k, v in phases.items() if k in FIXED)
    compute = m["seconds"] - fixed
    tokens = record["tokens_per_update"]
    flops = 6 * stage_params(dims, record["stage"]) * tokens
    record |= {
        "peak_allocated_gib": round(m.get("peak_allocated_gib", 0.0), 2),
        "update_seconds": m["seconds"],
        "fixed_seconds": round(fixed, 3),
        "seconds_per_1k_tokens": round(1000 * compute / tokens, 5),
        "mfu": round(flops / compute / 1e12 / peak_tflops, 3) if peak_tflops else None,
        "update_mfu": round(flops / m["seconds"] / 1e12 / peak_tflops, 3) if peak_tflops else None,
    }
    return record


def predicted_gib(record: dict, dims) -> float:
    """launch/plan/gpu_memory.py's peak for the plan's one-GPU stage (every layer of the half model, DP=1)."""
    from launch.plan.stage_memory import stage_memory

    last = record["stage"] == "stage1"
    kwargs = dict(stage=0, stages=1, tp=1, dp=1, micro_batches=2, reference_on_gpu=False, in_flight=1 if last else 2)
    tokens, recompute, fused = record["micro_batch_tokens"], record["recompute"], record["fused"]
    plan = stage_memory(dims, tokens=tokens, recompute=recompute, fused_logits=fused, last=last, **kwargs)
    return round(plan.total / GIB, 2)


def run_group_process(group: str, args, policy: Path, work: Path) -> list[dict]:
    lines = work / f"{group}.jsonl"
    lines.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "benchmarks.megatron_plan", "--group", group, "--policy", str(policy)]
    cmd += ["--group-out", str(lines)] + (["--profile"] if args.profile else []) + (["--quick"] if args.quick else [])
    cmd += ["--lengths", args.lengths] if args.lengths else []
    with open(args.out / f"{group}.log", "w") as log:
        try:
            rc = subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=args.group_timeout)
            status = rc.returncode
        except subprocess.TimeoutExpired:
            status = "timeout"
    records = [json.loads(x) for x in lines.read_text().splitlines()] if lines.exists() else []
    if status != 0:
        records.append({"group": group, "status": f"the group's process ended: {status} (see {group}.log)"})
    return records


def table(records: list[dict]) -> str:
    """One line a plan: stage, fused, recompute, offloaded, micro-batch tokens, GiB, s per 1k tokens, MFU, status."""
    keys = ("stage", "fused", "recompute", "optimizer_offload", "micro_batch_tokens", "peak_allocated_gib")
    keys += ("seconds_per_1k_tokens", "mfu", "status")
    return "\n".join("  ".join(str(r.get(k, "-")) for k in keys) for r in records)


def product_table(result: dict) -> dict:
    """What launch/plan/megatron_plan.py's table holds of a result: each stage's seconds per 1,000 tokens of the plans
    that ran (the optimizer offloaded, the heap not frozen), and the offload's copies per update (their median)."""
    sequence = next(g[0]["sequence"] for g in result["groups"].values() if g and "sequence" in g[0])
    last, first, copies = {}, {}, []
    for r in result["plans"]:
        if r["status"] != "ok" or r.get("gc_frozen"):
            continue
        k = r["micro_batch_tokens"] // sequence
        if r["optimizer_offload"]:
            copies.append(r["phases"].get("optimizer load", 0.0) + r["phases"].get("optimizer offload", 0.0))
            if r["stage"] == "stage1":
                last[(r["fused"], r["recompute"], k)] = r["seconds_per_1k_tokens"]
            else:
                first[(r["recompute"], k)] = r["seconds_per_1k_tokens"]
    copies.sort()
    return {
        "LAST_STAGE": last,
        "FIRST_STAGE": first,
        "OFFLOAD_SECONDS": round(copies[len(copies) // 2], 2) if copies else 0.0,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--out", type=Path, help="folder for megatron_plan.json and each group's log")
    parser.add_argument("--work", type=Path, help="folder for the checkpoint (default: a temporary one; 4.4 GB)")
    parser.add_argument("--groups", default="", help=f"comma-separated, of {', '.join(GROUPS)} (default: all)")
    parser.add_argument("--lengths", default="", help="PROMPT,RESPONSE tokens (default: the settings block's)")
    parser.add_argument("--profile", action="store_true", help="profile the default plan's update, logits and fused")
    parser.add_argument("--group-timeout", type=float, default=400)
    parser.add_argument("--quick", action="store_true", help="the last stage's logits plans alone, fewer sizes")
    parser.add_argument("--reuse-policy", action="store_true", help="keep --work's policy when it is there")
    parser.add_argument("--group", help=argparse.SUPPRESS)
    parser.add_argument("--group-out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--policy", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else None
    if args.group:
        run_group(args.group, args.policy, args.group_out, lengths, args.profile, args.quick)
        return 0
    if args.out is None:
        parser.error("--out is required")
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    groups = list(filter(None, args.groups.split(","))) or [g for g in GROUPS if device == "cuda" or "fused" not in g]
    groups = [g for g in groups if g in QUICK] if args.quick else groups
    if unknown := [g for g in groups if g not in GROUPS]:
        parser.error(f"--groups: {', '.join(unknown)} unknown; use {', '.join(GROUPS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="megatron_plan_"))
    work.mkdir(parents=True, exist_ok=True)
    layers = SHAPES[args.shape]["num_hidden_layers"] // 2  # one PP=2 stage
    result = {
        "command": common.command_line("benchmarks.megatron_plan", argv),
        "shape": args.shape,
        "layers": layers,
        **common.machine_info(device),
        "policy": policy_once(args.shape, args.reuse_policy, work / "policy", layers, device),
        "plans": [],
        "groups": {},
    }
    peak = next((v for k, v in DENSE_BF16_TFLOPS.items() if k in (result.get("gpu") or "")), None)
    result["dense_bf16_peak_tflops"] = peak
    out_file = args.out / "megatron_plan.json"
    from transformers import AutoConfig

    from launch.plan.stage_memory import ModelDims

    dims = ModelDims.from_config(AutoConfig.from_pretrained(work / "policy"))
    for group in groups:
        for record in run_group_process(group, args, work / "policy", work):
            if "stage" in record:
                record = finish(record, dims, peak)
                record["predicted_gib"] = predicted_gib(record, dims)
                result["plans"].append(record)
            else:
                result["groups"].setdefault(group, []).append(record)
        common.write_json(out_file, result)
    print(table(result["plans"]))
    for r in result["plans"]:
        if "profile" in r:
            p = r["profile"]
            rows = ", ".join(f"{k} {v:.3f}" for k, v in (p["by_kind_s"] | {"GPU idle": p["gpu_idle_s"]}).items())
            print(f"[megatron_plan] profile {r['stage']} fused={r['fused']}: {p['wall_s']:.2f} s: {rows}")
    print(f"[megatron_plan] wrote {out_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
