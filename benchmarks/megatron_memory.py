"""verl 0.6.1's Megatron actor at Qwen3-4B's shape on one GPU: what the update and the log-prob pass hold, per
pipeline stage, measured through verl's own worker, beside what the preflight predicts (launch/plan/gpu_memory.py).

Each case runs in its own process: verl's `ActorRolloutRefWorker(role="actor")` built from the job's own trainer
config (launch.plan.trainer_command.trainer_argv for the settings block's defaults: bf16, optimizer offload, micro-batches of
Settings.token_budget tokens, MEGATRON_RECOMPUTE as the case says), `init_model` on a random-weight Qwen3 checkpoint of the
public config's dimensions, then:
- `stage1` (the last stage of the default PP=2: half the layers, the output layer and the logits, one micro-batch in
  flight under 1F1B): `compute_log_prob` (entropy on, as the worker asks) and `update_actor` twice, on full-length
  sequences that fill whole micro-batches.
- `stage0` (the first stage: half the layers and the embedding, two micro-batches in flight under 1F1B,
  pipeline_parallel/schedules.py:1818-1823): the same model with `post_process` off (megatron-core's first-stage
  GPTModel: it returns the last layer's hidden states), two micro-batches forward through verl's own packing
  (preprocess_packed_seqs), then both backward with random gradients in place of the next stage's, then the optimizer
  step, after loading the optimizer back as update_actor does. One GPU holds one pipeline rank, so the stage is built
  alone, and what PP adds on the wire (p2p buffers of [tokens, hidden]) is not in it.
For each phase: torch's peak allocated and reserved (reset at the phase's start) and seconds.

On a GPU without Transformer Engine (the H200 here) the layer spec is demo/megatron_cpu.py's TE-shaped one
(install_without_te): TE's structure and names, torch's fused RMSNorm and SDPA (flash) in place of TE's kernels.
On a CPU (`--shape tiny`) all of demo/megatron_cpu.py's shims: the tests run it that way.

    python -m benchmarks.megatron_memory --out DIR                         # one H200: Qwen3-4B's shape, every case
    python -m benchmarks.megatron_memory --shape tiny --out DIR            # a CPU, tiny model (what the test runs)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import common

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30

# The public Qwen3-4B config's dimensions; the tiny shape for the CPU.
SHAPES = {k: common.SHAPES[k] for k in ("qwen3-4b", "tiny")}
# stage, MEGATRON_RECOMPUTE, and "-fused": verl's fused log-prob kernels (actor_rollout_ref.model.use_fused_kernels,
# verl/models/mcore/model_forward_fused.py: log-probs and entropy from the hidden states, no [tokens, vocab] logits;
# Triton, so a GPU only)
CASES = ("stage1-off", "stage1-full", "stage1-full-fused", "stage0-full", "stage0-off")
MICRO_BATCHES = 2  # per update, full ones: stage 0 keeps two in flight


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


# --- one case, in its own process -----------------------------------------------------------------------------------


def case_settings(policy: Path, recompute: str, lengths: tuple[int, int] | None, micro: int = 0) -> dict[str, str]:
    """The settings block's defaults, with this machine's one GPU, the case's recompute and, where given, lengths and
    MICRO_BATCH_PER_GPU (the token budget)."""
    from benchmarks.common import block_defaults

    return block_defaults(str(REPO)) | {
        "CONTAINER": "none", "CONFIG_MODEL_PATH": str(policy), "CONFIG_REWARD_MODEL_PATH": str(policy),
        "CONFIG_TRAIN_FILE": "train.parquet", "CONFIG_TEST_FILE": "test.parquet", "CONFIG_OUTPUT_DIR": "ckpt",
        "CONFIG_GPUS_PER_NODE": "1", "STRATEGY": "megatron", "ACTOR_PP": "1", "ACTOR_TP": "1",
        "MEGATRON_RECOMPUTE": recompute, "FUSED_KERNELS": "off", "OPTIMIZER_OFFLOAD": "on",
    } | ({"MAX_PROMPT_LENGTH": str(lengths[0]), "MAX_RESPONSE_LENGTH": str(lengths[1])} if lengths else {}) | (
        {"MICRO_BATCH_PER_GPU": str(micro or 4)})  # fmt: skip


def worker_config(policy: Path, recompute: str, fused: bool, lengths, on_gpu: bool, micro: int = 0):
    from launch.plan.preflight import compose, split_command
    from launch.plan.settings import Settings
    from launch.plan.trainer_command import trainer_argv

    extra = [] if on_gpu else __import__("demo.megatron_cpu", fromlist=["overrides"]).overrides()
    s = Settings.from_env(case_settings(policy, recompute, lengths, micro))
    extra += ["actor_rollout_ref.model.use_fused_kernels=True"] if fused else []
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
    return dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                responses=input_ids[:, prompt:], response_mask=attention_mask[:, prompt:])  # fmt: skip


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
        record |= {"allocated_before_gib": before / GIB, "peak_allocated_gib": c.max_memory_allocated() / GIB,
                   "peak_reserved_gib": c.max_memory_reserved() / GIB, "allocated_after_gib": c.memory_allocated() / GIB,
                   "peak_device_used_gib": device_peak[0] / GIB,
                   "outside_torch_gib": (device_peak[0] - c.max_memory_reserved()) / GIB}  # fmt: skip


def case_worker(cfg, on_gpu: bool, fused: bool):
    """verl's Megatron actor worker for one case, on this process's one rank, with the shims this machine needs."""
    from launch.plan.procs import free_port

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    from demo import megatron_cpu

    megatron_cpu.install_without_te() if on_gpu else megatron_cpu.install()
    if on_gpu and fused:  # one stage with tied embeddings: the kernel gets the weight a PP=2 last stage holds
        from benchmarks.verl_step_hook import fused_forward_reads_the_tied_weight

        fused_forward_reads_the_tied_weight()
    if on_gpu:  # the flash kernel or an error: a silent fall back to SDPA's math kernel would keep every score
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa_kernel([SDPBackend.FLASH_ATTENTION]).__enter__()
    from verl.workers.megatron_workers import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker(config=cfg.actor_rollout_ref, role="actor")
    # A job's worker is the hybrid actor_rollout, which alone reads the offload settings (megatron_workers.py:272-283:
    # role "actor" keeps everything on the GPU); this one holds no rollout engine, so they are set as that branch does
    megatron = worker.config.actor.megatron
    worker._is_offload_param = megatron.get("param_offload", False)
    worker._is_offload_grad = megatron.get("grad_offload", False)
    worker._is_offload_optimizer = megatron.get("optimizer_offload", False)
    return worker


def run_case(case: str, policy: Path, out: Path, lengths, micro: int = 0) -> None:
    """One case in this process: build the worker (timed), then the stage's phases;
    `out` is rewritten after each step, so a case that dies keeps what it measured."""
    stage, recompute, *fused = case.split("-")
    import torch

    on_gpu = torch.cuda.is_available()
    device = "cuda" if on_gpu else "cpu"
    cfg, s = worker_config(policy, recompute, bool(fused), lengths, on_gpu, micro)
    worker = case_worker(cfg, on_gpu, bool(fused))
    from verl.models.mcore.util import preprocess_packed_seqs
    from verl.utils.megatron_utils import unwrap_model

    tokens = s.token_budget
    sequence = s.max_prompt_length + s.max_response_length
    per_micro = tokens // sequence
    rows = per_micro * MICRO_BATCHES
    result: dict = {"case": case, "stage": stage, "recompute": recompute, "fused": bool(fused), "token_budget": tokens,
                    "sequence": sequence, "rows": rows, "micro_batches": MICRO_BATCHES}  # fmt: skip

    def write():
        out.write_text(json.dumps(result, indent=1))

    with meter(device) as m:
        worker.init_model()
    result["init"] = m
    tf = worker.tf_config
    result["transformer_config"] = {k: str(getattr(tf, k, None)) for k in
                                    ("recompute_granularity", "recompute_method", "recompute_num_layers",
                                     "num_layers", "bf16", "params_dtype")}  # fmt: skip
    write()
    model = worker.actor_module[0]
    gpt = unwrap_model(model)
    batch = full_length_batch(rows, s.max_prompt_length, s.max_response_length, gpt.vocab_size)

    def forward(i: int):
        rows_i = slice(i * per_micro, (i + 1) * per_micro)
        ids, mask, pos = (batch[k][rows_i].to(device) for k in ("input_ids", "attention_mask", "position_ids"))
        packed, params = preprocess_packed_seqs(ids, mask, pre_process=True)
        return lambda: model(input_ids=packed.contiguous(), attention_mask=None, position_ids=pos,
                             packed_seq_params=params)  # fmt: skip

    if stage == "stage0":
        gpt.post_process = False  # megatron-core's first-stage GPTModel: the decoder's hidden states out
    model.train()
    if stage == "stage1":
        measure_last_stage(worker, batch, rows, device, result, write)
    else:
        measure_first_stage(worker, [forward(i) for i in range(MICRO_BATCHES)], device, result, write)
    result["status"] = "ok"
    write()


def measure_last_stage(worker, batch: dict, rows: int, device: str, result: dict, write) -> None:
    """stage1: verl's own log-prob pass, then two updates of one mini-batch (every micro-batch, then one step)."""
    import torch
    from verl import DataProto

    data = DataProto.from_dict(tensors=batch, meta_info={})
    with meter(device) as m:
        old = worker.compute_log_prob(data).batch["old_log_probs"]
    result["log_prob"] = m
    write()
    sign = torch.where(torch.arange(rows) % 2 == 0, 1.0, -1.0)[:, None]
    tensors = batch | dict(old_log_probs=old, ref_log_prob=old, advantages=sign * batch["response_mask"].float())
    # one mini-batch: every micro-batch, then one step (the actor keeps its own copy of the config)
    worker.config.actor.ppo_mini_batch_size = worker.actor.config.ppo_mini_batch_size = rows
    result["update"] = []
    for _ in range(2):
        meta = {"temperature": 1.0, "global_token_num": tensors["attention_mask"].sum(-1).tolist()}
        with meter(device) as m:
            metrics = worker.update_actor(DataProto.from_dict(tensors=dict(tensors), meta_info=meta))
        metrics = metrics.meta_info["metrics"]
        result["update"].append(m | {
            "verl_max_memory_allocated_gb": metrics.get("perf/max_memory_allocated_gb"),
            "grad_norm": metrics.get("actor/grad_norm")})  # fmt: skip
        write()


