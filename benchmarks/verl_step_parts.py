"""The parts of a benchmarks/verl_step.py run: its models (a random policy beside the reward benchmark's reward
model), its prompts, the settings block's environment and the overrides the run adds to the job's trainer command,
the process groups it starts and stops, and the GPU memory it reads per process (NVML)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

from benchmarks.common import SHAPES, build_reward_model, machine_info, non_embedding_params, random_policy
from benchmarks.verl_step_hook import HOOK, MEGATRON_HOOK
from cpu import verl_shims

REPO = Path(__file__).resolve().parent.parent

# The policy's shape (the public Qwen3-0.6B config's dimensions, or tiny) -> the reward model's
REWARD_SHAPE = {"qwen3-0.6b": "qwen3-1.7b", "tiny": "tiny"}
POLICY_SHAPES = {k: SHAPES[k] for k in REWARD_SHAPE}
# Each policy shape's workload beside --prompts and --steps: ROLLOUT_N, the prompts' lengths in tokens (uniform; the
# chat template adds 8), MAX_PROMPT_LENGTH, MAX_RESPONSE_LENGTH, MICRO_BATCH_PER_GPU; tiny's is a CPU's
WORKLOADS = {
    "qwen3-0.6b": {
        "responses_per_prompt": 4,
        "prompt_words": (100, 400),
        "max_prompt_length": 512,
        "max_response_length": 512,
        "micro_batch_per_gpu": 4,
    },
    "tiny": {
        "responses_per_prompt": 2,
        "prompt_words": (20, 60),
        "max_prompt_length": 128,
        "max_response_length": 32,
        "micro_batch_per_gpu": 2,
    },
}


def build_models(shape: str, out: Path, device: str, result_file: Path, log: str) -> None:
    """The reward model (common.build_reward_model) and a policy of POLICY_SHAPES[shape] with the same tokenizer,
    random weights, in bf16 on a GPU (float32 on a CPU); machine facts. Run in a child process, its stdout and stderr
    in `log`, so that the benchmark's own process holds no CUDA context beside the ones it measures."""
    from transformers import AutoTokenizer, GenerationConfig

    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
    began = time.monotonic()
    reward_dir, reward_params, words = build_reward_model(REWARD_SHAPE[shape], out / "reward_model", device)
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    dims = POLICY_SHAPES[shape]  # the vocabulary of REWARD_SHAPE[shape], whose tokenizer it shares
    policy = random_policy(dims, tokenizer, device)
    policy.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    policy.save_pretrained(out / "policy")
    tokenizer.save_pretrained(out / "policy")  # the reward model's: its template opens no <think>
    info = {
        "models_s": time.monotonic() - began,
        "words": words,
        **machine_info(device),
        "policy": {
            "shape": shape,
            **dims,
            "non_embedding_params": non_embedding_params(policy),
            "dtype_saved": str(policy.dtype),
        },
        "reward_model": {"shape": REWARD_SHAPE[shape], "non_embedding_params": reward_params},
    }
    result_file.write_text(json.dumps(info))


