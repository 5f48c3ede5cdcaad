"""The job as a user runs it, on one GPU (or a CPU, tiny models): run_grpo_qwen3_4b_mega_verl.sh in its workstation
mode (CONTAINER=none) with random-weight Qwen3-shaped models (benchmarks/common.py's word-level tokenizer, a chat
template that opens no <think>) and data from `python -m data_prep.build`: the preflight, the reward server on the same
device (the shared placement), Ray, verl 0.6.1's own trainer. SGLang is the one component replaced: verl's HF rollout
stands in for it (cpu/megatron_shims.py GPU_OVERRIDES, the one place; on a CPU the CPU layer's overrides); without
Transformer Engine the layers are cpu/'s TE-free spec. Each verl phase's peak memory comes from
benchmarks/verl_step_hook.py's lines (CPU_RUN_THEN_HOOK), each process's from NVML.

    python -m benchmarks.gpu_job steps --strategy megatron --out DIR  # GRPO steps: verl's timing_s, each phase's peak
    python -m benchmarks.gpu_job canary --out DIR    # CANARY=1, merge_mcore_to_hf.sh, a tied policy's preflight
    python -m benchmarks.gpu_job steps --shape tiny --steps 2 --out DIR   # a CPU, tiny models (what the test runs)

On a GPU machine without network access, through benchmarks/offline_gpu.sh. The output folder gets result.json and the
logs that matter (the run script's output, verl's console, the merge's), at its top level.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from benchmarks.common import SHAPES, build_tokenizer, command_line, machine_info, random_model, write_json
from benchmarks.verl_step_hook import PHASE_PREFIX, PROFILE_DIR_ENV, PROFILE_ENV
from launch.job.steps import ANSI, parse_step_lines

REPO = Path(__file__).resolve().parent.parent
# The policy's shape -> the reward model's; each shape's workload: responses per prompt, the prompts' words (one word,
# one token; the chat template adds 8), MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH, MICRO_BATCH_PER_GPU
REWARD_SHAPE = {"qwen3-0.6b": "qwen3-1.7b", "tiny": "tiny"}
WORKLOADS = {
    "qwen3-0.6b": {"rollout_n": 4, "words": (100, 400), "prompt": 512, "response": 512, "micro": 4},
    "tiny": {"rollout_n": 2, "words": (20, 60), "prompt": 128, "response": 32, "micro": 2},
}
CANARY_LAYERS = 12  # the canary's untied policy: Qwen3-0.6B's dimensions, fewer layers (its checkpoints are 3 x 7 GB)


def measure_phases() -> None:
    """The Ray workers' further hook (CPU_RUN_THEN_HOOK, after the job's and the stand-in's): each verl phase's peak
    memory printed, one line a call (benchmarks/verl_step_hook.py)."""
    from benchmarks.verl_step_hook import _measure_phases

    _measure_phases("megatron_workers" if os.environ.get("STRATEGY") == "megatron" else "fsdp_workers")


# --- the models, the data, the settings ------------------------------------------------------------------------------


def build_models(shape: str, work: Path, device: str, canary: bool) -> dict:
    """The policy (canary: untied, and a tied one beside it; steps: tied, as the small Qwen3s) and the reward model,
    with random weights and one tokenizer."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, GenerationConfig

    from demo.tiny_models import qwen3_config

    dims = SHAPES[shape]
    tokenizer = build_tokenizer(dims["vocab_size"])
    out = {}
    policies = {"policy": not canary, **({"policy_tied": True} if canary else {})}
    layers = {"num_hidden_layers": CANARY_LAYERS} if canary and shape != "tiny" else {}
    for name, tied in policies.items():
        model = random_model(
            AutoModelForCausalLM, qwen3_config(dims | layers, tokenizer, tie_word_embeddings=tied), device, 1
        )
        model.generation_config = GenerationConfig(
            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
        )
        model.save_pretrained(work / name)
        tokenizer.save_pretrained(work / name)
        out[name] = {"params": sum(p.numel() for p in model.parameters()), "tied": tied, **dims, **layers}
        del model
    reward_dims = SHAPES[shape if canary else REWARD_SHAPE[shape]]
    config = qwen3_config(reward_dims, build_tokenizer(reward_dims["vocab_size"]), num_labels=1)
    reward = random_model(AutoModelForSequenceClassification, config, device, 0)
    reward.save_pretrained(work / "reward_model")
    tokenizer.save_pretrained(work / "reward_model")
    out["reward_model"] = {"params": sum(p.numel() for p in reward.parameters()), **reward_dims}
    return out