def measure_first_stage(worker, forwards: list, device: str, result: dict, write) -> None:
    """stage0: twice, the micro-batches' forwards and backwards as 1F1B runs them on the first stage (two in flight,
    random gradients for the next stage's), then the optimizer step, its optimizer loaded back as update_actor does."""
    import torch
    from verl.utils.megatron_utils import load_megatron_optimizer

    model = worker.actor_module[0]
    if worker._is_offload_optimizer:
        load_megatron_optimizer(worker.actor_optimizer)
    result["stage0"] = []
    for _ in range(2):
        with meter(device) as m:
            outs = [f() for f in forwards[:2]]  # two in flight
            torch.autograd.backward(outs[0], torch.randn_like(outs[0]) * 1e-3)
            del outs[0]
            for f in forwards[2:]:  # steady 1F1B: one forward, one backward
                outs.append(f())
                torch.autograd.backward(outs[0], torch.randn_like(outs[0]) * 1e-3)
                del outs[0]
            torch.autograd.backward(outs[0], torch.randn_like(outs[0]) * 1e-3)
            del outs
        record = m
        with meter(device) as m:
            worker.actor_optimizer.step()
            worker.actor_optimizer.zero_grad()
            model.zero_grad_buffer()
        result["stage0"].append(record | {"optimizer_step": m})
        write()


