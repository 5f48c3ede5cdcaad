"""verl 0.6.1's own GRPO training step on one GPU, with verl's own timing_s breakdown and peak memory per role.

What runs is what a job runs with STRATEGY=fsdp2 ROLLOUT_MODE=sync: `python -m verl.trainer.main_ppo` with the
command launch.plan.trainer_command.trainer_argv makes from the run script's settings block, the overrides below last; our reward
server on the same GPU (the job's shared placement), our reward function through verl's batch reward manager, a Ray
head started by hand on its own ports (no dashboard), NCCL. Two things differ from a job, because the benchmark
machine has neither SGLang nor vLLM nor flash-attn: the rollout is verl's HF rollout (HF generate) behind the engine
interface (demo/verl_cpu.py's HFEngineRollout, registered by this module's hook), and the actor keeps its padding
(sdpa attention): demo/verl_cpu.ENGINE_OVERRIDES. On a CPU (`--shape tiny`) its CPU shims and lean overrides come too.

The models have random weights: a policy in Qwen3-0.6B's shape and a reward model in Qwen3-1.7B's
(benchmarks/reward_bench.py builds it), sharing reward_bench's word-level tokenizer, one word a token, its vocabulary
as large as the models' (151936), so every token a random policy samples decodes to a word and the reward model
scores as many tokens as were generated. A random policy seldom samples EOS: responses run to --response-length. The
policy's chat template opens no <think> and the reward function is told so (REWARD_PROMPT_OPENS_THINK=false), so
every response is scored by the reward model (none gets the cut-off penalty) and GRPO's advantages are not zero.

Memory per role: the hook wraps the hybrid worker's generate_sequences (the rollout, its weight sync included),
compute_log_prob (the actor's old log-probs), compute_ref_log_prob (the reference policy) and update_actor, and
prints each call's peak (torch's counters, reset at the call's start). verl's own perf/max_memory_allocated_gb,
read inside update_actor, is therefore the update's peak. The reward server's peak is its /metrics gauge; on a GPU,
NVML's per-process figure (what nvidia-smi shows: CUDA context and allocator cache included) is sampled too.

The output folder gets result.json (rewritten as verl's step lines arrive, so a run cut short still says what it
saw) and logs/: build.log, reward_server.log, ray_head.log, trainer.log (verl's console), trainer_command.txt,
rewards.jsonl (the reward client's log).

    python -m benchmarks.verl_step --out verl_step_h200 --timeout 480        # one GPU: 0.6B policy, 1.7B reward model
    python -m benchmarks.verl_step --shape tiny --steps 2 --out verl_step_cpu # a CPU, tiny models (what the test runs)
    python -m benchmarks.verl_step --out verl_step_h200 --reread              # that run's logs parsed again
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import random
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from demo import verl_cpu

REPO = Path(__file__).resolve().parent.parent
HOOK = "benchmarks.verl_step.install"
MEGATRON_HOOK = "benchmarks.verl_step.install_megatron"
PHASE_PREFIX = "verl_step phase: "  # what the hook prints, one JSON object a call
PHASES = ("generate_sequences", "compute_log_prob", "compute_ref_log_prob", "update_actor")

# The policy's dimensions, and the reward model's shape (a key of reward_bench.SHAPES).
POLICY_SHAPES = {
    # the public Qwen3-0.6B config's dimensions
    "qwen3-0.6b": dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936,
    ),
    "tiny": dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=4096,
    ),
}  # fmt: skip
REWARD_SHAPE = {"qwen3-0.6b": "qwen3-1.7b", "tiny": "tiny"}


# --- the hook: runs in every Ray worker process of the trainer -------------------------------------------------


_installed = False


def install() -> None:
    """Ray's worker_process_setup_hook. With CUDA: only the HF rollout's registration (verl_cpu.register_rollout),
    none of the CPU shims (NCCL, torch.cuda and pinned offload stay verl's own); without: all of demo/verl_cpu.py's.
    Then the per-phase memory measurement (after the shims: they must precede verl's worker module)."""
    global _installed
    if _installed:
        return
    import torch

    if torch.cuda.is_available():
        verl_cpu.register_rollout()
    else:
        verl_cpu.install()
    _measure_phases()
    _installed = True


def install_megatron() -> None:
    """The same for STRATEGY=megatron: on CUDA without Transformer Engine demo/megatron_cpu.py's TE-shaped layer spec
    and optimizer state (install_without_te) beside the HF rollout; without CUDA all its CPU shims."""
    global _installed
    if _installed:
        return
    import torch

    from demo import megatron_cpu

    if torch.cuda.is_available():
        verl_cpu.register_rollout()
        megatron_cpu.install_without_te()
    else:
        megatron_cpu.install()
    _measure_phases("megatron_workers")
    _installed = True


def _measure_phases(module: str = "fsdp_workers") -> None:
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
        began = time.monotonic()
        out = method(self, *args, **kwargs)
        if reset is not None:
            device.synchronize()
        calls[0] += 1
        record = {
            "phase": name, "call": calls[0], "role": getattr(self, "role", None), "pid": os.getpid(),
            "seconds": time.monotonic() - began, "allocated_before_gib": before / 2**30,
            "peak_allocated_gib": device.max_memory_allocated() / 2**30,
            "peak_reserved_gib": device.max_memory_reserved() / 2**30,
        }  # fmt: skip
        print(PHASE_PREFIX + json.dumps(record), flush=True)
        return out

    return measured


# --- reading verl's console ------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(r"(?:^|\s)step:(\d+) - (.*)$")


_NUMPY_SCALAR = re.compile(r"^np\.\w+\((.*)\)$")  # numpy 2's repr of a scalar, which verl prints as it is


def _number(text: str):
    """A metric's value: `0.5`, or numpy 2's `np.float64(0.5)` (verl logs numpy scalars with f"{v}"); else the text."""
    m = _NUMPY_SCALAR.match(text)
    try:
        return float(m.group(1) if m else text)
    except ValueError:
        return text


def parse_step_line(line: str) -> dict | None:
    """verl's console logger line (`step:N - key:value - ...`, tracking.py), as Ray forwards it with a
    `(TaskRunner pid=...)` prefix and colour codes; None for any other line."""
    m = _STEP.search(_ANSI.sub("", line).rstrip())
    if not m:
        return None
    metrics = {}
    for item in m.group(2).split(" - "):
        key, sep, value = item.partition(":")
        if sep:
            metrics[key.strip()] = _number(value.strip())
    return {"step": int(m.group(1)), "metrics": metrics}


def parse_phase_line(line: str) -> dict | None:
    at = line.find(PHASE_PREFIX)
    if at < 0:
        return None
    try:
        return json.loads(_ANSI.sub("", line[at + len(PHASE_PREFIX) :]).strip())
    except json.JSONDecodeError:
        return None


def summarize(steps: list[dict], phases: list[dict]) -> dict:
    """Per key, each step's value: verl's timing_s/*, timing_per_token_ms/*, perf/*, and the reward's mean; the
    peak of each phase over the steps (and each step's)."""
    timing, perf = {}, {}
    for s in steps:
        for key, value in s["metrics"].items():
            if not isinstance(value, float):
                continue
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


# --- the parts of a run ----------------------------------------------------------------------------------------


def build_models(shape: str, out: Path, device: str, result_file: Path) -> None:
    """The reward model (reward_bench.build_model) and a policy of POLICY_SHAPES[shape] with the same tokenizer,
    random weights, in bf16 on a GPU (float32 on a CPU); machine facts. Run in a child process, so that the
    benchmark's own process holds no CUDA context beside the ones it measures."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, Qwen3Config

    from benchmarks.reward_bench import build_model

    began = time.monotonic()
    reward_dir, reward_params, words = build_model(REWARD_SHAPE[shape], out / "reward_model", device)
    tokenizer = AutoTokenizer.from_pretrained(reward_dir)
    dims = POLICY_SHAPES[shape]
    if dims["vocab_size"] < len(tokenizer):
        raise SystemExit(f"policy shape {shape}: vocab {dims['vocab_size']} below the tokenizer's {len(tokenizer)}")
    config = Qwen3Config(
        **dims, max_position_embeddings=40960, rope_theta=1_000_000.0, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(1)
    with torch.device(device):
        policy = AutoModelForCausalLM.from_config(config, dtype=dtype)
    policy_params = sum(p.numel() for n, p in policy.named_parameters() if "embed_tokens" not in n)
    policy.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    policy.save_pretrained(out / "policy")
    tokenizer.save_pretrained(out / "policy")  # the reward model's: its template opens no <think>
    info = {
        "models_s": time.monotonic() - began, "words": words, "python": platform.python_version(),
        "torch": torch.__version__, "transformers": transformers.__version__, "cpus": os.cpu_count(),
        "policy": {"shape": shape, **dims, "non_embedding_params": policy_params, "dtype_saved": str(dtype)},
        "reward_model": {"shape": REWARD_SHAPE[shape], "non_embedding_params": reward_params},
    }  # fmt: skip
    if device == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), gpus_visible=torch.cuda.device_count(),
                    gpu_memory_gib=torch.cuda.get_device_properties(0).total_memory / 2**30,
                    cuda=torch.version.cuda, nccl=str(torch.cuda.nccl.version()))  # fmt: skip
    result_file.write_text(json.dumps(info))


def write_prompts(path: Path, rows: int, lo: int, hi: int, words: int, seed: int = 0) -> None:
    """`rows` prompts of lo..hi random words of the shared tokenizer (one word, one token)."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(rows):
            text = " ".join(f"w{rng.randrange(words)}" for _ in range(rng.randint(lo, hi)))
            f.write(json.dumps({"prompt": text}) + "\n")


def settings_env(args, paths: dict[str, Path]) -> dict[str, str]:
    """The run script's settings block as it exports its defaults, then this run's values: what Settings reads."""
    from launch.plan.reference import block_defaults

    return block_defaults(str(REPO)) | {
        "CONFIG_MODEL_PATH": str(paths["policy"]), "CONFIG_REWARD_MODEL_PATH": str(paths["reward_model"]),
        "CONFIG_TRAIN_FILE": str(paths["data"] / "train.parquet"), "CONFIG_TEST_FILE": str(paths["data"] / "test.parquet"),
        "CONFIG_OUTPUT_DIR": str(paths["checkpoints"]), "CONFIG_GPUS_PER_NODE": "1", "ACTOR_PP": "1",
        "STRATEGY": args.strategy, "ROLLOUT_MODE": "sync", "TRAIN_BATCH_SIZE": str(args.prompts),
        "PPO_MINI_BATCH_SIZE": str(args.prompts), "ROLLOUT_N": str(args.n),
        "MAX_PROMPT_LENGTH": str(args.max_prompt_length), "MAX_RESPONSE_LENGTH": str(args.response_length),
        "MICRO_BATCH_PER_GPU": str(args.micro_batch), "TRAINER_LOGGER": "[console]",
        "SAVE_FREQ": "-1", "TEST_FREQ": "-1",  # no save, no validation: the steps alone are measured
        "ESI_REDUNDANT_TIME": "0", "EXPERIMENT_NAME": "verl_step",
    }  # fmt: skip


def benchmark_overrides(steps: int, on_cpu: bool, strategy: str = "fsdp2") -> list[str]:
    """What this run adds after the job's own overrides (so they win): the engine-less overrides, on a CPU also the
    lean ones, this module's hook instead of the CPU one, N steps and no validation before them. Megatron: the HF
    rollout alone of the engine overrides (the others are the FSDP workers' attention), one rollout rank, and on a
    CPU demo/megatron_cpu.py's overrides."""
    if strategy == "megatron":
        from demo import megatron_cpu

        engine = [verl_cpu.ENGINE_OVERRIDES[0][0], "actor_rollout_ref.rollout.tensor_model_parallel_size=1"]
        if on_cpu:
            engine = [o for o in megatron_cpu.overrides() if "worker_process_setup_hook" not in o]
        hook = MEGATRON_HOOK
    else:
        engine = [o for o, _ in verl_cpu.ENGINE_OVERRIDES] + ([o for o, _ in verl_cpu.LEAN_OVERRIDES] if on_cpu else [])
        hook = HOOK
    return [*engine, f"+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook={hook}",
            f"trainer.total_training_steps={steps}", "trainer.val_before_train=False"]  # fmt: skip


class Terminated(Exception):
    pass


class Group:
    """A process started in a session of its own (launch.plan.procs.start_process); stop() ends every process of that
    group, waiting until none is left: Ray's GCS and raylet outlive the `ray start` that leads the group."""

    def __init__(self, cmd: list[str], log: Path, env: dict, cwd: Path | None = None) -> None:
        from launch.plan.procs import start_process

        self.proc = start_process(cmd, log, env, cwd)
        self.pid, self.log = self.proc.pid, log

    def alive(self) -> bool:
        return self.proc.poll() is None

    def _members(self) -> bool:
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
            while time.monotonic() < deadline:
                self.proc.poll()
                if not self._members():
                    break
                time.sleep(0.2)
            else:
                continue
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
        rows = [{"pid": pid, "peak_gib": peak, "cmdline": self.names.get(pid, "?"),
                 "role": nvml_role(pid, self.names.get(pid, "?"), reward_pid)}
                for pid, peak in sorted(self.peaks.items())]  # fmt: skip
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


def reward_peak_gib(url: str) -> float | None:
    import requests

    text = requests.get(url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("reward_gpu_memory_peak_bytes "):
            return float(line.split()[-1]) / 2**30
    return None


# --- main ------------------------------------------------------------------------------------------------------


class Run:
    """One benchmark run: its result, kept on disk as it grows."""

    def __init__(self, args) -> None:
        self.args, self.out = args, args.out.resolve()
        self.began = time.monotonic()
        self.deadline = self.began + args.timeout if args.timeout else float("inf")
        self.result: dict = {"command": args.command, "status": "starting", "shape": args.shape, "startup_s": {}}
        self.steps: list[dict] = []
        self.phases: list[dict] = []

    def left(self, cap: float) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"--timeout {self.args.timeout:.0f} s reached")
        return min(cap, left)

    def mark(self, name: str, since: float) -> None:
        self.result["startup_s"][name] = round(time.monotonic() - since, 2)
        print(f"[verl_step +{time.monotonic() - self.began:.0f}s] {name} ready in {time.monotonic() - since:.1f} s",
              flush=True)  # fmt: skip

    def write(self) -> None:
        self.result.update(steps=self.steps, phases=self.phases, **summarize(self.steps, self.phases),
                           wall_s=round(time.monotonic() - self.began, 1))  # fmt: skip
        tmp = self.out / "result.json.tmp"
        tmp.write_text(json.dumps(self.result, indent=2))
        os.replace(tmp, self.out / "result.json")

    def read_trainer(self, log: Path, offset: int) -> int:
        """New complete lines of verl's console since `offset`: step lines and phase lines; the new offset."""
        with open(log, "rb") as f:
            f.seek(offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        for raw in chunk[:end].decode(errors="replace").splitlines():
            if (step := parse_step_line(raw)) is not None:
                self.steps.append(step)
                timing = {k.split("/", 1)[1]: round(v, 2) for k, v in step["metrics"].items()
                          if k.startswith("timing_s/") and isinstance(v, float) and "/" not in k.split("/", 1)[1]}  # fmt: skip
                print(f"[verl_step +{time.monotonic() - self.began:.0f}s] step {step['step']}: {timing}", flush=True)
                self.write()
            elif (phase := parse_phase_line(raw)) is not None:
                self.phases.append(phase)
        return offset + end


def reread(out: Path) -> dict:
    """A run's result.json with its steps, phases and summary parsed again from its logs/trainer.log by this module's
    parsers, and its GPU processes labelled again: a parser's fix applies to a run already made."""
    result = json.loads((out / "result.json").read_text())
    steps, phases = [], []
    for raw in (out / "logs" / "trainer.log").read_text(errors="replace").splitlines():
        if (step := parse_step_line(raw)) is not None:
            steps.append(step)
        elif (phase := parse_phase_line(raw)) is not None:
            phases.append(phase)
    result.update(steps=steps, phases=phases, **summarize(steps, phases))
    for row in (result.get("nvml") or {}).get("processes", []):
        row["role"] = nvml_role(row["pid"], row["cmdline"], result.get("reward_server_pid", -1))
    result["reread"] = (
        "python -m benchmarks.verl_step --out DIR --reread: steps, phases and summary from logs/trainer.log"
    )
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(POLICY_SHAPES), default="qwen3-0.6b",
                        help="the policy's shape; the reward model's follows (qwen3-0.6b: Qwen3-1.7B's)")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="folder for result.json and logs/")
    parser.add_argument(
        "--strategy",
        choices=("fsdp2", "megatron"),
        default="fsdp2",
        help="STRATEGY: verl's FSDP2 or Megatron workers (megatron: PP=1, TP=1 on the one GPU)",
    )
    parser.add_argument("--steps", type=int, default=3, help="GRPO steps (trainer.total_training_steps)")
    parser.add_argument(
        "--prompts", type=int, default=16, help="prompts per step (TRAIN_BATCH_SIZE = PPO_MINI_BATCH_SIZE)"
    )
    parser.add_argument("--n", type=int, default=4, help="responses per prompt (ROLLOUT_N)")
    parser.add_argument("--prompt-words", default="100-400", help="prompt lengths in tokens, LO-HI (uniform)")
    parser.add_argument("--max-prompt-length", type=int, default=512, help="MAX_PROMPT_LENGTH")
    parser.add_argument("--response-length", type=int, default=512, help="MAX_RESPONSE_LENGTH")
    parser.add_argument("--micro-batch", type=int, default=4, help="MICRO_BATCH_PER_GPU")
    parser.add_argument("--timeout", type=float, default=0, help="seconds for the whole run (0: none); at the limit "
                        "the trainer is stopped and result.json keeps what was measured")  # fmt: skip
    parser.add_argument("--reread", action="store_true", help="run nothing: parse --out's logs/trainer.log again "
                        "into its result.json (after a parser's fix)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.reread:
        result = reread(args.out)
        tmp = args.out / "result.json.tmp"
        tmp.write_text(json.dumps(result, indent=2))
        os.replace(tmp, args.out / "result.json")
        print(f"{len(result['steps'])} step(s), {len(result['phases'])} phase lines: {args.out / 'result.json'}")
        return 0
    args.command = "python -m benchmarks.verl_step " + shlex.join(sys.argv[1:] if argv is None else argv)
    try:
        lo, hi = (int(x) for x in args.prompt_words.split("-"))
    except ValueError:
        parser.error(f"--prompt-words {args.prompt_words!r}: LO-HI, e.g. 100-400")
    if not 0 < lo <= hi or hi + 8 > args.max_prompt_length:
        parser.error(f"--prompt-words {args.prompt_words}: 0 < LO <= HI and HI + 8 (the chat template) "
                     f"<= --max-prompt-length {args.max_prompt_length}")  # fmt: skip
    if args.steps < 1 or args.prompts < 1 or args.n < 2:
        parser.error("--steps and --prompts at least 1, --n at least 2 (a GRPO group)")

    import torch  # the device decides the rest; this process itself never touches the GPU

    device = "cuda" if torch.cuda.is_available() else "cpu"
    run = Run(args)
    logs = run.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="verl_step_"))
    ray_tmp = Path(tempfile.mkdtemp(prefix="rayvs", dir="/tmp"))  # short: Ray's socket paths have a length limit
    run.result.update(device=device, work_dir=str(work), ray_temp_dir=str(ray_tmp))
    started: list[Group] = []
    nvml = NvmlSampler() if device == "cuda" else None
    rc = 1

    def terminated(signum, frame):
        raise Terminated(f"signal {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, terminated)  # an outer `timeout` still gets result.json and a clean stop
    try:
        rc = _run(run, args, device, work, ray_tmp, logs, lo, hi, started, nvml)
    except BaseException as exc:
        run.result["status"] = f"failed: {type(exc).__name__}: {exc}"[:3000]
        print(f"[verl_step] FAILED: {type(exc).__name__}: {exc}", flush=True)
        if isinstance(exc, KeyboardInterrupt):
            raise
    finally:
        if nvml is not None:
            nvml.done.set()
            run.result["nvml"] = nvml.report(run.result.get("reward_server_pid", -1))
        run.write()  # before the stops, which can take a while
        for group in started:
            group.stop()
        run.write()
        print(f"[verl_step] {run.result['status']}; {len(run.steps)} step(s); wrote {run.out / 'result.json'}")
    return rc


def _run(run: Run, args, device, work, ray_tmp, logs, lo, hi, started, nvml) -> int:
    import multiprocessing

    import requests

    from launch.job.node import plan_ports
    from launch.plan.procs import wait_for_http
    from launch.plan.settings import Settings
    from launch.plan.trainer_command import trainer_argv

    # 1. models, in a child process (no CUDA context left in this one)
    since = time.monotonic()
    info_file = work / "build.json"
    child = multiprocessing.get_context("spawn").Process(
        target=_build_logged, args=(args.shape, work, device, info_file, str(logs / "build.log"))
    )
    child.start()
    child.join(run.left(900))
    if child.is_alive():
        child.kill()
        raise TimeoutError("building the models took past --timeout")
    if child.exitcode != 0:
        raise RuntimeError(f"building the models failed (exit {child.exitcode}); log {logs / 'build.log'}")
    run.result["machine"] = json.loads(info_file.read_text())
    run.mark("models", since)

    # 2. data: the project's own builder, as a user would run it
    from data_prep import build as data_build

    data = work / "data"
    data.mkdir()
    train_rows = args.prompts * args.steps
    write_prompts(data / "prompts.jsonl", rows=2 * train_rows + 8, lo=lo, hi=hi, words=run.result["machine"]["words"])
    data_build.main([str(data / "prompts.jsonl"), "--out-dir", str(data), "--data-source", "verl_step",
                     "--ability", "benchmark", "--test-size", "0.1", "--overwrite"])  # fmt: skip
    import pyarrow.parquet as pq

    have = pq.read_metadata(data / "train.parquet").num_rows
    if have < train_rows:
        raise RuntimeError(f"{have} training prompts, fewer than --prompts x --steps = {train_rows}")
    run.result["workload"] = {
        "steps": args.steps, "prompts_per_step": args.prompts, "responses_per_prompt": args.n,
        "prompt_words": [lo, hi], "max_prompt_length": args.max_prompt_length,
        "max_response_length": args.response_length, "micro_batch_per_gpu": args.micro_batch,
        "train_rows": have,
    }  # fmt: skip

    # 3. the settings a job would have, the reward server and the Ray head on this run's own ports
    paths = {"policy": work / "policy", "reward_model": work / "reward_model", "data": data,
             "checkpoints": work / "checkpoints"}  # fmt: skip
    env_settings = settings_env(args, paths)
    settings = Settings.from_env(env_settings)
    ports = plan_ports(f"verl_step-{os.getpid()}", 0, 1)
    url = f"http://127.0.0.1:{ports['reward_port']}"
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", WANDB_MODE="offline", RAY_DEDUP_LOGS="0",
        RAY_USAGE_STATS_ENABLED="0", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", HF_HOME=str(work / "hf"),
        HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        REWARD_SERVER_URLS=url, REWARD_SERVER_LOG=str(logs / "reward_server.log"),
        REWARD_LOG_PATH=str(logs / "rewards.jsonl"), REWARD_PROMPT_OPENS_THINK="false",
        # one host: what the job exports for CONFIG_NETWORK_INTERFACE=lo (helper_grpo_qwen3_4b.sh, export_worker_env)
        NCCL_SOCKET_IFNAME="lo", GLOO_SOCKET_IFNAME="lo", TP_SOCKET_IFNAME="lo",
    )  # fmt: skip
    since = time.monotonic()
    server_cmd = [sys.executable, str(REPO / "reward_score" / "reward_server.py"), "--model-path",
                  str(paths["reward_model"]), "--device", device, "--port", str(ports["reward_port"]),
                  "--host", "127.0.0.1", *settings.reward_format_flags]  # fmt: skip
    server = Group(server_cmd, logs / "reward_server.log", env)
    started.append(server)
    run.result["reward_server_pid"] = server.pid
    if nvml is not None:
        nvml.start()
    port_flags = [f"--{name.replace('_', '-')}={ports[name]}" for name in
                  ("dashboard_agent_listen_port", "dashboard_agent_grpc_port", "node_manager_port",
                   "object_manager_port", "metrics_export_port", "runtime_env_agent_port", "min_worker_port",
                   "max_worker_port", "ray_client_server_port", "dashboard_port")]  # fmt: skip
    ray_address = f"127.0.0.1:{ports['ray_port']}"
    ray_cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
               "--node-ip-address=127.0.0.1", f"--port={ports['ray_port']}", f"--temp-dir={ray_tmp}",
               "--include-dashboard=false", "--disable-usage-stats", f"--num-cpus={os.cpu_count() or 2}",
               "--num-gpus=1", *port_flags]  # fmt: skip
    ray_head = Group(ray_cmd, logs / "ray_head.log", env)
    started.insert(0, ray_head)
    wait_for_http(server.proc, url + "/health", server.log, run.left(900), name="the reward server")
    run.mark("reward_server", since)
    run.result["reward_server_health"] = requests.get(url + "/health", timeout=10).json()
    waited = subprocess.run([sys.executable, "-m", "launch.job.ray_cluster", "wait", "--address", ray_address,
                             "--nodes", "1", "--gpus", "1", "--timeout", f"{run.left(300):.0f}",
                             "--watch-pid", str(ray_head.pid)], env=env, cwd=REPO)  # fmt: skip
    if waited.returncode != 0:
        raise RuntimeError(f"the Ray head did not come up; log {ray_head.log}")
    run.mark("ray", since)

    # 4. the trainer: the job's command, this run's overrides last
    argv = trainer_argv(settings, ray_address, benchmark_overrides(args.steps, device == "cpu", args.strategy))
    command = [sys.executable, *argv]
    (logs / "trainer_command.txt").write_text("\n".join(command) + "\n")
    run.result["trainer_command"] = command[1:]
    run.result["status"] = "training"
    run.write()
    since = time.monotonic()
    hydra_cwd = work / "trainer"  # Hydra writes outputs/ into the current folder
    hydra_cwd.mkdir()
    trainer = Group(command, logs / "trainer.log", env, cwd=hydra_cwd)
    started.insert(0, trainer)  # stopped first, then Ray, then the reward server
    offset = 0
    while trainer.alive():
        offset = run.read_trainer(trainer.log, offset)
        if run.steps and "trainer_to_first_step" not in run.result["startup_s"]:
            run.mark("trainer_to_first_step", since)
        if time.monotonic() > run.deadline:
            trainer.stop()
            run.read_trainer(trainer.log, offset)
            run.result["status"] = f"timeout: --timeout {args.timeout:.0f} s reached during training"
            break
        time.sleep(1.0)
    else:
        run.read_trainer(trainer.log, offset)
        run.result["trainer_exit"] = trainer.proc.returncode
        done = [s["step"] for s in run.steps]
        run.result["status"] = (
            "done" if trainer.proc.returncode == 0 and len(done) >= args.steps
            else f"failed: the trainer exited with {trainer.proc.returncode} after steps {done}; log {trainer.log}"
        )  # fmt: skip
    try:
        run.result["reward_server_peak_gib"] = reward_peak_gib(url)
    except Exception as exc:  # the server died: the result says so instead of a figure
        run.result["reward_server_peak_gib"] = f"unread: {type(exc).__name__}: {exc}"
    return 0 if run.result["status"] == "done" else 1


def _build_logged(shape: str, work: Path, device: str, info_file: Path, log: str) -> None:
    with open(log, "w") as f:
        os.dup2(f.fileno(), 1)
        os.dup2(f.fileno(), 2)
        build_models(shape, work, device, info_file)


if __name__ == "__main__":
    sys.exit(main())
