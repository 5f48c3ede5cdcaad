"""Reading a job, for launch/watch/status.py: every start's folder (trainer.log, trainer_command.txt, `done` and
`exit`, the preflight's and the stall watchdog's records, the reward servers' logs), the job's Slurm output file, Slurm
itself (scontrol) and the checkpoint folder, into one Job (`load`); nothing is written. verl's
step lines are parsed in launch/job/steps.py. Also the times as text (duration, clock) a start's description uses."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from launch.job.checkpoints import TRACKER, saved_step
from launch.job.steps import ANSI, RESUMED_AT, TOTAL_STEPS, is_training_step, override, parse_step_lines

REPO = Path(__file__).resolve().parents[2]
RUN_SCRIPT = REPO / "run_grpo_qwen3_4b_mega_verl.sh"
OPERATIONS = "docs/operations.md"

CHECKPOINT_BEFORE_END = 1800  # the settings block's default, when the job's output does not say

# The trainer's own failures, as its log shows them (torch, NCCL, SGLang 0.5.2, vLLM, Ray); the first matching line
# of trainer.log is the likely cause (later ranks fail on what the first one did), and the section of
# docs/operations.md that says what to do.
FAILURES = (
    (
        "the trainer ran out of GPU memory",
        "cuda-out-of-memory",
        r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory",
    ),
    (
        "SGLang failed to start",
        "sglang-or-vllm-failed-to-start",
        r"scheduler is dead|Not enough memory\. Please try to increase --mem-fraction-static|Initialization failed\. "
        r"warmup error|Server process terminated unexpectedly during startup|Server failed to become healthy",
    ),
    (
        "vLLM failed to start",
        "sglang-or-vllm-failed-to-start",
        r"No available memory for the cache blocks|Engine core initialization failed|is less than desired GPU memory "
        r"utilization",
    ),
    (
        "NCCL timed out or failed",
        "nccl-timeouts-and-hangs",
        r"Watchdog caught collective operation timeout|ncclSystemError|ncclInternalError|ncclUnhandledCudaError|"
        r"ncclRemoteError|NCCL error|DistBackendError|NCCL communicator was aborted",
    ),
    (
        "a node was lost",
        "a-node-lost",
        r"has been marked dead because the detector has missed too many heartbeats|ActorDiedError|The actor died "
        r"unexpectedly|RaySystemError|raylet.*died|node_failure",
    ),
    # the reward function's client (reward_score/safe_hack_reward_request.py): every server failed for
    # REWARD_RETRY_SECONDS, or one refused a request (4xx)
    (
        "the reward servers did not score",
        "the-reward-servers-did-not-score",
        r"RewardServerError|did not score within \d+ s|RewardRequestRejected|refused the request with 4\d\d",
    ),
)

_STAMP = r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] "
_START = re.compile(_STAMP + r"=== job (\S+): logs in (.+) \(\+\d+s\)$")
_BEFORE_END = re.compile(r"CHECKPOINT_BEFORE_END=(\d+) s before the time limit")
_RESTART = re.compile(r"^=== (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) restart (\d+) after: (.*) ===$")
_FOLDER = re.compile(r"^(?P<id>.+?)(?:-r(?P<n>\d+))?$")
PREFLIGHT_ONLY = "preflight only"  # a start's `kind` (the run script writes it): preflight only, canary or training


class StatusError(RuntimeError):
    """Bad input: the message names what was looked for and where."""


# --- reading verl's output ------------------------------------------------------------------------------------------


def first_failure(text: str) -> dict | None:
    """The earliest line of the trainer's log that FAILURES knows, with what it means and where the docs say more."""
    best = None
    for what, anchor, pattern in FAILURES:
        m = re.search(pattern, text)
        if m and (best is None or m.start() < best[0]):
            line_start = text.rfind("\n", 0, m.start()) + 1
            line_end = text.find("\n", m.end())
            line = ANSI.sub("", text[line_start : line_end if line_end >= 0 else len(text)]).strip()
            best = (m.start(), {"what": what, "line": line[:240], "docs": f"{OPERATIONS}#{anchor}"})
    return best[1] if best else None


# --- one start of the job: its folder, and its part of the job's output ---------------------------------------------


