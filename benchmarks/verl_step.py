"""verl 0.6.1's own GRPO training step on one GPU, with verl's own timing_s breakdown and peak memory per role.

`python -m verl.trainer.main_ppo` with the job's own command (launch.plan.trainer_command.trainer_argv, sync rollout)
and the overrides below last; our reward server on the same GPU, a Ray head on its own ports. What differs from a job,
random weights and the workload: benchmarks/README.md. The hook (benchmarks/verl_step_hook.py) prints each worker
phase's peak memory; on a GPU NVML's per-process figure is sampled too. The output folder gets result.json (rewritten
as verl's step lines arrive, so a run cut short still says what it saw) and logs/.

    python -m benchmarks.verl_step --out verl_step_h200 --timeout 480        # one GPU: 0.6B policy, 1.7B reward model
    python -m benchmarks.verl_step --shape tiny --steps 2 --out verl_step_cpu # a CPU, tiny models (what the test runs)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import command_line, write_json
from benchmarks.reward_bench import metrics
from benchmarks.verl_step_hook import PHASE_PREFIX, PROFILE_DIR_ENV, PROFILE_ENV
from benchmarks.verl_step_parts import (
    POLICY_SHAPES,
    WORKLOADS,
    Group,
    NvmlSampler,
    benchmark_overrides,
    build_models,
    settings_env,
    write_prompts,
)
from launch.job.steps import ANSI, parse_step_lines

REPO = Path(__file__).resolve().parent.parent


# --- reading verl's console ------------------------------------------------------------------------------------


def read_console(text: str) -> tuple[list[dict], list[dict]]:
    """The step lines of verl's console logger (launch.job.steps.parse_step_lines reads each, Ray's prefix and
    colour codes and numpy's scalar reprs included) as {"step", "metrics"}, and the hook's phase lines, in order."""
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
    peak of each phase over the steps (and each step's)."""
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


class Terminated(Exception):
    pass


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
        print(
            f"[verl_step +{time.monotonic() - self.began:.0f}s] {name} ready in {time.monotonic() - since:.1f} s",
            flush=True,
        )

    def write(self) -> None:
        profiles = sorted((self.out / "logs" / "profiles").glob("*.json"))
        if profiles:
            self.result["profiles"] = [json.loads(f.read_text()) for f in profiles]
        self.result.update(
            steps=self.steps,
            phases=self.phases,
            **summarize(self.steps, self.phases),
            wall_s=round(time.monotonic() - self.began, 1),
        )
        write_json(self.out / "result.json", self.result)

    def read_trainer(self, log: Path, offset: int) -> int:
        """New complete lines of verl's console since `offset`: step lines and phase lines; the new offset."""
        with open(log, "rb") as f:
            f.seek(offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        steps, phases = read_console(chunk[:end].decode(errors="replace"))
        self.phases += phases
        for step in steps:
            self.steps.append(step)
            timing = {
                k.split("/", 1)[1]: round(v, 2)
                for k, v in step["metrics"].items()
                if k.startswith("timing_s/") and "/" not in k.split("/", 1)[1]
            }
            print(f"[verl_step +{time.monotonic() - self.began:.0f}s] step {step['step']}: {timing}", flush=True)
            self.write()
        return offset + end


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--shape",
        choices=sorted(POLICY_SHAPES),
        default="qwen3-0.6b",
        help="the policy's shape; the reward model's follows (qwen3-0.6b: Qwen3-1.7B's)",
    )
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
    parser.add_argument(
        "--timeout",
        type=float,
        default=0,
        help="seconds for the whole run (0: none); at the limit "
        "the trainer is stopped and result.json keeps what was measured",
    )
    parser.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Hydra override after the benchmark's own (they win); repeatable",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="run call N of each worker phase under "
        "torch.profiler; its summary (GPU time by kernel kind, top kernels) in result.json's profiles",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    args.command = command_line("benchmarks.verl_step", argv)
    if args.steps < 1 or args.prompts < 1:
        parser.error("--steps and --prompts at least 1")

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
        rc = _run(run, args, device, work, ray_tmp, logs, started, nvml)
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


def _run(run: Run, args, device, work, ray_tmp, logs, started, nvml) -> int:
    """The run in its four steps: the models, the data, the reward server and Ray's head, then the trainer."""
    _models(run, args, device, work, logs)
    data = _data(run, args, work)
    settings, url, ray_address, env = _services(run, args, device, work, ray_tmp, logs, data, started, nvml)
    return _train(run, args, device, work, logs, settings, url, ray_address, env, started)


