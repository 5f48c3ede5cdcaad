"""The stall watchdog (docs/operations.md#a-hung-job): on the head, it times the step in flight from trainer.log, and
past its budget keeps every node's stacks in stall/ (the other nodes dump theirs when the head writes stall/request),
writes stall.json and exits STALLED; the helper stops the start.

    python -m launch.job.watchdog watch LOG_DIR TRAINER_PID HOST   # the head, beside the trainer
    python -m launch.job.watchdog dump LOG_DIR HOST                # this node's stacks into LOG_DIR/stall
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from launch.job.ray_cluster import alive
from launch.job.steps import RESUMED_AT, TOTAL_STEPS, command_int, is_training_step, parse_step_lines
from launch.plan import deadline
from launch.plan.deadline import timeout_setting

STALLED = 3  # watch's exit code when it found a stall
STALL_FACTOR = 3  # auto: this many times the longest step (and validation, and save) so far
OTHER_NODES_WAIT = 60  # s the head waits for the other nodes' stacks before it stops the start
LOG_LINES = 30  # last lines of each worker's logs kept
PYSPY = ["py-spy", "dump", "--full-filenames", "--pid"]
NVIDIA_SMI = ["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used,memory.total", "--format=csv"]


@dataclass
class Clock:
    """The budget of the step in flight, from the steps this start has finished."""

    timeout: float | None  # None: auto; else the seconds a step may take
    floor: float
    first: float
    test_freq: int = -1
    save_freq: int = -1
    total: int | None = None  # verl's total training steps, once it has said ("Total training steps: N")
    expiry: float | None = None  # verl's save-before-the-limit expiry (MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP)
    last_step: int | None = None  # the newest step this start finished
    resumed_at: int = 0  # verl's global step this start began after
    longest_step: float = 0.0  # the longest training part of a step (timing_s/step)
    longest: dict[str, float] = field(default_factory=dict)  # testing, save_checkpoint: the longest measured

    @classmethod
    def from_env(cls, env: Mapping[str, str], command: list[str]) -> Clock:
        """The settings as the preflight checked them (launch/plan/refusals.py stall_problems)."""
        clock = cls(
            timeout=timeout_setting(env.get("STALL_TIMEOUT", "auto")),
            floor=float(env["STALL_FLOOR"]),
            first=float(env["STALL_FIRST_STEP"]),
            test_freq=command_int(command, "trainer.test_freq", -1),
            save_freq=command_int(command, "trainer.save_freq", -1),
        )
        expiry = env.get("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", "")
        clock.expiry = float(expiry) if expiry.isdigit() else None
        clock.longest = deadline.measured(deadline.earlier_starts(env))
        clock.longest_step = clock.longest.pop("step", 0.0)
        return clock

    @property
    def next_step(self) -> int:
        return (self.last_step if self.last_step is not None else self.resumed_at) + 1

    def finished(self, step: int, metrics: Mapping[str, float]) -> None:
        """Step `step`'s console line: its training part, validation and save measured."""
        self.last_step = step
        self.longest_step = max(self.longest_step, metrics.get("timing_s/step", 0.0))
        for name in ("testing", "save_checkpoint"):
            if f"timing_s/{name}" in metrics:
                self.longest[name] = max(self.longest.get(name, 0.0), metrics[f"timing_s/{name}"])

    def _extra(self, name: str) -> tuple[float, str]:
        if longest := self.longest.get(name):
            return STALL_FACTOR * longest, f"{STALL_FACTOR} x the longest {name} ({longest:.0f} s)"
        return self.first, f"STALL_FIRST_STEP={self.first:.0f} s for a first {name}"

    def budget(self, now: float) -> tuple[float, str]:
        """(seconds the step in flight may take, why)."""
        if self.last_step is None:
            return self.first, f"the first step of this start: STALL_FIRST_STEP={self.first:.0f} s"
        if self.timeout is not None:
            return self.timeout, f"STALL_TIMEOUT={self.timeout:.0f} s"
        base = max(self.floor, STALL_FACTOR * self.longest_step)
        why = [
            f"STALL_TIMEOUT=auto: {base:.0f} s (STALL_FLOOR={self.floor:.0f} s, {STALL_FACTOR} x the longest step "
            f"{self.longest_step:.0f} s)"
        ]
        step, total = self.next_step, self.total
        last = total is None or step >= total
        seconds = base
        if self.test_freq > 0 and (last or step % self.test_freq == 0):
            extra, because = self._extra("testing")
            seconds += extra
            why.append(f"+ {extra:.0f} s: step {step} validates ({because})")
        save_extra, because = self._extra("save_checkpoint")
        # verl's own check: a save after any step that ends within 60 s + the longest step + its room of the expiry
        esi = self.expiry is not None and self.expiry - now <= seconds + deadline.VERL_SAVE_SECONDS + save_extra
        if self.save_freq > 0 and (last or step % self.save_freq == 0 or esi):
            seconds += save_extra
            why.append(f"+ {save_extra:.0f} s: step {step} saves ({because})")
        return seconds, " ".join(why)