def write_prompts(path: Path, rows: int, words: tuple[int, int], vocab: int, seed: int = 0) -> None:
    """`rows` prompts of `words` (low, high) random words of the shared tokenizer (one word, one token)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            text = " ".join(f"w{rng.randrange(vocab - 16)}" for _ in range(rng.randint(*words)))
            f.write(json.dumps({"prompt": text}) + "\n")


def job_env(args, work: Path, device: str) -> dict[str, str]:
    """The settings block's own defaults, but for this machine's one device and the run's workload and paths."""
    from cpu import verl_shims

    w = WORKLOADS[args.shape]
    env = dict(os.environ) | {
        "CONTAINER": "none",
        "CONFIG_GPUS_PER_NODE": "1",
        "ACTOR_PP": "1",
        "STRATEGY": args.strategy,
        "MAX_PROMPT_LENGTH": str(w["prompt"]),
        "MAX_RESPONSE_LENGTH": str(w["response"]),
        "MICRO_BATCH_PER_GPU": str(w["micro"]),
        "ROLLOUT_N": str(w["rollout_n"]),
        "REWARD_PROMPT_OPENS_THINK": "false",  # every response scored by the reward model: GRPO's signal is not zero
        "EXPERIMENT_NAME": f"gpu_job_{args.mode}",
        "ACTOR_LR": "1e-3",  # a random policy's bf16 weights move in 3 steps: the merge tells one step from another
        "CONFIG_MODEL_PATH": str(work / "policy"),
        "CONFIG_REWARD_MODEL_PATH": str(work / "reward_model"),
        "CONFIG_TRAIN_FILE": str(work / "data" / "train.parquet"),
        "CONFIG_TEST_FILE": str(work / "data" / "test.parquet"),
        "CONFIG_OUTPUT_DIR": str(work / "checkpoints"),
        "CONFIG_LOG_DIR": str(work / "logs"),
        "HF_HOME": str(work / "hf_home"),
        "MERGER_LAUNCHER": str(REPO / "cpu" / "megatron_merger"),  # verl's merger with the TE-free layers
        "CPU_RUN_THEN_HOOK": "benchmarks.gpu_job.measure_phases",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    if args.mode == "steps":  # sync rollout, every step a full mini-batch, no save or validation: the steps alone
        env |= {"ROLLOUT_MODE": "sync", "TRAIN_BATCH_SIZE": str(args.prompts), "PPO_MINI_BATCH_SIZE": str(args.prompts)}
        env |= {"SAVE_FREQ": "-1", "TEST_FREQ": "-1", "VAL_BEFORE_TRAIN": "false", "TRAINER_LOGGER": "[console]"}
    if args.profile:  # Ray's workers inherit the job's environment
        env |= {PROFILE_ENV: str(args.profile), PROFILE_DIR_ENV: str(args.out / "profiles")}
    if device == "cpu":
        env |= {"CONFIG_REWARD_DEVICE": "cpu", **verl_shims.ENVIRONMENT}
    return env


def overrides(strategy: str, device: str) -> list[str]:
    """The stand-in's Hydra overrides: on a GPU the HF rollout in SGLang's place (FSDP2 also its attention without
    flash-attn), on a CPU the CPU layer's."""
    from cpu import megatron_shims, verl_shims

    if device == "cpu":
        return megatron_shims.overrides() if strategy == "megatron" else verl_shims.overrides()
    fsdp = [o for o, _ in verl_shims.ENGINE_OVERRIDES[1:]] if strategy == "fsdp2" else []
    return [o for o, _ in megatron_shims.GPU_OVERRIDES] + fsdp


# --- reading verl's console ----------------------------------------------------------------------------------------


def read_console(text: str) -> tuple[list[dict], list[dict]]:
    """The step lines of verl's console logger (launch.job.steps.parse_step_lines) as {"step", "metrics"}, and the
    hook's phase lines, in order."""
    steps, phases = [], []
    for raw in text.splitlines():
        if parsed := parse_step_lines(raw):
            steps += [{"step": n, "metrics": metrics} for n, metrics in parsed.items()]
        elif (phase := parse_phase_line(raw)) is not None:
            phases.append(phase)
    return steps, phases


def parse_phase_line(line: str) -> dict | None:
    at = line.find(PHASE_PREFIX)
    if at < 0:
        return None
    try:
        return json.loads(ANSI.sub("", line[at + len(PHASE_PREFIX) :]).strip())
    except json.JSONDecodeError:
        return None


def summarize(steps: list[dict], phases: list[dict]) -> dict:
    """Per key, each step's value: verl's timing_s/*, timing_per_token_ms/*, perf/*, and the reward's mean; the
    peak of each phase over the steps (and each call's)."""
    timing, perf = {}, {}
    for s in steps:
        for key, value in s["metrics"].items():
            if key.startswith(("timing_s/", "timing_per_token_ms/")):
                timing.setdefault(key, []).append(value)
            elif key.startswith("perf/") or key in ("critic/score/mean", "response_length/mean", "prompt_length/mean"):
                perf.setdefault(key, []).append(value)
    memory = {}
    for p in phases:
        entry = memory.setdefault(p["phase"], {"peak_allocated_gib": 0.0, "peak_reserved_gib": 0.0, "calls": []})
        entry["peak_allocated_gib"] = max(entry["peak_allocated_gib"], p["peak_allocated_gib"])
        entry["peak_reserved_gib"] = max(entry["peak_reserved_gib"], p["peak_reserved_gib"])
        entry["calls"].append({k: p[k] for k in ("call", "peak_allocated_gib", "peak_reserved_gib", "seconds")})
    return {"timing": timing, "perf": perf, "phase_memory": memory}


class NvmlSampler(threading.Thread):
    """GPU memory per process as NVML reports it (nvidia-smi's figure), the maximum of samples every `interval` s,
    each process named by its command line (Ray names an actor's process after the method it runs)."""

    def __init__(self, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.interval, self.peaks, self.names, self.error = interval, {}, {}, None
        self.done = threading.Event()

    def run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            while not self.done.is_set():
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                    self.peaks[p.pid] = max(self.peaks.get(p.pid, 0.0), (p.usedGpuMemory or 0) / 2**30)
                    self.names.setdefault(p.pid, _cmdline(p.pid))
                self.done.wait(self.interval)
        except Exception as exc:  # the result says why there are no NVML figures; the run goes on
            self.error = f"{type(exc).__name__}: {exc}"

    def report(self) -> dict:
        rows = [{"pid": pid, "peak_gib": peak, "cmdline": self.names[pid]} for pid, peak in sorted(self.peaks.items())]
        return {"processes": rows, "error": self.error, "interval_s": self.interval}


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120].decode(errors="replace").strip()
    except OSError:
        return "?"


# --- the run ---------------------------------------------------------------------------------------------------------


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


def newest(work: Path, pattern: str) -> Path | None:
    found = sorted(work.glob(pattern), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def canary(result: dict, env: dict, script: list[str], work: Path, out: Path, timeout: float) -> bool:
    """CANARY=1 with FUSED_KERNELS=on (verl's Triton kernels inside a real job), then merge_mcore_to_hf.sh alone on
    its checkpoint, then the tied policy's preflight with FUSED_KERNELS=auto: the choice and its reason."""
    result["canary"] = run(
        script, env | {"CANARY": "1", "CANARY_KEEP": "1", "FUSED_KERNELS": "on"}, out / "run.log", timeout
    )
    summary = newest(work, "logs/*/canary/summary.txt")
    result["canary"]["summary"] = summary.read_text() if summary else None
    for name in ("train", "resume"):
        if log := newest(work, f"logs/*/canary/{name}/trainer.log"):
            shutil.copy(log, out / f"trainer_{name}.log")
    if merge := newest(work, "logs/*/canary/merge.log"):
        result["canary"]["merge_numeric"] = [x for x in merge.read_text().splitlines() if "numeric check" in x]
    ckpt = newest(work, "checkpoints_canary/*/checkpoints/latest_checkpointed_iteration.txt")
    if ckpt:
        merge_env = env | {"CKPT_ROOT": str(ckpt.parent), "TARGET_DIR": str(work / "merged")}
        result["merge"] = run(["bash", "merge_mcore_to_hf.sh"], merge_env, out / "merge.log", 300)
        text = (out / "merge.log").read_text(errors="replace").splitlines()
        result["merge"]["numeric"] = [x for x in text if "numeric check" in x]
    tied = env | {"CONFIG_MODEL_PATH": str(work / "policy_tied"), "PREFLIGHT_ONLY": "1", "CANARY": "1"}
    result["tied_auto"] = run(script, tied, out / "preflight_tied.log", 300)
    lines = (out / "preflight_tied.log").read_text(errors="replace").splitlines()
    result["tied_auto"]["lines"] = [x for x in lines if "fused log-prob kernels" in x or "Megatron plan" in x]
    return result["canary"]["rc"] == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=("steps", "canary"))
    parser.add_argument("--out", type=Path, required=True, help="result.json and the logs")
    parser.add_argument("--work", type=Path, help="models, data, checkpoints (default: a temporary folder)")
    parser.add_argument("--shape", choices=sorted(REWARD_SHAPE), default="qwen3-0.6b", help="the policy's shape")
    parser.add_argument("--strategy", choices=("megatron", "fsdp2"), default="megatron")
    parser.add_argument("--steps", type=int, default=3, help="steps: GRPO steps (trainer.total_training_steps)")
    parser.add_argument("--prompts", type=int, default=32, help="steps: prompts a step (TRAIN_BATCH_SIZE)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="profile call N of each worker phase")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the job")
    parser.add_argument("--budget", type=float, default=0, help="seconds for the whole run (0: no limit)")
    args = parser.parse_args(argv)
    if args.budget:
        DEADLINE[0] = time.monotonic() + args.budget
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    args.out = args.out.resolve()
    work = (args.work or Path(__import__("tempfile").mkdtemp(prefix="gpu_job_"))).resolve()
    shutil.rmtree(work, ignore_errors=True)
    for folder in (args.out, work, work / "data"):
        folder.mkdir(parents=True, exist_ok=True)
    result: dict = {"command": command_line("benchmarks.gpu_job", argv), "device": device, **machine_info(device)}
    result["models"] = build_models(args.shape, work, device, args.mode == "canary")
    torch.cuda.empty_cache() if device == "cuda" else None
    w = WORKLOADS[args.shape]
    rows = max(64, 2 * args.prompts * args.steps + 8)
    write_prompts(work / "data" / "prompts.jsonl", rows, w["words"], SHAPES[args.shape]["vocab_size"])
    build = [
        sys.executable,
        "-m",
        "data_prep.build",
        str(work / "data" / "prompts.jsonl"),
        "--out-dir",
        str(work / "data"),
    ]
    result["data"] = run(build + ["--test-size", "0.1"], dict(os.environ), args.out / "data_prep.log", 300)
    env = job_env(args, work, device)
    script = ["bash", "run_grpo_qwen3_4b_mega_verl.sh", *overrides(args.strategy, device)]
    nvml = NvmlSampler(0.2) if device == "cuda" else None
    nvml.start() if nvml else None
    if args.mode == "canary":
        ok = canary(result, env, script, work, args.out, args.timeout)
    else:
        result["job"] = run(
            [*script, f"trainer.total_training_steps={args.steps}"], env, args.out / "run.log", args.timeout
        )
        ok = result["job"]["rc"] == 0
    if nvml:
        nvml.done.set()
        result["nvml"] = nvml.report()
    result["preflight"] = [
        x for x in (args.out / "run.log").read_text(errors="replace").splitlines() if "preflight:" in x
    ]
    command = newest(work, "logs/*/**/trainer_command.txt")
    result["trainer_command"] = command.read_text().split("\n") if command else None
    trainer_log = newest(work, "logs/*/trainer.log") or (args.out / "trainer_train.log")
    if trainer_log.is_file():
        shutil.copy(trainer_log, args.out / "trainer.log") if trainer_log.parent != args.out else None
        result["steps"], phases = read_console(trainer_log.read_text(errors="replace"))
        result |= summarize(result["steps"], phases)
    write_json(args.out / "result.json", result)
    print(json.dumps({k: result.get(k) for k in ("job", "canary", "merge", "tied_auto", "timing")}, indent=1)[:6000])
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