def _models(run: Run, args, device, work, logs) -> None:
    """The random-weight policy and reward model, built in a child process (no CUDA context left in this one)."""
    import multiprocessing

    since = time.monotonic()
    info_file = work / "build.json"
    child = multiprocessing.get_context("spawn").Process(
        target=build_models, args=(args.shape, work, device, info_file, str(logs / "build.log"))
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


def _data(run: Run, args, work) -> Path:
    """The prompts through the project's own builder, as a user would run it: the data folder."""
    from data_prep import build as data_build

    data = work / "data"
    data.mkdir()
    train_rows, workload = args.prompts * args.steps, WORKLOADS[args.shape]
    write_prompts(data / "prompts.jsonl", 2 * train_rows + 8, workload["prompt_words"], run.result["machine"]["words"])
    data_build.main(
        [
            str(data / "prompts.jsonl"),
            "--out-dir",
            str(data),
            "--data-source",
            "verl_step",
            "--ability",
            "benchmark",
            "--test-size",
            "0.1",
            "--overwrite",
        ]
    )
    import pyarrow.parquet as pq

    have = pq.read_metadata(data / "train.parquet").num_rows
    if have < train_rows:
        raise RuntimeError(f"{have} training prompts, fewer than --prompts x --steps = {train_rows}")
    run.result["workload"] = {"steps": args.steps, "prompts_per_step": args.prompts, **workload, "train_rows": have}
    return data


def _services(run: Run, args, device, work, ray_tmp, logs, data, started, nvml):
    """The settings a job would have, the reward server and the Ray head on this run's own ports, both up."""
    import requests

    from launch.job.node import plan_ports
    from launch.plan.procs import wait_for_http
    from launch.plan.settings import Settings

    paths = {
        "policy": work / "policy",
        "reward_model": work / "reward_model",
        "data": data,
        "checkpoints": work / "checkpoints",
    }
    settings = Settings.from_env(settings_env(args, paths))
    ports = plan_ports(f"verl_step-{os.getpid()}", 0, 1)
    url = f"http://127.0.0.1:{ports['reward_port']}"
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update(
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        PYTHONUNBUFFERED="1",
        TOKENIZERS_PARALLELISM="false",
        WANDB_MODE="offline",
        RAY_DEDUP_LOGS="0",
        RAY_USAGE_STATS_ENABLED="0",
        RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",
        HF_HOME=str(work / "hf"),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        REWARD_SERVER_URLS=url,
        REWARD_SERVER_LOG=str(logs / "reward_server.log"),
        REWARD_LOG_PATH=str(logs / "rewards.jsonl"),
        REWARD_PROMPT_OPENS_THINK="false",
        # one host: what the job exports for CONFIG_NETWORK_INTERFACE=lo (helper_grpo_qwen3_4b.sh, export_worker_env)
        NCCL_SOCKET_IFNAME="lo",
        GLOO_SOCKET_IFNAME="lo",
        TP_SOCKET_IFNAME="lo",
    )
    if args.profile:  # Ray's workers inherit the head's environment (benchmarks/verl_step_hook.py reads these)
        env.update({PROFILE_ENV: str(args.profile), PROFILE_DIR_ENV: str(logs / "profiles")})
    since = time.monotonic()
    server_cmd = [
        sys.executable,
        str(REPO / "reward_score" / "reward_server.py"),
        "--model-path",
        str(paths["reward_model"]),
        "--device",
        device,
        "--port",
        str(ports["reward_port"]),
        "--host",
        "127.0.0.1",
        *settings.reward_format_flags,
    ]
    server = Group(server_cmd, logs / "reward_server.log", env)
    started.append(server)
    run.result["reward_server_pid"] = server.pid
    if nvml is not None:
        nvml.start()
    port_flags = [
        f"--{name.replace('_', '-')}={ports[name]}"
        for name in (
            "dashboard_agent_listen_port",
            "dashboard_agent_grpc_port",
            "node_manager_port",
            "object_manager_port",
            "metrics_export_port",
            "runtime_env_agent_port",
            "min_worker_port",
            "max_worker_port",
            "ray_client_server_port",
            "dashboard_port",
        )
    ]
    ray_address = f"127.0.0.1:{ports['ray_port']}"
    ray_cmd = [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--head",
        "--block",
        "--node-ip-address=127.0.0.1",
        f"--port={ports['ray_port']}",
        f"--temp-dir={ray_tmp}",
        "--include-dashboard=false",
        "--disable-usage-stats",
        f"--num-cpus={os.cpu_count() or 2}",
        "--num-gpus=1",
        *port_flags,
    ]
    ray_head = Group(ray_cmd, logs / "ray_head.log", env)
    started.insert(0, ray_head)
    wait_for_http(server.proc, url + "/health", server.log, run.left(900), name="the reward server")
    run.mark("reward_server", since)
    run.result["reward_server_health"] = requests.get(url + "/health", timeout=10).json()
    waited = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.job.ray_cluster",
            "wait",
            "--address",
            ray_address,
            "--nodes",
            "1",
            "--gpus",
            "1",
            "--timeout",
            f"{run.left(300):.0f}",
            "--watch-pid",
            str(ray_head.pid),
        ],
        env=env,
        cwd=REPO,
    )
    if waited.returncode != 0:
        raise RuntimeError(f"the Ray head did not come up; log {ray_head.log}")
    run.mark("ray", since)
    return settings, url, ray_address, env


def _train(run: Run, args, device, work, logs, settings, url, ray_address, env, started) -> int:
    """The trainer: the job's command with this run's overrides last, read until it ends or --timeout."""
    from launch.plan.trainer_command import trainer_argv

    overrides = benchmark_overrides(args.steps, device == "cpu", args.strategy) + args.override
    argv = trainer_argv(settings, ray_address, overrides)
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
    while trainer.proc.poll() is None:
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
            "done"
            if trainer.proc.returncode == 0 and len(done) >= args.steps
            else f"failed: the trainer exited with {trainer.proc.returncode} after steps {done}; log {trainer.log}"
        )
    try:
        peak = metrics(url).get("reward_gpu_memory_peak_bytes")
        run.result["reward_server_peak_gib"] = None if peak is None else peak / 2**30
    except Exception as exc:  # the server died: the result says so instead of a figure
        run.result["reward_server_peak_gib"] = f"unread: {type(exc).__name__}: {exc}"
    return 0 if run.result["status"] == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
