"""The user's own commands on one GPU: the canary through the run script's workstation mode, then the merge script.

    bash benchmarks/offline_gpu.sh run python3 -m benchmarks.gpu_canary --out DIR    # a GPU machine, no network

What runs is what a user types, on a machine without Slurm (README.md, step 5 and step 7):
1. `CONTAINER=none CANARY=1 CANARY_KEEP=1 FUSED_KERNELS=on bash run_grpo_qwen3_4b_mega_verl.sh` with the settings
   block's defaults but for one GPU, one pipeline stage and short lengths: its preflight (the GPU branch: the card's
   memory, the compute mode, the memory refusals against the real card), the reward server and verl 0.6.1's Megatron
   workers on the same GPU (the shared placement), verl's Triton fused log-prob kernels, NCCL, the canary's three
   stages: train 2 steps saving each, resume at step 2 and run step 3, merge_mcore_to_hf.sh and its numeric check.
2. `CONTAINER=none bash merge_mcore_to_hf.sh` on that checkpoint again, into a folder of its own.
3. `PREFLIGHT_ONLY=1` with a tied policy and FUSED_KERNELS=auto: the preflight's choice and its reason.
The models have random weights and the benchmarks' word-level tokenizer (benchmarks/common.py): a Qwen3-shaped
policy (Qwen3-0.6B's dimensions, POLICY_LAYERS layers, untied) and a Qwen3-0.6B-shaped sequence-classification reward
model; the data comes from `python -m data_prep.build`. One component cannot travel to a machine without network
access: SGLang. verl's HF rollout stands in for it (cpu/megatron_shims.py GPU_OVERRIDES, the one place), and the layers
are the TE-free spec the machine's missing Transformer Engine asks for. Nothing else is stood in.

The output folder gets result.json: the canary's summary table, the trainer command it ran, the merge's numeric
figure, the preflight's memory lines beside each process's peak (torch's allocated and reserved per verl phase, from
benchmarks/verl_step_hook.py's phase lines; NVML per process), and the tied policy's fused-kernels line; and the logs.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common import SHAPES, build_tokenizer, command_line, machine_info, random_model, write_json
from benchmarks.verl_step_parts import NvmlSampler, write_prompts

REPO = Path(__file__).resolve().parent.parent
POLICY_LAYERS = 12
# The job's settings for one GPU: the block's defaults but these (the canary shrinks the batch itself)
SETTINGS = {
    "CONTAINER": "none",
    "CONFIG_GPUS_PER_NODE": "1",
    "ACTOR_PP": "1",
    "MAX_PROMPT_LENGTH": "256",
    "MAX_RESPONSE_LENGTH": "128",
    "EXPERIMENT_NAME": "gpu_canary",
    "ACTOR_LR": "1e-3",  # a random policy's bf16 weights move in 3 steps: the merge's check tells one step from another
    "MERGER_LAUNCHER": str(REPO / "demo" / "megatron_merger"),  # verl's merger with the TE-free layers
    "CPU_RUN_THEN_HOOK": "benchmarks.gpu_canary.measure_phases",
}
MEMORY_LINE = re.compile(r"^preflight: (GPU memory per GPU|Megatron update per GPU|Megatron log-prob passes per GPU).*")


def measure_phases() -> None:
    """The Ray workers' further hook (CPU_RUN_THEN_HOOK, after the GPU hook's registration): each verl phase's peak
    memory printed (benchmarks/verl_step_hook.py); the job's own hook (launch/job/preempt.py) runs around both."""
    from benchmarks.verl_step_hook import _measure_phases

    _measure_phases("megatron_workers")