# --- measured against predicted --------------------------------------------------------------------------------------

# Dense bf16 peak of the cards the benchmarks ran on, TFLOP/s (NVIDIA's data sheets, without sparsity): H100 SXM and
# H200 share the H100's tensor cores and clocks.
DENSE_BF16_TFLOPS = {"H100 80GB HBM3": 989.4, "H100": 989.4, "H200": 989.4}


def utilisation(result: dict) -> dict:
    """Each stage-1 update's model-FLOPs utilisation: 6 x the stage's parameters x its tokens per second (the forward
    once and the backward twice; recompute's second forward and the logits' softmax not counted, as MFU is defined),
    over the card's dense bf16 peak. The seconds are the whole update_actor call: the optimizer's load from the host
    and its step included."""
    gpu = result.get("gpu") or ""
    peak = next((v for k, v in DENSE_BF16_TFLOPS.items() if k in gpu), None)
    policy = result["policy"]
    h, f, layers, vocab = (policy[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size"))
    q, kv = policy["num_attention_heads"] * policy["head_dim"], policy["num_key_value_heads"] * policy["head_dim"]
    params = layers * (h * (q + 2 * kv) + q * h + 3 * h * f) + vocab * h  # the matmuls' weights: layers and the head
    rows = {}
    for name, case in result["cases"].items():
        for i, update in enumerate(case.get("update") or []):
            tokens = case["token_budget"] * case["micro_batches"]
            flops = 6 * params * tokens / update["seconds"]
            rows[f"{name} update {i + 1}"] = {"tokens": tokens, "seconds": update["seconds"],
                                              "tflops": round(flops / 1e12, 1),
                                              "mfu": round(flops / 1e12 / peak, 3) if peak else None}  # fmt: skip
    return {"dense_bf16_peak_tflops": peak, "matmul_params": params, "updates": rows}


def predictions(result: dict) -> dict:
    """What launch/plan/gpu_memory.py predicts for each case that ran, beside its measured peaks (GiB): the update's peak
    (stage1: the larger of the two updates; stage0: the forward-backward of the two micro-batches in flight) and the
    log-prob pass's."""
    from launch.plan.gpu_memory import ModelDims, log_prob_stage, stage_memory

    policy = result["policy"]
    dims = ModelDims(policy["hidden_size"], policy["intermediate_size"],
                     policy["num_attention_heads"] * policy["head_dim"], policy["num_key_value_heads"] * policy["head_dim"],
                     policy["head_dim"], policy["num_hidden_layers"], policy["vocab_size"], True)  # fmt: skip
    rows = {}
    for name, case in result["cases"].items():
        if case.get("status") != "ok" and "token_budget" not in case:
            continue
        stage1 = case.get("stage", name.split("-")[0]) == "stage1"
        recompute = case.get("recompute", name.split("-")[1])
        fused = case.get("fused", "fused" in name)
        tokens = case["token_budget"]
        # the one-GPU model: every layer and the embedding (tied: one copy), DP=1, the stage's micro-batches in flight
        plan = stage_memory(dims, stage=0, stages=1, tp=1, dp=1, tokens=tokens, recompute=recompute, micro_batches=2,
                            reference_on_gpu=False, fused_logits=fused, in_flight=1 if stage1 else 2, last=stage1)  # fmt: skip
        row = {"predicted_update_gib": plan.total / GIB, "predicted": plan.describe()}
        updates = case.get("update") or case.get("stage0") or []
        peaks = [u["peak_allocated_gib"] for u in updates if "peak_allocated_gib" in u]
        if peaks:
            row["measured_update_gib"] = max(peaks)
            row["update_error"] = row["predicted_update_gib"] / row["measured_update_gib"] - 1
        if stage1:
            row["predicted_log_prob_gib"] = log_prob_stage(dims, stage=0, stages=1, tp=1, tokens=tokens,
                                                           fused_logits=fused).total / GIB  # fmt: skip
            if "peak_allocated_gib" in case.get("log_prob", {}):
                row["measured_log_prob_gib"] = case["log_prob"]["peak_allocated_gib"]
                row["log_prob_error"] = row["predicted_log_prob_gib"] / row["measured_log_prob_gib"] - 1
        rows[name] = row
    return rows


# --- the driver ---------------------------------------------------------------------------------------------------


def policy_once(args, policy: Path, layers: int, device: str) -> dict:
    """The random-weight policy, built in a process of its own (or kept from --work with --reuse-policy): its shape."""
    began = time.monotonic()
    build = [sys.executable, "-c", f"import json, sys; from pathlib import Path; from benchmarks.megatron_memory import build_policy; "
             f"print(json.dumps(build_policy({args.shape!r}, {layers}, Path({str(policy)!r}), {device!r})))"]  # fmt: skip
    built_json = policy.parent / "policy.json"
    if not (args.reuse_policy and built_json.exists()):
        built = subprocess.run(build, cwd=REPO, capture_output=True, text=True, check=False)
        if built.returncode:
            raise SystemExit(f"building the policy failed:\n{built.stderr[-3000:]}")
        built_json.write_text(built.stdout.strip().splitlines()[-1])
    return json.loads(built_json.read_text()) | {"build_s": round(time.monotonic() - began, 1)}


def case_in_process(case: str, args, policy: Path, work: Path) -> dict:
    """One case in a process of its own (its log in --out): what it measured, its status and its wall seconds."""
    case_file, log = work / f"{case}.json", args.out / f"{case}.log"
    cmd = [sys.executable, "-m", "benchmarks.megatron_memory", "--case", case, "--policy", str(policy),
           "--out", str(case_file)]  # fmt: skip
    cmd += ["--lengths", args.lengths] if args.lengths else []
    cmd += ["--micro-batch-per-gpu", str(args.micro_batch_per_gpu)] if args.micro_batch_per_gpu else []
    began = time.monotonic()
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, timeout=args.case_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    case_result = json.loads(case_file.read_text()) if case_file.exists() else {}
    if rc != 0:
        tail = log.read_text().splitlines()[-15:]
        oom = any("OutOfMemoryError" in line or "out of memory" in line for line in tail)
        case_result["status"] = ("out of memory: " if oom else f"failed ({rc}): ") + (tail[-1] if tail else "")
    case_result["wall_s"] = round(time.monotonic() - began, 1)
    return case_result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-4b")
    parser.add_argument("--out", type=Path, required=True, help="folder for result.json and each case's log")
    parser.add_argument("--work", type=Path, help="folder for the checkpoint and each case's own json (default: a "
                        "temporary one; the 4B-shaped half model is 4.4 GB)")  # fmt: skip
    parser.add_argument("--cases", default="", help=f"comma-separated, of {', '.join(CASES)} (default: all; "
                        "on a CPU all but the fused)")  # fmt: skip
    parser.add_argument("--case-timeout", type=float, default=300, help="seconds for each case's process")
    parser.add_argument("--lengths", default="", help="PROMPT,RESPONSE tokens (default: the settings block's)")
    parser.add_argument("--micro-batch-per-gpu", type=int, default=0, help="MICRO_BATCH_PER_GPU, the token budget's "
                        "multiplier (default: the settings block's)")  # fmt: skip
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--policy", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--reuse-policy", action="store_true", help="keep --work's policy when it is there")
    args = parser.parse_args(argv)
    lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else None
    if args.case:
        run_case(args.case, args.policy, args.out, lengths, args.micro_batch_per_gpu)
        return 0
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cases = list(filter(None, args.cases.split(","))) or [c for c in CASES if device == "cuda" or "fused" not in c]
    if unknown := [c for c in cases if c not in CASES]:
        parser.error(f"--cases: {', '.join(unknown)} unknown; use {', '.join(CASES)}")
    if device == "cpu" and any("fused" in c for c in cases):
        parser.error("--cases: the fused cases need a GPU (verl's fused log-prob kernels are Triton)")
    layers = SHAPES[args.shape]["num_hidden_layers"] // 2  # one PP=2 stage
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"command": common.command_line("benchmarks.megatron_memory", argv), "shape": args.shape,
                    "layers": layers, "device": device, **common.machine_info(device), "cases": {}}  # fmt: skip
    work = args.work or Path(tempfile.mkdtemp(prefix="megatron_memory_"))
    work.mkdir(parents=True, exist_ok=True)
    policy = work / "policy"
    result["policy"] = policy_once(args, policy, layers, device)
    results_file = args.out / "result.json"
    for case in cases:
        result["cases"][case] = case_in_process(case, args, policy, work)
        results_file.write_text(json.dumps(result, indent=1))
        print(f"[megatron_memory] {case}: {result['cases'][case].get('status')} in {result['cases'][case]['wall_s']} s",
              flush=True)  # fmt: skip
    result["predicted_vs_measured"] = predictions(result)
    result["utilisation"] = utilisation(result)
    results_file.write_text(json.dumps(result, indent=1))
    for name, row in result["predicted_vs_measured"].items():
        print(f"[megatron_memory] {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items() if isinstance(v, float)))
    print(f"[megatron_memory] wrote {results_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