@dataclass
class Start:
    folder: Path
    began: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    how: str = ""  # how it ended, from the job's own lines
    kind: str = ""  # what the run script started: preflight only, canary or training ("" from an older script)
    preflight_problem: str = ""  # the preflight's first refusal (its stderr, preflight.err), where it failed
    errors: list[str] = field(default_factory=list)
    trainer_started: float | None = None
    last_write: float | None = None  # trainer.log's last change
    resumed_from: int | None = None
    total: int | None = None
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    failure: dict | None = None
    reward_restarts: list[dict] = field(default_factory=list)
    trainer_finished: bool = False
    ckpt_root: str | None = None
    critic_updates: int | None = None  # PPO's critic updates a step (critic_updates_per_step), when the command says
    stall: dict | None = None  # what the stall watchdog found (stall.json: launch/job/watchdog.py), if this start hung
    log: str | None = None  # the trainer.log its steps came from, where there is one (a canary's: its newest stage's)

    @property
    def name(self) -> str:
        return self.folder.name

    def training_steps(self) -> list[int]:
        return sorted(n for n, m in self.steps.items() if is_training_step(m))


def stamp(text: str) -> float:
    return time.mktime(time.strptime(text, "%Y-%m-%d %H:%M:%S"))


def read_text(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def read_folder(folder: Path) -> Start:
    """What a start left in its folder."""
    s = Start(folder=folder)
    files = [p for p in folder.iterdir() if p.is_file()] if folder.is_dir() else []
    times = [t for t in map(mtime, files) if t is not None]
    s.began = min(times) if times else mtime(folder)
    log = folder / "trainer.log"
    text = read_text(log)
    s.last_write = mtime(log)
    s.steps = parse_step_lines(text)
    totals = TOTAL_STEPS.findall(text)
    s.total = int(totals[-1]) if totals else None
    resumed = RESUMED_AT.findall(text)
    s.resumed_from = int(resumed[-1]) if resumed else (0 if "Training from scratch" in text else None)
    s.failure = first_failure(text)
    s.trainer_started = mtime(folder / "trainer_command.txt")
    command = read_text(folder / "trainer_command.txt").splitlines()
    s.ckpt_root = override(command, "trainer.default_local_dir")
    s.critic_updates = critic_updates_per_step(command)
    s.kind = read_text(folder / "kind").strip()
    # The run script's own end (`exit`, every kind of start) over the head's (`done`: the trainer's exit code)
    for name in ("done", "exit"):
        code = read_text(folder / name).strip()
        if code.lstrip("-").isdigit():
            s.exit_code, s.ended = int(code), mtime(folder / name)
    s.trainer_finished = read_text(folder / "done").strip() == "0"
    # The preflight's first refusal on its stderr (launch/plan/preflight.py): each line of its own there but a warning
    said = [line for line in read_text(folder / "preflight.err").splitlines() if not line.startswith("preflight: WARN")]
    s.preflight_problem = next((line for line in said if line.startswith(("setting error: ", "preflight: "))), "")
    try:
        s.stall = json.loads(read_text(folder / "stall.json")) or None
    except ValueError:
        s.stall = None
    for server_log in sorted(folder.glob("reward_server_*.log")):
        for line in read_text(server_log).splitlines():
            if m := _RESTART.match(line):
                s.reward_restarts.append({"log": str(server_log), "when": stamp(m.group(1)), "reason": m.group(3)})
    s.log = str(log) if log.is_file() else None
    for stage in ("train", "resume"):  # a canary's training stages (launch/watch/canary.sh): one run, its steps
        if (folder / "canary" / stage / "trainer.log").is_file():
            t = read_folder(folder / "canary" / stage)
            s.steps |= t.steps
            s.total, s.log, s.last_write = t.total or s.total, t.log, t.last_write
            s.ckpt_root = t.ckpt_root or s.ckpt_root
    return s


def is_start(folder: Path) -> bool:
    """A start's folder (the run script's kind, or what a start leaves), not a folder of jobs (CONFIG_LOG_DIR)."""
    return any((folder / n).exists() for n in ("kind", "trainer.log", "trainer_command.txt", "exit", "done"))


def canary_results(path: Path) -> dict[str, dict]:
    """The canary's results.jsonl (launch/watch/canary.py appends a line a stage) as {stage: its entry}; a line cut
    short while it is written is passed over."""
    out = {}
    for line in read_text(path).splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        out[entry.get("stage")] = entry
    return out


def critic_updates_per_step(command: list[str]) -> int | None:
    """The critic's optimizer updates a step in a trainer command (one override a line): its mini-batches (verl's
    critic.ppo_mini_batch_size follows the actor's) times its epochs (critic.ppo_epochs, the actor's, 1). None
    without a critic, or when the command does not say."""
    keys = dict(a.split("=", 1) for a in command if "=" in a)  # the last override of a key wins, as in Hydra
    if "critic.model.path" not in keys:
        return None
    actor = "actor_rollout_ref.actor"
    try:
        batch = int(keys["data.train_batch_size"])
        mini = int(keys.get("critic.ppo_mini_batch_size", keys[f"{actor}.ppo_mini_batch_size"]))
        epochs = int(keys.get("critic.ppo_epochs", keys.get(f"{actor}.ppo_epochs", "1")))
    except (KeyError, ValueError):
        return None
    return max(batch // max(mini, 1), 1) * epochs


def read_output(text: str, starts: dict[str, Start]) -> dict:
    """The job's Slurm output (every start appended): each start's times, how it ended and its errors, into
    `starts` (by folder name); and what holds for the whole job."""
    job: dict = {}
    current: Start | None = None
    for line in text.splitlines():
        if m := _START.match(line):
            current = starts.get(Path(m.group(3)).name)
            if current is not None:
                current.began, current.errors, current.how = stamp(m.group(1)), [], ""
            continue
        if m := _BEFORE_END.search(line):
            job["checkpoint_before_end"] = int(m.group(1))
        if current is None:
            continue
        if "time-limit signal: requeueing job" in line:
            current.how = "requeued at the time-limit signal"
        elif "stop signal: stopping the job on every node" in line:
            current.how = current.how or "stopped by a signal (scancel, a requeue, Ctrl-C)"
        elif "TRAINING_DONE exists: this training already finished" in line:
            current.how = "nothing to do: TRAINING_DONE was there"
        elif "] ERROR: " in line:
            current.errors.append(line.split("] ERROR: ", 1)[1])
    return job


# --- Slurm ------------------------------------------------------------------------------------------------------------


def slurm_time(value: str | None) -> float | None:
    try:
        return stamp(value.replace("T", " ")) if value else None
    except ValueError:
        return None  # Unknown, None, N/A


def slurm_duration(value: str | None) -> float | None:
    """Slurm's [D-]HH:MM:SS (or MM:SS) in seconds; None for UNLIMITED and the like."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", value or "")
    if not m:
        return None
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def ask_slurm(job_id: str) -> tuple[dict | None, list[str]]:
    """What scontrol knows of the job (state, reason, restarts, times, time limit, output file, nodes), and a note
    when it was not there or did not know it (it forgets ended jobs after MinJobAge: the folders are enough then)."""
    if not re.fullmatch(r"\d+", job_id):
        return None, [f"job {job_id} ran without Slurm"]
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        return None, ["scontrol is not on PATH"]
    except (OSError, subprocess.TimeoutExpired):
        out = None
    if not (out and out.returncode == 0 and "JobState=" in out.stdout):
        return None, ["scontrol does not know the job (it forgets ended jobs after MinJobAge)"]
    f = dict(re.findall(r"(\S+?)=(\S*)", out.stdout))
    return {
        "state": f.get("JobState"),
        "reason": f.get("Reason"),
        "restarts": int(f.get("Restarts") or 0),
        "end": slurm_time(f.get("EndTime")),
        "time_limit": slurm_duration(f.get("TimeLimit")),
        "output": f.get("StdOut"),
        "nodes": f.get("NodeList"),
        "exit_code": f.get("ExitCode"),
    }, []


# --- the job ------------------------------------------------------------------------------------------------------


def default_log_dir() -> Path:
    return Path(os.environ.get("CONFIG_LOG_DIR") or REPO / "logs")


def start_folders(log_dir: Path) -> list[tuple[str, int, Path]]:
    """(job id, restart count, folder) of every start's folder in log_dir."""
    found = [(p, _FOLDER.match(p.name)) for p in log_dir.iterdir()] if log_dir.is_dir() else []
    return [(m.group("id"), int(m.group("n") or 0), p) for p, m in found if m and p.is_dir()]


def job_folders(log_dir: Path, job_id: str) -> list[tuple[int, Path]]:
    """(restart count, folder) of every start of the job, oldest first."""
    return sorted((n, p) for id_, n, p in start_folders(log_dir) if id_ == job_id)


def newest_job(log_dir: Path) -> str:
    """The job whose newest start folder changed last."""
    changed = [(max(mtime(f) or 0.0 for f in [p, *p.iterdir()]), id_) for id_, _, p in start_folders(log_dir)]
    if not changed:
        raise StatusError(f"no job folders in {log_dir} (CONFIG_LOG_DIR): give a job id or a job's log folder")
    return max(changed)[1]


def find_output(job_id: str, log_dir: Path, slurm: dict | None) -> Path | None:
    """The job's Slurm output file: where Slurm says, else the run script's --output=logs/%x-%j.out."""
    candidates = [Path(slurm["output"])] if slurm and slurm.get("output") else []
    for folder in dict.fromkeys([log_dir, REPO / "logs"]):
        candidates += sorted(folder.glob(f"*-{job_id}.out")) + [folder / f"slurm-{job_id}.out"]
    return next((p for p in candidates if p.is_file()), None)


def checkpoint(root: str | None) -> dict | None:
    """The newest checkpoint verl's tracker file names: its step, folder, age and size; and TRAINING_DONE."""
    if not root:
        return None
    base = Path(root)
    out = {"root": root, "training_done": (base / "TRAINING_DONE").exists(), "step": None}
    step = saved_step(base)
    if step is None:
        return out
    folder = base / f"global_step_{step}"
    size = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            with contextlib.suppress(OSError):  # pruned meanwhile
                size += os.lstat(os.path.join(dirpath, name)).st_size
    return out | {"step": step, "path": str(folder), "saved": mtime(base / TRACKER), "bytes": size}


def signal_lead() -> int:
    """The run script's time-limit signal lead (#SBATCH --signal=B:USR1@N): when a job requeues itself."""
    m = re.search(r"^#SBATCH --signal=\S*@(\d+)", read_text(RUN_SCRIPT), flags=re.M)
    return int(m.group(1)) if m else 0


@dataclass
class Job:
    id: str
    log_dir: Path
    starts: list[Start]
    slurm: dict | None
    slurm_notes: list[str]
    output: Path | None
    checkpoint: dict | None
    checkpoint_before_end: int
    canary: Path | None
    now: float

    @property
    def newest(self) -> Start | None:
        return self.starts[-1] if self.starts else None


def load(target: str | None, log_dir: Path | None = None, now: float | None = None) -> Job:
    """Everything known of the job `target` (an id, a start's folder, or None for the newest job)."""
    folder = Path(target).resolve() if target and Path(target).is_dir() else None
    if folder and folder.parent.name == "canary":  # a canary's stage: the job it is a stage of
        folder = folder.parent.parent
    if folder and not is_start(folder):  # a folder of jobs: CONFIG_LOG_DIR, or make demo's demo_out/ (its logs/)
        log_dir = folder / "logs" if (folder / "logs").is_dir() else folder
        folder, target = None, newest_job(log_dir)
    if folder:
        log_dir, job_id = folder.parent, _FOLDER.match(folder.name).group("id")
    else:
        log_dir = log_dir or default_log_dir()
        job_id = target or newest_job(log_dir)
    folders = job_folders(log_dir, job_id)
    slurm, notes = ask_slurm(job_id)
    if not folders and slurm is None:
        raise StatusError(
            f"no job {job_id}: no folder {log_dir / job_id} (CONFIG_LOG_DIR={log_dir}) and Slurm does not know it "
            f"({'; '.join(notes)}): give the job's id or its log folder"
        )
    starts = [read_folder(folder) for _, folder in folders]
    output = find_output(job_id, log_dir, slurm)
    job_lines = read_output(read_text(output), {s.name: s for s in starts}) if output else {}
    requeued = starts[:-1]  # a start of the same job id after it: Slurm requeued this one
    if slurm and slurm["state"] == "PENDING" and starts and slurm["restarts"] >= len(starts):
        requeued = starts  # the newest too: its next start is waiting
    for s in requeued:
        if not s.how.startswith("requeued"):
            s.how = "requeued (scontrol requeue, or by Slurm after a node failure)"
    for s in starts:
        if s.exit_code == 0 and s.trainer_finished:
            s.how = s.how or "the trainer finished"
        if s.stall:
            s.how = f"stalled ({stall_text(s.stall)})" + ("; requeued" if s in requeued else "")
    root = next((s.ckpt_root for s in reversed(starts) if s.ckpt_root), None)
    canary = next((f / "canary" for _, f in folders if (f / "canary").is_dir()), None)
    before_end = job_lines.get("checkpoint_before_end") or int(
        os.environ.get("CHECKPOINT_BEFORE_END") or CHECKPOINT_BEFORE_END
    )
    return Job(
        job_id,
        log_dir,
        starts,
        slurm,
        notes,
        output,
        checkpoint(root),
        before_end,
        canary,
        time.time() if now is None else now,
    )


# --- times as text -------------------------------------------------------------------------------------------------


def stall_text(stall: dict) -> str:
    """Where and since when a start hung, as the stall watchdog recorded it."""
    phase = f", phase {stall['phase']}" if stall.get("phase") else ""
    return (
        f"no step finished since {clock(stall.get('since'))} (budget {duration(stall.get('budget') or 0)}, "
        f"STALL_TIMEOUT={stall.get('setting')}): hung in step {stall.get('step')}{phase}; stacks in "
        f"{stall.get('stacks')}"
    )


def duration(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    if seconds < 120:
        return f"{seconds} s"
    minutes = seconds // 60
    if minutes < 120:
        return f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min" if hours < 48 else f"{hours // 24} d {hours % 24} h"


def clock(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(t)) if t else "?"