def write_prompts(path: Path, rows: int, lengths: tuple[int, int], words: int, seed: int = 0) -> None:
    """`rows` prompts of `lengths` (low, high) random words of the shared tokenizer (one word, one token)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            text = " ".join(f"w{rng.randrange(words)}" for _ in range(rng.randint(*lengths)))
            f.write(json.dumps({"prompt": text}) + "\n")


def settings_env(args, paths: dict[str, Path]) -> dict[str, str]:
    """The run script's settings block as it exports its defaults, then this run's values: what Settings reads."""
    from benchmarks.common import block_defaults

    workload = WORKLOADS[args.shape]
    return block_defaults(str(REPO)) | {
        "CONFIG_MODEL_PATH": str(paths["policy"]),
        "CONFIG_REWARD_MODEL_PATH": str(paths["reward_model"]),
        "CONFIG_TRAIN_FILE": str(paths["data"] / "train.parquet"),
        "CONFIG_TEST_FILE": str(paths["data"] / "test.parquet"),
        "CONFIG_OUTPUT_DIR": str(paths["checkpoints"]),
        "CONFIG_GPUS_PER_NODE": "1",
        "ACTOR_PP": "1",
        "STRATEGY": args.strategy,
        "ROLLOUT_MODE": "sync",
        "TRAIN_BATCH_SIZE": str(args.prompts),
        "PPO_MINI_BATCH_SIZE": str(args.prompts),
        "ROLLOUT_N": str(workload["responses_per_prompt"]),
        "MAX_PROMPT_LENGTH": str(workload["max_prompt_length"]),
        "MAX_RESPONSE_LENGTH": str(workload["max_response_length"]),
        "MICRO_BATCH_PER_GPU": str(workload["micro_batch_per_gpu"]),
        "TRAINER_LOGGER": "[console]",
        "SAVE_FREQ": "-1",
        "TEST_FREQ": "-1",  # no save, no validation: the steps alone are measured
        "ESI_REDUNDANT_TIME": "0",
        "EXPERIMENT_NAME": "verl_step",
    }


def benchmark_overrides(steps: int, on_cpu: bool, strategy: str = "fsdp2") -> list[str]:
    """What this run adds after the job's own overrides (so they win): the engine-less overrides, on a CPU also the
    lean ones, this module's hook instead of the CPU one, N steps and no validation before them. Megatron: the HF
    rollout alone of the engine overrides (the others are the FSDP workers' attention), one rollout rank, and on a
    CPU cpu/megatron_shims.py's overrides."""
    if strategy == "megatron":
        from cpu import megatron_shims

        engine = [verl_shims.ENGINE_OVERRIDES[0][0], "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
        if on_cpu:
            engine = [o for o in megatron_shims.overrides() if "worker_process_setup_hook" not in o]
        hook = MEGATRON_HOOK
    else:
        engine = [o for o, _ in verl_shims.ENGINE_OVERRIDES] + (
            [o for o, _ in verl_shims.LEAN_OVERRIDES] if on_cpu else []
        )
        hook = HOOK
    return [
        *engine,
        f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={hook}",
        f"trainer.total_training_steps={steps}",
        "trainer.val_before_train=False",
    ]


class Group:
    """A process started in a session of its own (launch.plan.procs.start_process); stop() ends every process of that
    group, waiting until none is left: Ray's GCS and raylet outlive the `ray start` that leads the group."""

    def __init__(self, cmd: list[str], log: Path, env: dict, cwd: Path | None = None) -> None:
        from launch.plan.procs import start_process

        self.proc = start_process(cmd, log, env, cwd)
        self.pid, self.log = self.proc.pid, log

    def _members(self) -> bool:
        self.proc.poll()  # reap the leader: a zombie still counts in its group
        try:
            os.killpg(self.pid, 0)
        except ProcessLookupError:
            return False
        return True

    def stop(self, timeout: float = 20.0) -> int | None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + timeout
            while self._members() and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self._members():
                break
        try:
            return self.proc.wait(5)
        except subprocess.TimeoutExpired:
            return None


class NvmlSampler(threading.Thread):
    """GPU memory per process as NVML reports it (nvidia-smi's figure), the maximum of samples every `interval` s."""

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
                    used = (p.usedGpuMemory or 0) / 2**30
                    self.peaks[p.pid] = max(self.peaks.get(p.pid, 0.0), used)
                    if p.pid not in self.names:
                        self.names[p.pid] = _cmdline(p.pid)
                self.done.wait(self.interval)
        except Exception as exc:  # the result says why there are no NVML figures; the run goes on
            self.error = f"{type(exc).__name__}: {exc}"

    def report(self, reward_pid: int) -> dict:
        rows = [
            {
                "pid": pid,
                "peak_gib": peak,
                "cmdline": self.names.get(pid, "?"),
                "role": nvml_role(pid, self.names.get(pid, "?"), reward_pid),
            }
            for pid, peak in sorted(self.peaks.items())
        ]
        return {"processes": rows, "error": self.error, "interval_s": self.interval}


def nvml_role(pid: int, cmdline: str, reward_pid: int) -> str:
    """Which part of the run a GPU process is: Ray names an actor's process after the method it runs."""
    if pid == reward_pid:
        return "reward server"
    if "WorkerDict" in cmdline:
        return "verl's hybrid worker: actor, rollout and reference policy"
    return "other (a Ray worker or the driver)"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:120].decode(errors="replace").strip()
    except OSError:
        return "?"