# --- where it hung ------------------------------------------------------------------------------------------------

_PYSPY_FRAME = re.compile(r"^\s+(\S+) \((.+):(\d+)\)$")  # py-spy dump: `    update_actor (/path/x.py:123)`
_FAULT_FRAME = re.compile(r'^\s+File "(.+)", line (\d+) in (\S+)$')  # faulthandler: `  File "x.py", line 1 in f`
_TIMER = re.compile(r"""\b(?:marked_timer|_timer|simple_timer)\(\s*["'](\w+)["']""")


def frames(stack: str) -> list[tuple[str, int, str]]:
    """(file, line, function) of every frame of a py-spy or faulthandler dump, innermost first in each thread."""
    found = []
    for line in stack.splitlines():
        if m := _PYSPY_FRAME.match(line):
            found.append((m.group(2), int(m.group(3)), m.group(1)))
        elif m := _FAULT_FRAME.match(line):
            found.append((m.group(1), int(m.group(2)), m.group(3)))
    return found


def timer_at(path: str, line: int) -> str | None:
    """The innermost verl timer block (`with marked_timer("NAME", ...)`) around line `line` of `path`, other than
    the whole step's."""
    try:
        lines = Path(path).read_text(errors="replace").splitlines()
    except OSError:
        return None
    if not 0 < line <= len(lines):
        return None
    indent = len(lines[line - 1]) - len(lines[line - 1].lstrip())
    for text in reversed(lines[: line - 1]):
        if not text.strip():
            continue
        here = len(text) - len(text.lstrip())
        if here >= indent:
            continue
        indent = here
        if (m := _TIMER.search(text)) and m.group(1) != "step":
            return m.group(1)
        if text.lstrip().startswith("def "):
            return None
    return None


def phase_of(stacks: str) -> tuple[str | None, str | None]:
    """(verl's timer block the trainer's fit is in, file:line) from the stacks, innermost fit frame first."""
    for path, line, function in frames(stacks):
        if function.rpartition(".")[2] == "fit" and path.endswith("trainer.py"):  # py-spy: RayPPOTrainer.fit
            return timer_at(path, line), f"{path}:{line}"
    return None, None


def busy_tasks(stacks: str) -> list[str]:
    """The Ray tasks the workers were running (their process names, ray::Class.method), not the idle ones."""
    names = re.findall(r"^=== process \d+: ray::(\S+\.\S+)", stacks, flags=re.M)
    return sorted(set(names))


# --- the stacks of one node ---------------------------------------------------------------------------------------


def job_ray_processes(log_dir: Path) -> list[tuple[int, str]]:
    """(pid, command line) of this node's processes of the job that run Python code of verl: Ray's workers (their
    process name is ray::...) and the trainer's driver."""
    found = []
    marker = f"JOB_LOG_DIR={log_dir}".encode() + b"\0"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if marker not in (proc / "environ").read_bytes():
                continue
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if cmdline.startswith("ray::") or "verl.trainer.main_ppo" in cmdline or "main_dapo" in cmdline:
            found.append((int(proc.name), cmdline))
    return sorted(found)


