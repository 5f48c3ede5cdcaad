"""Helpers shared by the tests: free loopback ports, processes that are waited for, the fake container's log."""

from __future__ import annotations

import fcntl
import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cpu import megatron_shims, verl_shims
from launch.plan import procs
from launch.plan.procs import free_port, http_get, tail  # noqa: F401  (the tests import them from here)

REPO = Path(__file__).resolve().parent.parent
FAKES = Path(__file__).resolve().parent / "fakes"
FAKE_PROGRAMS = ("singularity", "apptainer")  # Slurm is real: tests/real_slurm.py
RUN = REPO / "run_grpo_qwen3_4b_mega_verl.sh"


# The start of a shim check run in a fresh interpreter (python -c): outcome(what, call) says how a call the shim is for
# ends, before and after install(): "what: ok" or the exception's type.
SHIM_OUTCOME = r"""
def outcome(what, call):
    try:
        call()
    except Exception as exc:
        return f"{what}: {type(exc).__name__}"
    return f"{what}: ok"
"""


def once_per_run(tmp_path_factory, name: str, build: Callable[[Path], object]) -> object:
    """`build(folder)`'s result (JSON), computed by the first pytest-xdist worker that asks and read back by the
    others, which wait on a lock meanwhile: a session fixture's minutes of work (models trained, a worker built) once
    per run, not once per worker (each worker has its own sessions). `folder` is shared by the workers of this run."""
    root = tmp_path_factory.getbasetemp()
    folder = (root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root) / f"once-{name}"
    folder.mkdir(exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, by the worker's exit too
        result = folder / "result.json"
        if result.exists():
            return json.loads(result.read_text())
        value = build(folder)
        result.with_suffix(".tmp").write_text(json.dumps(value))
        os.replace(result.with_suffix(".tmp"), result)
        return value


@dataclass
class Process:
    """A background process whose output goes to a log file, with the URL it serves once it is ready."""

    popen: subprocess.Popen
    log: Path
    url: str = ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM the process group, SIGKILL after `timeout`; return the exit code."""
        return procs.stop_process(self.popen, timeout)


def pinned_port(count: int = 1) -> int:
    """A port to set by hand (CONFIG_REWARD_SERVER_PORT), with `count` free in a row: above Linux's ephemeral
    range (32768-60999), where no outgoing connection or port-0 listener of another process can take it between this
    pick and the job's bind, and outside the jobs' own blocks (launch/job/node.py: 20000-32767)."""
    from launch.job.node import port_taken

    first = 61000 + random.randrange(4000)
    for i in range(500):
        port = 61000 + (first - 61000 + 7 * i) % 4400
        if not any(port_taken(p) for p in range(port, port + count)):
            return port
    raise RuntimeError("no free port in 61000-65400")


def stop_ray(temp_dir: Path | str, timeout: float = 10.0) -> list[str]:
    """Stop the Ray processes of one cluster (each names its temp dir on its command line): SIGTERM, then SIGKILL what
    is left after `timeout` (a GCS server can outlive SIGTERM); the processes still there after that, if any.
    Never `ray stop`: it ends every Ray cluster on the machine, other tests' and other jobs' too."""
    pattern = str(temp_dir)

    def left() -> list[str]:
        found = subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout.splitlines()
        return [line for line in found if "pgrep" not in line]

    for signal_name in ("TERM", "KILL"):
        subprocess.run(["pkill", f"-{signal_name}", "-f", pattern], check=False)
        deadline = time.monotonic() + timeout
        while left() and time.monotonic() < deadline:
            time.sleep(0.5)
        if not left():
            return []
    return left()


def start_process(cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None, cwd: Path = REPO) -> Process:
    return Process(procs.start_process(cmd, log, env, cwd), log)


def wait_for_http(proc: Process, url: str, timeout: float = 60.0, expect: int = 200) -> None:
    """Poll `url` until it answers `expect`; fail early if the process dies, with its log tail."""
    procs.wait_for_http(proc.popen, url, proc.log, timeout, expect)


def start_http_server(
    cmd: Sequence[str],
    log: Path,
    port: int,
    env: Mapping[str, str] | None = None,
    health: str = "/health",
    timeout: float = 90.0,
) -> Process:
    """Start a server on 127.0.0.1:`port` and return once `health` answers 200."""
    url = f"http://127.0.0.1:{port}"
    return Process(procs.start_server(cmd, log, url + health, timeout, env, REPO), log, url)


@dataclass
class FakeContainer:
    """Fake `singularity`/`apptainer` installed in `bin_dir`, recording to `log` (tests/fakes/fake_container.py)."""

    bin_dir: Path
    log: Path
    programs: tuple[str, ...] = field(default=FAKE_PROGRAMS)

    def install(self) -> FakeContainer:
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        for prog in self.programs:
            wrapper = self.bin_dir / prog
            wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKES / "fake_container.py"}" {prog} "$@"\n')
            wrapper.chmod(0o755)
        return self

    def calls(self, prog: str | None = None) -> list[dict]:
        """Every recorded call, oldest first, optionally of one program only."""
        if not self.log.exists():
            return []
        entries = [json.loads(line) for line in self.log.read_text(encoding="utf-8").splitlines()]
        return [e for e in entries if prog is None or e["prog"] == prog]


# --- the launch tests' job (conftest.job gives its environment) -------------------------------------------------


# verl 0.6.1's own trainer on the CPU (cpu/verl_shims.py) in a test job, sized for a test node's 2 cores: one prompt of
# two responses a step, short texts, no wandb; add real_trainer_args() after the job's own Hydra overrides. Ray gets
# both cores: verl's TaskRunner takes one and its worker's placement bundle another (with one, verl waits for ever).
REAL_TRAINER = {
    "TRAINER_LAUNCHER": "python3",
    "TRAINER_IS_VERL": "1",
    "STRATEGY": "fsdp2",
    "ROLLOUT_MODE": "sync",
    "TRAIN_BATCH_SIZE": "1",
    "PPO_MINI_BATCH_SIZE": "1",
    "ROLLOUT_N": "2",
    "MICRO_BATCH_PER_GPU": "2",
    "MAX_PROMPT_LENGTH": "128",
    "MAX_RESPONSE_LENGTH": "16",
    "TRAINER_LOGGER": "[console]",
    "RAY_NUM_CPUS": "2",
    **verl_shims.ENVIRONMENT,
}


# What verl's own console line of a step holds when its agent loop generated (async rollout, agent_loop.py's timing).
AGENT_LOOP_TIMING = "timing_s/agent_loop/generate_sequences/mean:"


# The same with the settings block's default strategy, verl's Megatron workers (cpu/megatron_shims.py), and verl's
# Megatron merger with the same adaptations; pass real_trainer_args(..., strategy="megatron").
MEGATRON_TRAINER = {**REAL_TRAINER, "STRATEGY": "megatron", "MERGER_LAUNCHER": str(REPO / "cpu" / "megatron_merger")}


def real_trainer_args(*args: str, strategy: str = "fsdp2") -> list[str]:
    """`args`, then what every CPU run adds: no validation before training, two validation prompts, and the CPU
    overrides of the strategy (cpu/verl_shims.py; cpu/megatron_shims.py for Megatron)."""
    cpu = megatron_shims.overrides() if strategy == "megatron" else verl_shims.overrides()
    return [*args, "trainer.val_before_train=False", "data.val_max_samples=2", *cpu]


def run(env: Mapping[str, str], *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The run script, to the end, with `env`; output captured."""
    return subprocess.run(["bash", str(RUN), *args], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def run_without(
    missing: Sequence[str], module: str, *args: str, env: Mapping[str, str] | None = None, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    """`python -m module args` where the modules in `missing` do not import (as on a login node's bare python3:
    None in sys.modules makes `import` raise ModuleNotFoundError); output captured."""
    code = (
        f"import runpy, sys\nfor name in {list(missing)!r}:\n    sys.modules[name] = None\n"
        f"sys.argv = [{module!r}, *sys.argv[1:]]\nrunpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=120
    )


def start_job(env: Mapping[str, str], log: Path) -> subprocess.Popen:
    """The run script in the background, its output in `log`, in the test's process group like a shell's job would
    be not: its own session, so a test can signal the run script alone (os.kill) or everything (os.killpg)."""
    out = open(log, "wb")  # noqa: SIM115  (closed by the child's exit; the test reads the file)
    return subprocess.Popen(
        ["bash", str(RUN)], env=dict(env), cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_for_path(path: Path, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not path.exists():
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.5)
    assert path.exists(), f"{path} never appeared"


def seen(env: Mapping[str, str]) -> dict:
    lines = Path(env["FAKE_TRAINER_LOG"]).read_text().splitlines()
    assert len(lines) == 1, "the trainer must run exactly once"
    return json.loads(lines[0])


def job_dir(env: Mapping[str, str]) -> Path:
    """The one start folder of the job (CONFIG_LOG_DIR also holds an interactive job's output file, as logs/ does)."""
    (d,) = [p for p in Path(env["CONFIG_LOG_DIR"]).iterdir() if p.is_dir()]
    return d


def of_job(pid: int | str, log_dir: Path) -> bool:
    """Whether process `pid` inherited this job's JOB_LOG_DIR; OSError where it has gone."""
    return f"JOB_LOG_DIR={log_dir}".encode() + b"\0" in Path(f"/proc/{pid}/environ").read_bytes()


def job_processes(log_dir: Path) -> list[str]:
    """Live processes that inherited this job's JOB_LOG_DIR (everything the run script and the helpers started,
    Ray's workers included): 'pid cmdline' each."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if not of_job(proc.name, log_dir):
                continue
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{proc.name} {cmdline}")
        except OSError:
            continue
    return found


def listening(ports: Sequence[int]) -> list[int]:
    """The ports among `ports` that accept a connection on 127.0.0.1."""
    open_ports = []
    for port in ports:
        with socket.socket() as s:
            s.settimeout(0.5)
            if s.connect_ex(("127.0.0.1", port)) == 0:
                open_ports.append(port)
    return open_ports


def listening_elsewhere(ports: Sequence[int], log_dir: Path) -> list[int]:
    """The ports among `ports` whose listener is a process of another job: one that did not inherit this job's
    JOB_LOG_DIR. Tests run beside each other, and a job that planned its port block while this one's was still free
    may hold some of the same ports (launch/job/node.py moves a block on only when a port is taken as it plans)."""
    import psutil

    others = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status != psutil.CONN_LISTEN or not conn.laddr or conn.laddr.port not in ports or not conn.pid:
            continue
        try:
            if not of_job(conn.pid, log_dir):
                others.append(conn.laddr.port)
        except OSError:
            continue  # gone meanwhile: counted as this job's until the next look
    return others


def job_ports(log_dir: Path) -> list[int]:
    """Every port the job held on any node: what each node's helper wrote to ports.<rank> (Ray's ports, the worker
    range, the reward servers, verl's SGLang engines), and the reward URLs the head published."""
    from launch.job.node import RAY_PORT_OFFSETS

    ports = set()
    urls = (log_dir / "reward_urls").read_text().strip() if (log_dir / "reward_urls").exists() else ""
    ports |= {int(u.rsplit(":", 1)[1]) for u in urls.split(",") if u}
    for plan_file in log_dir.glob("ports.*"):
        plan = dict(line.split("=", 1) for line in plan_file.read_text().splitlines() if "=" in line)
        ports |= {int(plan[name]) for name in RAY_PORT_OFFSETS}
        ports |= set(range(int(plan["min_worker_port"]), int(plan["max_worker_port"]) + 1))
        ports |= set(range(int(plan["reward_port"]), int(plan["reward_port"]) + int(plan["reward_count"])))
        if "sglang_port" in plan:  # verl's sync SGLang engines: two ports per GPU (launch/job/node.py sglang_port)
            ports |= set(range(int(plan["sglang_port"]), int(plan["sglang_port"]) + 2 * int(plan["gpus"])))
    return sorted(ports)


def assert_everything_stopped(env: Mapping[str, str], timeout: float = 10, logs: Path | None = None) -> None:
    """No process of the job's and no port of the job's is left, within `timeout` seconds of the job's end (the last
    processes of a stopped job may still be exiting); at the deadline, what was still there. `logs`: the log folder
    of one start, for a job that started more than once."""
    logs = logs or job_dir(env)
    hand_set = env.get("CONFIG_REWARD_SERVER_PORT")
    ports = job_ports(logs) + ([int(hand_set)] if hand_set else [])
    deadline = time.monotonic() + timeout
    while True:
        left, open_ports = job_processes(logs), listening(ports)
        if open_ports and not left:  # another job's listener on a port of this job's block is not a leak of this job
            open_ports = sorted(set(open_ports) - set(listening_elsewhere(open_ports, logs)))
        if not left and not open_ports:
            return
        assert time.monotonic() < deadline, (
            f"{timeout:.0f} s after the job ended: processes of the job still run: {left}; ports still open: "
            f"{open_ports}"
        )
        time.sleep(0.5)


def block_settings() -> list[tuple[str, str, str]]:
    """Each setting of the run script's block, in its order: its name, its default as written there (e.g.
    `$repo/verl_app.sif`) and its comment."""
    block = RUN.read_text().split("# ---- settings", 1)[1].split("\n# ------------", 1)[0]
    return re.findall(r'^([A-Z][A-Z0-9_]*)="\$\{\1:-(.*?)\}" *(?:# ?(.*))?$', block, flags=re.M)


def block_environment() -> dict[str, str]:
    """What the run script's settings block alone puts in the environment of the programs it starts: its defaults."""
    out = subprocess.run(
        ["bash", "-c", f'source <(sed -n "/^# ---- settings/,/^# ------------/p" {RUN}); env -0'],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin"},
    ).stdout
    return dict(kv.split("=", 1) for kv in out.split("\0") if "=" in kv)


def gsm8k_rule_data(tmp_path) -> dict:
    """CONFIG_TRAIN_FILE and CONFIG_TEST_FILE of GSM8K-shaped rule rows, built by data_prep.build --preset gsm8k."""
    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"} for i in range(40)]
    return _rule_data(tmp_path / "gsm8k", rows, "--preset", "gsm8k")


def dapo_rule_data(tmp_path) -> dict:
    """The same of DAPO-shaped rule rows (data_source math_dapo, the bare answer; docs/data.md's command): verl's
    DAPO math scorer gives a wrong answer -1, not GSM8K's 0, so a job shows that its rule part scored (the tiny
    policy never answers right)."""
    rows = [
        {"prompt": f"What is {i} + {i}? Give your answer on its own line after 'Answer:'.", "answer": str(2 * i)}
        for i in range(40)
    ]
    return _rule_data(
        tmp_path / "dapo",
        rows,
        "--reward-style",
        "rule",
        "--answer-column",
        "answer",
        "--data-source",
        "math_dapo",
        "--ability",
        "math",
    )


def _rule_data(out: Path, rows: list[dict], *flags: str) -> dict:
    from data_prep.build import main as build_main

    src = out.with_suffix(".jsonl")
    src.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert build_main([str(src), *flags, "--out-dir", str(out), "--test-size", "0.2"]) == 0
    return {f"CONFIG_{s.upper()}_FILE": str(out / f"{s}.parquet") for s in ("train", "test")}