def build_models(work: Path, device: str) -> dict:
    """The untied and the tied policy and the reward model, with random weights and one tokenizer."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    from demo.tiny_models import qwen3_config

    dims = SHAPES["qwen3-0.6b"]
    tokenizer = build_tokenizer(dims["vocab_size"])
    out = {}
    for name, tied in (("policy", False), ("policy_tied", True)):
        config = qwen3_config(dims | {"num_hidden_layers": POLICY_LAYERS}, tokenizer, tie_word_embeddings=tied)
        model = random_model(AutoModelForCausalLM, config, device, seed=1)
        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        model.save_pretrained(work / name)
        tokenizer.save_pretrained(work / name)
        out[name] = {"params": sum(p.numel() for p in model.parameters()), "tied": tied}
        del model
    config = qwen3_config(dims, tokenizer, num_labels=1)
    reward = random_model(AutoModelForSequenceClassification, config, device, seed=0)
    reward.save_pretrained(work / "reward_model")
    tokenizer.save_pretrained(work / "reward_model")
    out["reward_model"] = {"params": sum(p.numel() for p in reward.parameters())}
    return out


DEADLINE = [float("inf")]  # --budget: monotonic seconds by which every command has ended


def run(cmd: list[str], env: dict, log: Path, timeout: float) -> dict:
    """A user's command, its whole output in `log`: exit code and seconds (cut at the run's --budget)."""
    began = time.monotonic()
    timeout = max(1.0, min(timeout, DEADLINE[0] - began))
    with log.open("w") as f:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    return {"command": " ".join(cmd), "rc": rc, "seconds": round(time.monotonic() - began, 1), "log": log.name}


def phase_peaks(text: str) -> dict:
    """Each verl phase's peak (allocated, reserved GiB) over its calls, from the hook's lines in the trainer's log."""
    from benchmarks.verl_step import parse_phase_line

    peaks: dict = {}
    for line in text.splitlines():
        if (p := parse_phase_line(line)) is not None:
            entry = peaks.setdefault(p["phase"], {"peak_allocated_gib": 0.0, "peak_reserved_gib": 0.0, "calls": 0})
            entry["peak_allocated_gib"] = max(entry["peak_allocated_gib"], round(p["peak_allocated_gib"], 2))
            entry["peak_reserved_gib"] = max(entry["peak_reserved_gib"], round(p["peak_reserved_gib"], 2))
            entry["calls"] += 1
    return peaks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="result.json and the logs")
    parser.add_argument("--work", type=Path, default=Path("/tmp/gpu_canary"), help="models, data, checkpoints")
    parser.add_argument("--timeout", type=float, default=420, help="seconds for the canary")
    parser.add_argument("--budget", type=float, default=0, help="seconds for the whole run (0: no limit)")
    args = parser.parse_args(argv)
    if args.budget:
        DEADLINE[0] = time.monotonic() + args.budget
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out, work = args.out.resolve(), args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    for folder in (out, work):
        folder.mkdir(parents=True, exist_ok=True)
    result: dict = {"command": command_line("benchmarks.gpu_canary", argv), **machine_info(device)}
    began = time.monotonic()
    result["models"] = build_models(work, device)
    torch.cuda.empty_cache() if device == "cuda" else None
    write_prompts(work / "prompts.jsonl", 64, (20, 120), SHAPES["qwen3-0.6b"]["vocab_size"] - 16)
    build = [sys.executable, "-m", "data_prep.build", str(work / "prompts.jsonl"), "--out-dir", str(work / "data")]
    result["data"] = run(build, dict(os.environ), out / "data_prep.log", 300)
    result["assets_s"] = round(time.monotonic() - began, 1)
    write_json(out / "result.json", result)
    from cpu.megatron_shims import GPU_OVERRIDES

    env = dict(os.environ, **SETTINGS)
    env |= {
        "CONFIG_MODEL_PATH": str(work / "policy"),
        "CONFIG_REWARD_MODEL_PATH": str(work / "reward_model"),
        "CONFIG_TRAIN_FILE": str(work / "data" / "train.parquet"),
        "CONFIG_TEST_FILE": str(work / "data" / "test.parquet"),
        "CONFIG_OUTPUT_DIR": str(work / "checkpoints"),
        "CONFIG_LOG_DIR": str(work / "logs"),
        "HF_HOME": str(work / "hf_home"),
    }
    script = ["bash", "run_grpo_qwen3_4b_mega_verl.sh", *(o for o, _ in GPU_OVERRIDES)]
    nvml = NvmlSampler(0.2)
    nvml.start()
    result["canary"] = run(
        script, env | {"CANARY": "1", "CANARY_KEEP": "1", "FUSED_KERNELS": "on"}, out / "canary.log", args.timeout
    )
    nvml.done.set()
    text = (out / "canary.log").read_text(errors="replace")
    summaries = sorted((work / "logs").glob("*/canary/summary.txt"))
    result["canary"]["summary"] = summaries[-1].read_text() if summaries else None
    result["preflight_memory_lines"] = [m.group(0) for line in text.splitlines() if (m := MEMORY_LINE.match(line))]
    result["preflight_fused_line"] = next((x for x in text.splitlines() if "fused log-prob kernels" in x), None)
    commands = sorted((work / "logs").glob("*/canary/train/trainer_command.txt"))
    result["trainer_command"] = commands[-1].read_text().split("\n") if commands else None
    trainer_logs = sorted((work / "logs").glob("*/canary/*/trainer.log"))
    result["phase_peaks"] = {p.parent.name: phase_peaks(p.read_text(errors="replace")) for p in trainer_logs}
    result["nvml_peaks"] = nvml.report(reward_pid=-1)
    for row in result["nvml_peaks"]["processes"]:
        if "reward_score" in row["cmdline"]:
            row["role"] = "reward server"
    merges = sorted((work / "logs").glob("*/canary/merge.log"))
    result["canary_merge_numeric"] = (
        [x for x in merges[-1].read_text().splitlines() if "numeric check" in x] if merges else []
    )
    write_json(out / "result.json", result)
    ckpt = sorted(
        p.parent for p in (work / "checkpoints_canary").glob("*/checkpoints/latest_checkpointed_iteration.txt")
    )
    if ckpt:  # 2. the merge script alone on the canary's last checkpoint
        merge_env = env | {"CKPT_ROOT": str(ckpt[-1]), "TARGET_DIR": str(work / "merged")}
        result["merge"] = run(["bash", "merge_mcore_to_hf.sh"], merge_env, out / "merge.log", 300)
        merged = (out / "merge.log").read_text(errors="replace").splitlines()
        result["merge"]["numeric"] = [x for x in merged if "numeric check" in x]
    write_json(out / "result.json", result)
    tied = env | {"CONFIG_MODEL_PATH": str(work / "policy_tied"), "FUSED_KERNELS": "auto"}
    tied |= {"PREFLIGHT_ONLY": "1", "CANARY": "1"}  # the canary's own preflight: its batch fits the data
    result["tied_auto"] = run(script, tied, out / "preflight_tied.log", 300)
    lines = (out / "preflight_tied.log").read_text(errors="replace").splitlines()
    result["tied_auto"]["fused_line"] = next((x for x in lines if "fused log-prob kernels" in x), None)
    write_json(out / "result.json", result)
    print(json.dumps({k: result.get(k) for k in ("canary", "canary_merge_numeric", "merge", "tied_auto")}, indent=1))
    print(result["canary"].get("summary") or "no canary summary")
    return 0 if result["canary"]["rc"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