def worker_logs(ray_tmp: str, pid: int) -> list[Path]:
    """Ray's log files of worker `pid` (worker-<id>-<job>-<pid>.out/.err in the session's logs)."""
    logs = Path(ray_tmp) / "session_latest" / "logs"
    return sorted(logs.glob(f"worker-*-{pid}.out")) + sorted(logs.glob(f"worker-*-{pid}.err"))


def command_output(command: list[str]) -> str | None:
    """What py-spy or nvidia-smi printed; None where it failed, is missing or took 30 s."""
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return run.stdout if run.returncode == 0 and run.stdout.strip() else None


def read_from(path: Path, offset: int) -> bytes:
    """What a file holds from byte `offset` on; nothing where it cannot be read (not written yet, gone)."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return b""


def faulthandler_stacks(pids: list[int], logs: Mapping[int, list[Path]], wait: float = 30.0) -> dict[int, str]:
    """Each process's Python stacks as faulthandler prints them on SIGABRT (which ends the process: the start is
    stopped right after), read from the end of its log (where its stderr goes). A Ray worker's own SIGABRT handler
    (Ray's C++ core: `*** SIGABRT received at ...`, then its C++ stack) runs first and hands over to faulthandler only
    after it: on a loaded node that took over 10 s (CI, 2 cores), hence the wait. A dump is whole once its process has
    ended (faulthandler writes a thread at a time: a read before that missed the blocked main thread in CI), so the
    wait ends when every process is gone with its dump read after that; at the deadline, what was read."""
    sizes = {p: p.stat().st_size for pid in pids for p in logs.get(pid, []) if p.exists()}
    for pid in pids:
        with contextlib.suppress(OSError):  # gone already
            os.kill(pid, signal.SIGABRT)
    found: dict[int, str] = {}
    end = time.monotonic() + wait
    while True:
        gone = not any(alive(pid) for pid in pids)  # before the read: a read after every end is whole
        for pid in pids:
            for path in logs.get(pid, []):
                text = read_from(path, sizes.get(path, 0)).decode(errors="replace")
                if "Fatal Python error" in text and frames(text):
                    found[pid] = text[text.index("Fatal Python error") :]
        if (gone and len(found) == len(pids)) or time.monotonic() >= end:
            return found
        time.sleep(0.5)


def _tail(path: Path, lines: int = LOG_LINES) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(unreadable)"


def dump(log_dir: Path, host: str, env: Mapping[str, str] | None = None) -> Path:
    """This node's part: every Python stack of the job's Ray workers and driver, their logs' last lines and the
    GPUs' use, into stall/stacks_<host>.txt (written whole, then renamed: the head waits for it)."""
    env = os.environ if env is None else env
    folder = log_dir / "stall"
    folder.mkdir(parents=True, exist_ok=True)
    processes = job_ray_processes(log_dir)
    ray_tmp = env.get("RAY_TMP_DIR", "")
    logs = {pid: worker_logs(ray_tmp, pid) if ray_tmp else [] for pid, _ in processes}
    for pid, cmdline in processes:
        if not cmdline.startswith("ray::"):
            logs[pid] = [log_dir / "trainer.log"]
    # py-spy comes with ray[default]
    stacks = {pid: stack for pid, _ in processes if (stack := command_output([*PYSPY, str(pid)]))}
    missing = [pid for pid, _ in processes if pid not in stacks]  # no ptrace allowed, or py-spy missing after all
    how = "py-spy dump" + (f"; faulthandler (SIGABRT) where py-spy could not: {missing}" if missing else "")
    stacks |= faulthandler_stacks(missing, logs)
    parts = [f"# {host}: {len(processes)} process(es) of the job's Ray workers and driver; stacks by {how}\n"]
    for pid, cmdline in processes:
        parts.append(
            f"=== process {pid}: {cmdline}\n{stacks.get(pid, '(no stack: it had exited, or both ways failed)')}"
        )
        for path in logs[pid]:
            parts.append(f"--- last {LOG_LINES} lines of {path} ---\n{_tail(path)}\n")
    parts.append(f"=== GPUs (nvidia-smi) ===\n{command_output(NVIDIA_SMI) or '(nvidia-smi failed, or is missing)'}\n")
    target = folder / f"stacks_{host}.txt"
    tmp = target.with_suffix(".tmp")
    tmp.write_text("\n".join(parts))
    tmp.rename(target)
    return target


# --- the head's watch ---------------------------------------------------------------------------------------------


def other_hosts(log_dir: Path, host: str) -> list[str]:
    """The job's other nodes (each helper writes ports.<rank> with its node's name)."""
    lines = [line for plan in sorted(log_dir.glob("ports.*")) for line in plan.read_text(errors="replace").splitlines()]
    return [line[5:] for line in lines if line.startswith("node=") and line[5:] != host]


def on_stall(
    log_dir: Path, host: str, clock: Clock, since: float, budget: float, why: str, env: Mapping[str, str]
) -> dict:
    """Keep the stacks of every node, find the phase, write stall.json; what it says."""
    folder = log_dir / "stall"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "request").write_text(f"{time.time():.0f}\n")  # the other nodes' helpers dump theirs
    files = [dump(log_dir, host, env)]
    others = other_hosts(log_dir, host)
    end = time.monotonic() + OTHER_NODES_WAIT
    while time.monotonic() < end and not all((folder / f"stacks_{h}.txt").exists() for h in others):
        time.sleep(1)
    files += [folder / f"stacks_{h}.txt" for h in others if (folder / f"stacks_{h}.txt").exists()]
    text = "\n".join(f.read_text(errors="replace") for f in files)
    phase, where = phase_of(text)
    tasks = busy_tasks(text)
    step = clock.next_step
    said = f"in step {step}" + (f", phase {phase} (verl's timer at {where})" if phase else ", phase unknown")
    if tasks:
        said += f"; the Ray workers were running {', '.join(tasks)}"
    missing = [h for h in others if not (folder / f"stacks_{h}.txt").exists()]
    record = {
        "since": since,
        "step": step,
        "phase": phase,
        "tasks": tasks,
        "budget": round(budget),
        "setting": env.get("STALL_TIMEOUT", "auto"),
        "stacks": str(folder),
        "message": (
            f"no training step finished for {time.time() - since:.0f} s, past the budget of {budget:.0f} s ({why}): "
            f"hung {said}; every worker's Python stack, its log's last lines and GPU use: {folder}"
            + (f" (no stacks from {', '.join(missing)} within {OTHER_NODES_WAIT} s)" if missing else "")
        ),
    }
    tmp = log_dir / "stall.json.tmp"
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.rename(log_dir / "stall.json")
    return record


def watch(log_dir: Path, trainer_pid: int, host: str, env: Mapping[str, str] | None = None, poll: float = 2.0) -> int:
    """Until the trainer exits (0) or stalls (STALLED, after on_stall)."""
    env = os.environ if env is None else env
    command = (log_dir / "trainer_command.txt").read_text(errors="replace").splitlines()
    clock = Clock.from_env(env, command)
    log = log_dir / "trainer.log"
    since, offset, pending = time.time(), 0, ""
    print(f"watching {log} (pid {trainer_pid}): {clock.budget(since)[1]}", flush=True)
    while alive(trainer_pid):
        chunk = read_from(log, offset)
        offset += len(chunk)
        pending += chunk.decode(errors="replace")
        lines, _, pending = pending.rpartition("\n")
        if lines:
            if (m := TOTAL_STEPS.findall(lines)) and clock.total is None:
                clock.total = int(m[-1])
            if (m := RESUMED_AT.findall(lines)) and clock.last_step is None:
                clock.resumed_at = int(m[-1])
            for step, metrics in sorted(parse_step_lines(lines).items()):
                if is_training_step(metrics):
                    clock.finished(step, metrics)
                    since = time.time()
                    print(f"step {step} finished; the next may take {clock.budget(since)[1]}", flush=True)
        now = time.time()
        budget, why = clock.budget(now)
        if now - since > budget:
            record = on_stall(log_dir, host, clock, since, budget, why, env)
            print(record["message"], file=sys.stderr, flush=True)
            return STALLED
        time.sleep(poll)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["watch"] and len(argv) == 4:
        return watch(Path(argv[1]), int(argv[2]), argv[3])
    if argv[:1] == ["dump"] and len(argv) == 3:
        print(dump(Path(argv[1]), argv[2]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
