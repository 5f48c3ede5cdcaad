"""Where a job is, when it ends and whether it learns, in one command; read-only, for a running job or an ended one.

    python -m launch.watch.status                      # the newest job in CONFIG_LOG_DIR (default: the repository's logs/)
    python -m launch.watch.status 24                   # job 24: its folders logs/24, logs/24-r1, ... and what Slurm says
    python -m launch.watch.status logs/24-r1           # the job that folder belongs to
    python -m launch.watch.status 24 --png 24.png      # and its curves (reward, length, KL, entropy, step time)
    python -m launch.watch.status 24 --follow          # again every 60 s (--follow 10: every 10 s) until the job ends
    python -m launch.watch.status 24 --json            # all of it as one JSON object, for scripts

What it reads: every start's folder (`<id>`, `<id>-r1`, ...: trainer.log with verl's own step lines, `step:N -
key:value - ...` from its console logger, verl/utils/logger/aggregate_logger.py; trainer_command.txt; `done`; the
reward servers' logs with their restart markers), the job's Slurm output file (the run script's timestamped lines:
each start, the time limit, requeues, exits and errors), the checkpoint folder the trainer command names, and Slurm
itself where its programs are on PATH (scontrol, else squeue, else sacct; any of them may be missing, or know the job
no more). Nothing is written, except the --png file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from launch.job.steps import (
    _ANSI,
    _PROGRESS,
    _RESUMED,
    _TOTAL,
    is_training_step,
    parse_step_lines,
    wall_seconds,
)

REPO = Path(__file__).resolve().parents[2]
RUN_SCRIPT = REPO / "run_grpo_qwen3_4b_mega_verl.sh"
OPERATIONS = "docs/operations.md"

STALL_MINUTES = 30  # no new step for this long (or 3 of the longest steps, if longer) while running: a warning
CHECKPOINT_BEFORE_END = 1800  # the settings block's default, when the job's output does not say
WINDOW = 20  # steps a trend is measured over
WALL_WINDOW = 50  # steps the time per step, validations and saves included, is averaged over

# The metrics that say whether a run learns, in verl 0.6.1's names, with what a healthy run shows (rules of thumb
# for GRPO with a reward model; docs/operations.md has the same table, checked by tests/test_status.py).
METRICS = {
    "critic/score/mean": "rises over the run (its scale is the reward model's); flat or NaN: nothing to learn from",
    "response_length/mean": "below MAX_RESPONSE_LENGTH; a thinking model's often grows as it learns",
    "response_length/clip_ratio": "below 0.2; above 0.5 responses are mostly cut off",
    "actor/kl_loss": "small, rising slowly (about 0.001-0.1 at KL_LOSS_COEF=0.001); climbing fast: the policy drifts",
    "actor/pg_clipfrac": "below 0.2 (often 0.001-0.05); above 0.3 the updates are too large",
    "actor/entropy": "falls slowly; near 0 the policy has collapsed onto a few answers",
    "timing_s/step": "steady; a jump: the rollout, the reward servers or a slow node",
    "val-core/": "rises with critic/score/mean; falling while the score rises: the policy games the reward model",
}
CLIP_HIGH = 0.5
PG_CLIPFRAC_HIGH = 0.3
KL_HIGH = 1.0
KL_RISE = 3.0  # the last 10 steps' mean KL over the 10 before's...
KL_NOTABLE = 0.02  # ...once it is this large at all
ENTROPY_FLOOR = 0.05
# PPO's critic/vf_clipfrac: the share of value predictions the clip held (verl 0.6.1 core_algos.py:1403-1410), the
# mean of a step's micro-batches. The first critic update of a step predicts with the weights that gave the old
# values, so nothing there can be clipped: with U updates a step (mini-batches x critic epochs) the most it can read
# is 1 - 1/U (0.5 for the defaults' two mini-batches). Near that ceiling the critic cannot follow the rewards.
VF_CLIPFRAC_HIGH = 0.9  # of that ceiling, averaged over the last 5 steps

# The trainer's own failures, as its log shows them (torch, NCCL, SGLang 0.5.2, vLLM, Ray); the first matching line
# of trainer.log is the likely cause (later ranks fail on what the first one did), and the section of
# docs/operations.md that says what to do.
FAILURES = (
    ("the trainer ran out of GPU memory", "cuda-out-of-memory",
     r"CUDA out of memory|OutOfMemoryError|CUDA error: out of memory"),
    ("SGLang failed to start", "sglang-or-vllm-failed-to-start",
     r"scheduler is dead|Not enough memory\. Please try to increase --mem-fraction-static|Initialization failed\. "
     r"warmup error|Server process terminated unexpectedly during startup|Server failed to become healthy"),
    ("vLLM failed to start", "sglang-or-vllm-failed-to-start",
     r"No available memory for the cache blocks|Engine core initialization failed|is less than desired GPU memory "
     r"utilization"),
    ("NCCL timed out or failed", "nccl-timeouts-and-hangs",
     r"Watchdog caught collective operation timeout|ncclSystemError|ncclInternalError|ncclUnhandledCudaError|"
     r"ncclRemoteError|NCCL error|DistBackendError|NCCL communicator was aborted"),
    ("a node was lost", "a-node-lost",
     r"has been marked dead because the detector has missed too many heartbeats|ActorDiedError|The actor died "
     r"unexpectedly|RaySystemError|raylet.*died|node_failure"),
    # the reward function's client (reward_score/safe_hack_reward_request.py): every server failed for
    # REWARD_RETRY_SECONDS, or one refused a request (4xx)
    ("the reward servers did not score", "the-reward-servers-did-not-score",
     r"RewardServerError|did not score within \d+ s|RewardRequestRejected|refused the request with 4\d\d"),
)  # fmt: skip

_STAMP = r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] "
_START = re.compile(_STAMP + r"=== job (\S+): logs in (.+) \(\+\d+s\)$")
_EXIT = re.compile(_STAMP + r"run_grpo_qwen3_4b_mega_verl\.sh exiting \(exit_code=(\d+); logs: (.+)\)$")
_ENDS_AT = re.compile(_STAMP + r"the job ends at (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)")
_BEFORE_END = re.compile(r"CHECKPOINT_BEFORE_END=(\d+) s before the time limit")
_RESTART = re.compile(r"^=== (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) restart (\d+) after: (.*) ===$")
_FOLDER = re.compile(r"^(?P<id>.+?)(?:-r(?P<n>\d+))?$")
FINAL = {"finished", "failed", "cancelled", "ended"}
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
            line = _ANSI.sub("", text[line_start : line_end if line_end >= 0 else len(text)]).strip()
            best = (m.start(), {"what": what, "line": line[:240], "docs": f"{OPERATIONS}#{anchor}"})
    return best[1] if best else None


# --- one start of the job: its folder, and its part of the job's output ---------------------------------------------


@dataclass
class Start:
    folder: Path
    restart: int
    began: float | None = None
    ended: float | None = None
    exit_code: int | None = None
    how: str = ""  # how it ended, from the job's own lines
    kind: str = ""  # what the run script started: preflight only, canary or training ("" from an older script)
    preflight_problem: str = ""  # the preflight's first refusal (its stderr, preflight.err), where it failed
    errors: list[str] = field(default_factory=list)
    ends_at: float | None = None  # this start's time limit, as the run script logged it
    trainer_started: float | None = None
    last_write: float | None = None  # trainer.log's last change
    resumed_from: int | None = None
    total: int | None = None
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    failure: dict | None = None
    node_failures: list[str] = field(default_factory=list)
    reward_restarts: list[dict] = field(default_factory=list)
    trainer_finished: bool = False
    ckpt_root: str | None = None
    critic_updates: int | None = None  # PPO's critic updates a step (critic_updates_per_step), when the command says
    stall: dict | None = None  # what the stall watchdog found (stall.json: launch/job/watchdog.py), if this start hung

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


def read_folder(folder: Path, restart: int) -> Start:
    """What a start left in its folder."""
    s = Start(folder=folder, restart=restart)
    files = [p for p in folder.iterdir() if p.is_file()] if folder.is_dir() else []
    times = [t for t in map(mtime, files) if t is not None]
    s.began = min(times) if times else mtime(folder)
    log = folder / "trainer.log"
    text = read_text(log)
    s.last_write = mtime(log)
    s.steps = parse_step_lines(text)
    totals = _TOTAL.findall(text) or [t for _, t in _PROGRESS.findall(text)]
    s.total = int(totals[-1]) if totals else None
    resumed = _RESUMED.findall(text)
    s.resumed_from = int(resumed[-1]) if resumed else (0 if "Training from scratch" in text else None)
    s.failure = first_failure(text)
    s.trainer_started = mtime(folder / "trainer_command.txt")
    command = read_text(folder / "trainer_command.txt").splitlines()
    s.ckpt_root = next((a.split("=", 1)[1] for a in reversed(command) if a.startswith("trainer.default_local_dir=")),
                       None)  # fmt: skip
    s.critic_updates = critic_updates_per_step(command)
    s.kind = read_text(folder / "kind").strip()
    # The run script's own end (`exit`, every kind of start) over the trainer's (`done`, written by the helper)
    for name in ("done", "exit"):
        code = read_text(folder / name).strip()
        if code.lstrip("-").isdigit():
            s.exit_code, s.ended = int(code), mtime(folder / name)
    s.preflight_problem = next(
        (line for line in read_text(folder / "preflight.err").splitlines() if line.startswith(PREFLIGHT_PROBLEMS)), ""
    )
    s.node_failures = [read_text(p).strip() for p in sorted(folder.glob("node_failed.*"))]
    try:
        s.stall = json.loads(read_text(folder / "stall.json")) or None
    except ValueError:
        s.stall = None
    for server_log in sorted(folder.glob("reward_server_*.log")):
        for line in read_text(server_log).splitlines():
            if m := _RESTART.match(line):
                s.reward_restarts.append({"log": str(server_log), "when": stamp(m.group(1)), "reason": m.group(3)})
    return s


# The preflight's refusals on its stderr (launch/plan/preflight.py), its warnings and notes not among them.
PREFLIGHT_PROBLEMS = ("setting error: ", "preflight: refused: ", "preflight: verl 0.6.1 ", "preflight: verl's ",
                      "preflight: the trainer cannot start here: ", "preflight: the reward check failed: ",
                      "preflight: the train/test parquet", "preflight: cannot size ", "preflight: PREFLIGHT_REWARD_PAIRS",
                      "preflight: the reward model ranks ")  # fmt: skip


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


def value_clip_warnings(clipfracs: list[float], updates: int | None) -> list[str]:
    """A warning when PPO's value clip held nearly every prediction it could (critic/vf_clipfrac of recent steps
    against its ceiling 1 - 1/updates; 1 when the updates a step are not known); the canary's summary says it too."""
    warnings: list[str] = []
    finite = [v for v in clipfracs if math.isfinite(v)]
    ceiling = 1.0 if updates is None else 1 - 1 / updates
    if not finite or ceiling <= 0 or statistics.mean(finite) < VF_CLIPFRAC_HIGH * ceiling:
        return warnings
    warnings.append(
        f"critic/vf_clipfrac averaged {statistics.mean(finite):.2f} over the last {len(finite)} steps (the most it can "
        f"read is {ceiling:.2f}): the critic cannot follow the rewards. PPO's value clip holds each prediction within "
        "CRITIC_CLIPRANGE_VALUE of its value at rollout time for the whole update, so the value head cannot reach the "
        "rewards' scale and its advantages are the raw returns: PPO runs as REINFORCE. Raise CRITIC_CLIPRANGE_VALUE "
        "(auto: half the reward range)"
    )
    return warnings


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
        if m := _ENDS_AT.match(line):
            current.ends_at = stamp(m.group(2))
        elif m := _EXIT.match(line):
            current.ended, current.exit_code = stamp(m.group(1)), int(m.group(2))
        elif "time-limit signal: requeueing job" in line:
            current.how = "requeued at the time-limit signal"
        elif "stop signal: stopping the job on every node" in line:
            current.how = current.how or "stopped by a signal (scancel, a requeue, Ctrl-C)"
        elif "TRAINING_DONE exists: this training already finished" in line:
            current.how = "nothing to do: TRAINING_DONE was there"
        elif "=== [rank 0] trainer finished" in line:
            current.trainer_finished = True
        elif "] ERROR: " in line:
            current.errors.append(line.split("] ERROR: ", 1)[1])
    return job


# --- Slurm ------------------------------------------------------------------------------------------------------------


def _run(argv: list[str]) -> str | None:
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return run.stdout if run.returncode == 0 else None


def slurm_time(value: str | None) -> float | None:
    try:
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S")) if value else None
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
    """What Slurm knows of the job (state, reason, restarts, times, time limit, output file, nodes), from the first of
    scontrol, squeue, sacct that is on PATH and knows it; and a note per program that was not there or did not."""
    notes = []
    if not re.fullmatch(r"\d+", job_id):
        return None, [f"job {job_id} ran without Slurm"]
    if shutil.which("scontrol"):
        out = _run(["scontrol", "show", "job", "-o", job_id])
        if out and "JobState=" in out:
            f = dict(re.findall(r"(\S+?)=(\S*)", out))
            return {
                "source": "scontrol", "state": f.get("JobState"), "reason": f.get("Reason"),
                "restarts": int(f.get("Restarts") or 0), "start": slurm_time(f.get("StartTime")),
                "end": slurm_time(f.get("EndTime")), "time_limit": slurm_duration(f.get("TimeLimit")),
                "output": f.get("StdOut"), "nodes": f.get("NodeList"), "exit_code": f.get("ExitCode"),
                "batch": f.get("BatchFlag") != "0",
            }, notes  # fmt: skip
        notes.append("scontrol does not know the job (it forgets ended jobs after MinJobAge)")
    else:
        notes.append("scontrol is not on PATH")
    if shutil.which("squeue"):
        out = _run(["squeue", "-h", "-j", job_id, "-o", "%T|%r|%S|%e|%l|%N"])
        if out and out.strip():
            state, reason, start, end, limit, nodes = (out.strip().splitlines()[0].split("|") + [""] * 6)[:6]
            return {"source": "squeue", "state": state, "reason": reason, "restarts": None,
                    "start": slurm_time(start), "end": slurm_time(end), "time_limit": slurm_duration(limit),
                    "output": None, "nodes": nodes, "exit_code": None, "batch": None}, notes  # fmt: skip
    else:
        notes.append("squeue is not on PATH")
    if shutil.which("sacct"):
        out = _run(["sacct", "-n", "-P", "-X", "-j", job_id, "-o", "State,ExitCode,Start,End,Timelimit,NodeList"])
        if out and out.strip():
            state, code, start, end, limit, nodes = (out.strip().splitlines()[-1].split("|") + [""] * 6)[:6]
            return {"source": "sacct", "state": state.split()[0], "reason": None, "restarts": None,
                    "start": slurm_time(start), "end": slurm_time(end), "time_limit": slurm_duration(limit),
                    "output": None, "nodes": nodes, "exit_code": code, "batch": None}, notes  # fmt: skip
        notes.append("sacct does not know the job (no accounting database, or not kept)")
    else:
        notes.append("sacct is not on PATH")
    return None, notes


# --- the job ------------------------------------------------------------------------------------------------------


def default_log_dir() -> Path:
    return Path(os.environ.get("CONFIG_LOG_DIR") or REPO / "logs")


def job_folders(log_dir: Path, job_id: str) -> list[tuple[int, Path]]:
    """(restart count, folder) of every start of the job, oldest first."""
    found = []
    if log_dir.is_dir():
        for p in log_dir.iterdir():
            m = _FOLDER.match(p.name)
            if p.is_dir() and m and m.group("id") == job_id:
                found.append((int(m.group("n") or 0), p))
    return sorted(found)


def newest_job(log_dir: Path) -> str:
    """The job whose newest start folder changed last."""
    best: tuple[float, str] | None = None
    for p in log_dir.iterdir() if log_dir.is_dir() else []:
        m = _FOLDER.match(p.name)
        if p.is_dir() and m:
            t = max([mtime(p) or 0.0] + [mtime(f) or 0.0 for f in p.iterdir()])
            if best is None or t > best[0]:
                best = (t, m.group("id"))
    if best is None:
        raise StatusError(f"no job folders in {log_dir} (CONFIG_LOG_DIR): give a job id or a job's log folder")
    return best[1]


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
    tracker = base / "latest_checkpointed_iteration.txt"
    step = read_text(tracker).strip()
    if not step.isdigit():
        return out
    folder = base / f"global_step_{step}"
    size = 0
    for dirpath, _, names in os.walk(folder):
        for name in names:
            try:
                size += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return out | {"step": int(step), "path": str(folder), "saved": mtime(tracker), "bytes": size}


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
    if target and Path(target).is_dir() and _FOLDER.match(Path(target).resolve().name):
        folder = Path(target).resolve()
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
    starts = [read_folder(folder, n) for n, folder in folders]
    output = find_output(job_id, log_dir, slurm)
    job_lines = read_output(read_text(output), {s.name: s for s in starts}) if output else {}
    requeued = starts[:-1]  # a start of the same job id after it: Slurm requeued this one
    if slurm and slurm["state"] == "PENDING" and starts and (slurm.get("restarts") or 0) >= len(starts):
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
    before_end = job_lines.get("checkpoint_before_end") or int(os.environ.get("CHECKPOINT_BEFORE_END") or
                                                                 CHECKPOINT_BEFORE_END)  # fmt: skip
    return Job(job_id, log_dir, starts, slurm, notes, output, checkpoint(root), before_end, canary,
               time.time() if now is None else now)  # fmt: skip


# --- what it all means --------------------------------------------------------------------------------------------


def merged_steps(job: Job) -> dict[int, dict[str, float]]:
    """Every step's metrics across the starts; a step trained again after a requeue keeps its newest values."""
    merged: dict[int, dict[str, float]] = {}
    for s in job.starts:
        merged.update(s.steps)
    return merged


def stall_text(stall: dict) -> str:
    """Where and since when a start hung, as the stall watchdog recorded it."""
    phase = f", phase {stall['phase']}" if stall.get("phase") else ""
    return (
        f"no step finished since {clock(stall.get('since'))} (budget {duration(stall.get('budget') or 0)}, "
        f"STALL_TIMEOUT={stall.get('setting')}): hung in step {stall.get('step')}{phase}; stacks in {stall.get('stacks')}"
    )


def state(job: Job) -> tuple[str, str]:
    """(state, why): pending, requeued, running, stalled, finished, failed, cancelled, ended or unknown, and the
    reason from Slurm and the job's own messages."""
    st, why = _state(job)
    s = job.newest
    if s is not None and s.stall and st in ("running", "failed", "ended", "unknown"):
        # running: the watchdog is stopping it
        return "stalled", stall_text(s.stall) + ("; stopping" if st == "running" else "")
    return st, why


def _state(job: Job) -> tuple[str, str]:
    s, slurm = job.newest, job.slurm
    why = failure_reason(job)
    if slurm:
        st, reason = slurm["state"] or "", slurm.get("reason") or ""
        if st == "PENDING":
            restarts = slurm.get("restarts")
            if (restarts or 0) > 0 or (restarts is None and job.starts):  # squeue does not say; folders do
                return "requeued", f"waiting to start again (Reason={reason}); it resumes from its newest checkpoint"
            return "pending", f"waiting in the queue (Reason={reason})"
        if st.startswith("REQUEUE"):
            return "requeued", f"Slurm is requeueing it ({st})"
        if st in ("RUNNING", "CONFIGURING", "COMPLETING"):
            return "running", f"on {slurm.get('nodes')}" if slurm.get("nodes") else ""
        if st in ("SUSPENDED", "STOPPED", "PREEMPTED"):
            return "failed" if st == "PREEMPTED" else "suspended", f"Slurm: {st}"
        if st == "COMPLETED":
            return "finished", finished_reason(job)
        if st == "CANCELLED":
            return "cancelled", "scancel" + (f"; {why}" if why else "")
        if st == "NODE_FAIL":
            return "failed", "a node failed (Slurm: NODE_FAIL); resubmit, it resumes" + (f"; {why}" if why else "")
        return "failed", why or f"Slurm: {st} (ExitCode={slurm.get('exit_code')})"
    if s is None:
        return "unknown", ""
    if s.exit_code is not None:
        if s.exit_code == 0 and (failed := canary_failure(job)):
            return "failed", failed
        if s.exit_code == 0:
            return "finished", finished_reason(job)
        if s.exit_code in (130, 143) and not s.errors:
            return "ended", s.how or f"stopped by a signal (exit code {s.exit_code}: scancel, a requeue, Ctrl-C)"
        return "failed", why or f"exit code {s.exit_code}"
    quiet = job.now - (s.last_write or s.began or job.now)
    if s.trainer_started is None and quiet < STALL_MINUTES * 60:
        what = "the preflight (PREFLIGHT_ONLY=1)" if s.kind == PREFLIGHT_ONLY else "the checks or the start-up"
        return "running", f"{what}, begun {duration(job.now - (s.began or job.now))} ago; no trainer yet"
    if quiet < STALL_MINUTES * 60:
        return "running", f"no end recorded yet, and no Slurm to ask; the trainer last wrote {duration(quiet)} ago"
    return "unknown", (
        f"no end recorded, no Slurm to ask, and nothing written for {duration(quiet)}: killed (kill -9, a lost node, "
        "the time limit)?"
    )


def canary_failure(job: Job) -> str:
    """The canary's first failed stage and why, from its results.jsonl ("" when none failed, or no canary)."""
    if not job.canary:
        return ""
    for line in read_text(job.canary / "results.jsonl").splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if e.get("status") == "failed":
            return f"the canary's stage {e.get('stage')} failed: {e.get('reason', '?')}"
    return ""


def finished_reason(job: Job) -> str:
    ckpt, s = job.checkpoint or {}, job.newest
    if s and s.how.startswith("nothing to do"):
        return s.how
    if s and s.kind == PREFLIGHT_ONLY:
        return "preflight only (PREFLIGHT_ONLY=1): every check passed; nothing was started"
    if (
        s
        and s.kind == "canary"
        and job.canary
        and "canary: every stage passed" in read_text(job.canary / "summary.txt")
    ):
        return "the canary passed (CANARY=1): its table below"
    if s and s.kind == "canary":
        return "exited 0, but no canary table says every stage passed: its stages below"
    if ckpt.get("training_done") or (s and s.trainer_finished):
        return "training finished (TRAINING_DONE)"
    return "exited 0"


def failure_reason(job: Job) -> str:
    """Why the newest start failed, from its own messages: the trainer's first known failure, the run script's and
    the helpers' errors, a node's reason."""
    s = job.newest
    if s is None:
        return ""
    parts = []
    if s.preflight_problem and s.trainer_started is None:
        parts.append(f"before training, in the preflight: {s.preflight_problem}")
    if s.failure:
        parts.append(f"{s.failure['what']} ({s.failure['docs']}): {s.failure['line']}")
    stopping = [e for e in s.errors if e.endswith(": stopping the job") or "trainer exited with" in e]
    parts += (stopping or s.errors)[-1:]
    if not parts and s.node_failures:
        parts.append(s.node_failures[-1])
    return "; ".join(parts)


def fit_change(values: list[float]) -> float:
    """The change over the values' span by a least-squares line (noise averaged out)."""
    n = len(values)
    if n < 2:
        return 0.0
    xm, ym = (n - 1) / 2, sum(values) / n
    slope = sum((i - xm) * (v - ym) for i, v in enumerate(values)) / sum((i - xm) ** 2 for i in range(n))
    return slope * (n - 1)


def series(steps: dict[int, dict[str, float]], key: str) -> list[tuple[int, float]]:
    return [(n, m[key]) for n, m in sorted(steps.items()) if key in m]


def metric_summary(steps: dict[int, dict[str, float]]) -> dict[str, dict]:
    """The newest value of each metric that matters, its change over the last WINDOW steps, and its healthy range."""
    out = {}
    keys = [k for k in METRICS if not k.endswith("/")]
    keys += sorted({k for m in steps.values() for k in m if k.startswith("val-core/")})
    for key in keys:
        points = series(steps, key)
        if not points:
            continue
        finite = [v for _, v in points[-WINDOW:] if math.isfinite(v)]
        healthy = METRICS.get(key) or METRICS["val-core/"]
        out[key] = {"step": points[-1][0], "value": points[-1][1], "change": fit_change(finite),
                    "over": len(finite), "healthy": healthy}  # fmt: skip
    return out


def metric_warnings(steps: dict[int, dict[str, float]], critic_updates: int | None = None) -> list[str]:
    """What a run that does not learn, or learns the wrong thing, shows in verl's metrics (critic_updates: PPO's
    critic updates a step, from the trainer command)."""
    warnings = []
    train = {n: m for n, m in steps.items() if is_training_step(m)}
    if not train:
        return warnings
    last = max(train)
    for key in [k for k in METRICS if not k.endswith("/")]:
        value = train[last].get(key)
        if value is not None and not math.isfinite(value):
            warnings.append(f"{key} is {value} at step {last}: a NaN or inf in the reward or the update; "
                            "rewards.jsonl and the reward servers' logs say whether the reward is")  # fmt: skip
    clip = [v for _, v in series(train, "response_length/clip_ratio")[-5:] if math.isfinite(v)]
    if clip and statistics.mean(clip) > CLIP_HIGH:
        warnings.append(
            f"responses mostly cut off: {statistics.mean(clip):.0%} of the responses of the last {len(clip)} steps "
            "hit MAX_RESPONSE_LENGTH (response_length/clip_ratio): they score the cut-off penalty, not the reward "
            "model; raise MAX_RESPONSE_LENGTH"
        )
    top, bottom = train[last].get("critic/score/max"), train[last].get("critic/score/min")
    scores = [v for _, v in series(train, "critic/score/mean")[-10:]]
    if top is not None and bottom is not None and top == bottom:
        warnings.append(
            f"reward flat: every response of step {last} scored {top} (critic/score/max = min): GRPO's advantages "
            "are all 0 and nothing is learned; check the reward servers' logs and the reward format "
            "(python -m reward_score.check_format)"
        )
    elif len(scores) == 10 and all(math.isfinite(v) for v in scores) and max(scores) - min(scores) < 1e-9:
        warnings.append(f"reward flat: critic/score/mean is {scores[-1]} in each of the last 10 steps")
    kl = [v for _, v in series(train, "actor/kl_loss") if math.isfinite(v)]
    if kl and kl[-1] > KL_HIGH:
        warnings.append(f"KL climbing: actor/kl_loss is {kl[-1]:.3g} (above {KL_HIGH}): the policy is far from the "
                        "reference; lower ACTOR_LR or raise KL_LOSS_COEF")  # fmt: skip
    elif len(kl) >= 20 and statistics.mean(kl[-10:]) > max(KL_RISE * statistics.mean(kl[-20:-10]), KL_NOTABLE):
        warnings.append(
            f"KL climbing: actor/kl_loss averaged {statistics.mean(kl[-10:]):.3g} over the last 10 steps, "
            f"{statistics.mean(kl[-10:]) / statistics.mean(kl[-20:-10]):.1f}x the 10 before: lower ACTOR_LR or "
            "raise KL_LOSS_COEF"
        )
    clipfrac = [v for _, v in series(train, "actor/pg_clipfrac")[-5:] if math.isfinite(v)]
    if clipfrac and statistics.mean(clipfrac) > PG_CLIPFRAC_HIGH:
        warnings.append(f"actor/pg_clipfrac averaged {statistics.mean(clipfrac):.2f} over the last {len(clipfrac)} "
                        f"steps (above {PG_CLIPFRAC_HIGH}): the updates are too large; lower ACTOR_LR")  # fmt: skip
    warnings += value_clip_warnings([v for _, v in series(train, "critic/vf_clipfrac")[-5:]], critic_updates)
    entropy = [v for _, v in series(train, "actor/entropy") if math.isfinite(v)]
    if entropy and entropy[-1] < ENTROPY_FLOOR:
        warnings.append(f"actor/entropy fell to {entropy[-1]:.3g} (from {entropy[0]:.3g}): the policy has collapsed "
                        "onto a few answers; lower ACTOR_LR, and look for a shortcut the reward model pays for")  # fmt: skip
    return warnings


def startup_seconds(job: Job) -> tuple[float | None, str]:
    """How long a start takes before it trains (the checks, servers, Ray, loading the models and the checkpoint, the
    first validation): the newest start that trained, from its beginning to its last log line less its steps."""
    for s in reversed(job.starts):
        steps = s.training_steps()
        end = s.last_write if s.ended is None else min(s.last_write or s.ended, s.ended)
        if steps and s.began and end:
            spent = sum(wall_seconds(s.steps[n]) for n in steps)
            return max(end - s.began - spent, 0.0), s.name
    return None, ""


def progress(job: Job) -> dict:
    """Step N of the total, the time per step, and when the training ends: in wall time and in starts of the job,
    given its time limit and verl's save CHECKPOINT_BEFORE_END before it (steps after that save are trained again by
    the next start)."""
    steps = merged_steps(job)
    train = sorted(n for n, m in steps.items() if is_training_step(m))
    totals = [s.total for s in job.starts if s.total]
    saved = (job.checkpoint or {}).get("step")
    st, _ = state(job)
    s = job.newest
    if st in ("pending", "requeued") and saved is not None:
        current = saved  # the next start resumes from there
    elif s and s.training_steps():
        current = s.training_steps()[-1]
    elif s and s.resumed_from is not None:
        current = s.resumed_from  # loaded, not trained yet
    else:
        current = saved or (train[-1] if train else 0)
    out: dict = {"step": current, "total": totals[-1] if totals else None, "saved_step": saved}
    recent = train[-10:]
    out["step_s"] = statistics.median(steps[n]["timing_s/step"] for n in recent) if recent else None
    window = train[-WALL_WINDOW:]
    out["wall_per_step_s"] = statistics.mean(wall_seconds(steps[n]) for n in window) if window else None
    out["startup_s"], out["startup_from"] = startup_seconds(job)
    limit = (job.slurm or {}).get("time_limit")
    if limit is None and s and s.ends_at and s.began:
        limit = s.ends_at - s.began
    out["time_limit_s"], out["checkpoint_before_end_s"] = limit, job.checkpoint_before_end
    if out["total"] is None or out["wall_per_step_s"] is None:
        return out
    remaining = max(out["total"] - current, 0)
    wall = max(out["wall_per_step_s"], 1e-3)
    out["remaining_steps"], out["remaining_s"] = remaining, remaining * wall
    if st in FINAL or remaining == 0:
        return out
    if not limit:
        out["eta"], out["starts_left"] = job.now + remaining * wall, 1
        return out
    startup = out["startup_s"] or 0.0
    per_start = math.floor(max(limit - startup - job.checkpoint_before_end, 0) / wall)
    out["steps_per_start"] = per_start
    end = (job.slurm or {}).get("end") if st == "running" else None
    end = end or (s.ends_at if st == "running" and s else None)
    if st == "running" and end:
        if job.now + remaining * wall <= end - signal_lead():
            out["eta"], out["starts_left"], out["this_start_saves"] = job.now + remaining * wall, 1, remaining
            return out
        here = max(math.floor((end - job.checkpoint_before_end - job.now) / wall), 0)
        out["this_start_saves"], rest, first, begin = here, remaining - here, 1, end
    else:
        rest, first, begin = remaining, 0, job.now
    if per_start <= 0:
        out["starts_left"] = None  # no start is long enough to save a step
        return out
    more = math.ceil(rest / per_start)
    out["starts_left"] = first + more
    out["eta"] = begin + (more - 1) * limit + startup + (rest - (more - 1) * per_start) * wall
    return out


def warnings_for(job: Job, st: str, prog: dict) -> list[str]:
    s = job.newest
    warnings = metric_warnings(merged_steps(job), s.critic_updates if s else None)
    if st == "running" and s and (s.last_write or s.trainer_started):
        quiet = job.now - (s.last_write or s.trainer_started)
        longest = max((wall_seconds(m) for m in s.steps.values() if is_training_step(m)), default=0.0)
        if quiet > max(STALL_MINUTES * 60, 3 * longest):
            warnings.append(
                f"no progress for {duration(quiet)}: the trainer has written nothing since then (the longest step "
                f"took {duration(longest)}): a hang? {OPERATIONS}#nccl-timeouts-and-hangs says what to look at"
            )
    restarts = [r for start in job.starts for r in start.reward_restarts]
    if restarts:
        latest = restarts[-1]
        warnings.append(f"reward servers restarted {len(restarts)} time(s) in this job, the last at "
                        f"{clock(latest['when'])} after: {latest['reason']} (log: {latest['log']})")  # fmt: skip
    if (job.slurm or {}).get("batch") is False and (prog.get("starts_left") or 1) > 1:
        warnings.append(
            f"the interactive allocation ends before the training does (about {prog.get('this_start_saves')} more "
            "steps saved by then), and it never requeues: run the job again then, or sbatch it; it resumes"
        )
    if prog.get("total") and prog.get("time_limit_s") and prog.get("steps_per_start") == 0:
        warnings.append(
            f"a start of {duration(prog['time_limit_s'])} saves no step: its startup "
            f"({duration(prog.get('startup_s') or 0)}) and CHECKPOINT_BEFORE_END={job.checkpoint_before_end} leave "
            f"less than a step ({duration(prog['wall_per_step_s'])}); ask for a longer --time"
        )
    return warnings


def plain(value):
    """JSON without NaN or Infinity (which strict parsers refuse): a non-finite number as its text."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def report(job: Job) -> dict:
    """Everything the status says, as data (--json prints it)."""
    st, why = state(job)
    prog = progress(job)
    return {
        "job": job.id,
        "state": st,
        "why": why,
        "log_dir": str(job.log_dir),
        "output": str(job.output) if job.output else None,
        "slurm": job.slurm,
        "slurm_notes": job.slurm_notes,
        "canary": str(job.canary) if job.canary else None,
        "starts": [
            {k: v for k, v in asdict(s).items() if k not in ("steps", "folder")}
            | {"name": s.name, "folder": str(s.folder), "steps": s.training_steps()}
            for s in job.starts
        ],
        "progress": prog,
        "checkpoint": job.checkpoint,
        "metrics": metric_summary(merged_steps(job)),
        "warnings": warnings_for(job, st, prog),
        "now": job.now,
    }


# --- as text ---------------------------------------------------------------------------------------------------------


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


def size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def steps_text(steps: list[int]) -> str:
    return "no step" if not steps else f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"


CANARY_STAGES = {"train": "train", "resume": "resume", "merge": "merge.log"}  # launch/watch/canary.sh: stage -> its log


def canary_stages(canary: Path) -> list[str]:
    """The canary's stages so far, from the results.jsonl its checks append (launch/watch/canary.py), and the one running."""
    results = {}
    for line in read_text(canary / "results.jsonl").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        results[entry.get("stage")] = entry
    lines = []
    for stage, log in CANARY_STAGES.items():
        e = results.get(stage)
        if e is None:  # the first stage without a result whose log is there runs now; the rest wait
            running = (canary / log).exists() and not any(" running " in line for line in lines)
            lines.append(f"{stage}: running (log: {canary / log})" if running else f"{stage}: not started")
            continue
        result = "FAILED" if e.get("status") == "failed" else e.get("status", "?")
        lines.append(f"{stage}: {result}" + (f" in {e['seconds']} s" if "seconds" in e else "")
                     + (f": {e['reason']}" if e.get("reason") and result != "passed" else ""))  # fmt: skip
    return lines


def render(r: dict) -> str:
    lines = [f"job {r['job']}: {r['state'].upper()}" + (f": {r['why']}" if r["why"] else "")]
    slurm = r["slurm"]
    local = r["job"].startswith("local-")  # the run script's id outside Slurm (CONTAINER=none, make demo)
    lines.append(f"  Slurm ({slurm['source']}): {slurm['state']}" + (f", Restarts={slurm['restarts']}"
                 if slurm.get("restarts") else "") if slurm else "  a local run, outside Slurm" if local
                 else f"  Slurm: {'; '.join(r['slurm_notes'])}")  # fmt: skip
    if r["canary"]:
        summary = Path(r["canary"]) / "summary.txt"
        if summary.is_file():
            lines.append(f"  a canary job (CANARY=1): its table, {summary}:")
            lines += [f"    {line}" for line in read_text(summary).splitlines()]
        else:
            lines.append(f"  a canary job (CANARY=1): its stages so far (the table comes at its end, {summary}):")
            lines += [f"    {line}" for line in canary_stages(Path(r["canary"]))]
    lines.append(f"starts ({len(r['starts'])}):")
    for s in r["starts"]:
        resumed = {None: "", 0: " from scratch"}.get(s["resumed_from"], f" resumed at step {s['resumed_from']}")
        end = clock(s["ended"]) if s["ended"] else "now" if s is r["starts"][-1] and r["state"] == "running" else "?"
        how = s["how"] or (f"exit code {s['exit_code']}" if s["exit_code"] is not None else "")
        lines.append(f"  {s['name']:<12} {clock(s['began'])} - {end:<16}  "
                     + (f"[{s['kind']}] " if s["kind"] else "") + f"{steps_text(s['steps'])}{resumed}"
                     + (f"; {how}" if how else ""))  # fmt: skip
    p = r["progress"]
    if p.get("total"):
        lines.append(f"progress: step {p['step']} of {p['total']} ({p['step'] / p['total']:.0%})"
                     + (f", {p['remaining_steps']} to go" if p.get("remaining_steps") else ""))  # fmt: skip
    elif not any(s["steps"] for s in r["starts"]):
        lines.append("progress: no steps yet" + (" (a preflight only: it trains none)" if r["starts"] and
                                                  r["starts"][-1]["kind"] == PREFLIGHT_ONLY else ""))  # fmt: skip
    else:
        lines.append(f"progress: step {p['step']} (the total is unknown until verl prints 'Total training steps')")
    if p.get("step_s") is not None:
        lines.append(f"  a step takes {p['step_s']:.1f} s (timing_s/step, median of the last 10), "
                     f"{p['wall_per_step_s']:.1f} s with validations and saves")  # fmt: skip
    if p.get("eta"):
        starts = p.get("starts_left")
        running = r["state"] == "running"
        more = ("in this start" if running and starts == 1 else f"in {starts} starts, this one included" if running
                else f"in {starts} start(s)")  # fmt: skip
        lines.append(f"  ETA {clock(p['eta'])} ({duration(p['remaining_s'])} of training {more}"
                     + (", queue waits not counted" if starts and starts > 1 else "") + ")")  # fmt: skip
        if p.get("time_limit_s"):
            lines.append(
                f"  per start: {duration(p['time_limit_s'])} limit, startup ~{duration(p.get('startup_s') or 0)}, "
                f"saves ~{p.get('steps_per_start')} steps (CHECKPOINT_BEFORE_END={p['checkpoint_before_end_s']} s)"
                + (f"; this start saves ~{p['this_start_saves']} more" if p.get("this_start_saves") is not None
                   else "")
            )  # fmt: skip
    ckpt = r["checkpoint"]
    if ckpt and ckpt.get("step") is not None:
        age = r["now"] - ckpt["saved"] if ckpt.get("saved") else None
        lines.append(
            f"checkpoint: step {ckpt['step']}, {duration(age) + ' ago' if age is not None else '?'}, "
            f"{size(ckpt['bytes'])} ({ckpt['path']})" + ("; TRAINING_DONE" if ckpt["training_done"] else "")
        )
    elif ckpt:
        lines.append(f"checkpoint: none yet in {ckpt['root']}")
    restarts = sum(len(s["reward_restarts"]) for s in r["starts"])
    lines.append(f"reward servers: {restarts} restart(s)" if restarts else "reward servers: no restarts")
    if r["metrics"]:
        lines.append("metrics: newest value (its step; change over the last steps)  healthy:")
        for key, m in r["metrics"].items():
            lines.append(f"  {key:<34} {m['value']:>9.4g} ({m['step']}; {m['change']:+.3g} over {m['over']})"
                         f"  {m['healthy']}")  # fmt: skip
    for w in r["warnings"]:
        lines.append(f"WARNING: {w}")
    newest = r["starts"][-1] if r["starts"] else None
    if newest:
        lines.append(f"logs: {newest['folder']}/trainer.log" + (f", {r['output']}" if r["output"] else ""))
    return "\n".join(lines)


# --- the picture -------------------------------------------------------------------------------------------------------

PANELS = (
    ("reward", ["critic/score/mean"], None),
    ("response length", ["response_length/mean"], "response_length/clip_ratio"),
    ("KL to the reference", ["actor/kl_loss"], None),
    ("entropy", ["actor/entropy"], None),
    ("PPO clip fraction", ["actor/pg_clipfrac"], None),
    ("step time (s)", ["timing_s/step"], None),
)


def figure(job: Job):
    """The curves of the metrics that matter over the steps, each requeue marked where the next start resumed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise StatusError(f"--png needs matplotlib ({exc}): pip install matplotlib where this runs") from None
    steps = merged_steps(job)
    train = {n: m for n, m in steps.items() if is_training_step(m)}
    st, _ = state(job)
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5), constrained_layout=True)
    for ax, (title, keys, twin) in zip(axes.flat, PANELS, strict=True):
        for key in keys:
            points = series(train, key)
            if points:
                ax.plot(*zip(*points, strict=True), label=key, color="tab:blue", linewidth=1.2)
        if title == "reward":
            for key in sorted({k for m in steps.values() for k in m if k.startswith("val-core/")}):
                points = series(steps, key)
                ax.plot(*zip(*points, strict=True), "o--", label=key, color="tab:green", markersize=3)
        handles = list(ax.get_lines())
        if twin and (points := series(train, twin)):
            right = ax.twinx()
            handles += right.plot(*zip(*points, strict=True), color="tab:red", linewidth=1, label=twin)
            right.tick_params(labelsize=7, colors="tab:red")
        for s in job.starts[1:]:
            if s.resumed_from is not None:
                mark = ax.axvline(s.resumed_from + 0.5, color="tab:orange", linestyle=":", linewidth=1.5,
                                  label=f"{s.name} resumed at step {s.resumed_from}")  # fmt: skip
                handles += [mark] if title == "reward" else []
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        if handles:
            ax.legend(handles=handles, fontsize=7, loc="best")
    requeues = [s.name for s in job.starts[1:] if s.resumed_from is not None]
    fig.suptitle(
        f"job {job.id}: {st}, step {max(train) if train else 0}"
        + (f" of {job.starts[-1].total}" if job.starts and job.starts[-1].total else "")
        + (f"; dotted: resumed after a requeue ({', '.join(requeues)})" if requeues else "")
        + f"  ({clock(job.now)})",
        fontsize=11,
    )
    return fig


def no_picture(job: Job) -> str:
    """Why there is nothing to draw yet ("" when there is): no training step in any start."""
    if any(s.training_steps() for s in job.starts):
        return ""
    hint = f"; the canary's training is its own job folder: python -m launch.watch.status {job.canary / 'train'} --png" if (
        job.canary and (job.canary / "train").is_dir()) else ""  # fmt: skip
    return f"not drawn: no steps yet in job {job.id}{hint}"


def plot(job: Job, path: Path) -> None:
    """figure() into a PNG file, written atomically (a viewer never sees half a picture)."""
    fig = figure(job)  # StatusError naming the fix where matplotlib does not import
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        fig.savefig(tmp, dpi=80, format="png")
    finally:
        plt.close(fig)
    os.replace(tmp, path)


# --- main -------------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.watch.status", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("job", nargs="?", help="a job id, or a start's log folder (default: the newest job)")
    p.add_argument("--log-dir", type=Path, help="where the job folders are (default: CONFIG_LOG_DIR, else logs/)")
    p.add_argument("--png", type=Path, help="also draw the curves into this PNG file")
    p.add_argument("--follow", nargs="?", type=float, const=60.0, metavar="SECONDS",
                   help="print again every SECONDS (default 60) until the job ends")  # fmt: skip
    p.add_argument("--json", action="store_true", help="one JSON object instead of the text")
    args = p.parse_args(argv)
    if args.follow is not None and args.follow <= 0:
        p.error("--follow: seconds between refreshes, more than 0")
    try:
        while True:
            job = load(args.job, args.log_dir)
            r = report(job)
            empty = no_picture(job) if args.png else ""
            if args.png and not empty:
                plot(job, args.png)
            picture = f"\npicture: {empty or args.png}" if args.png else ""
            print(json.dumps(plain(r)) if args.json else render(r) + picture, flush=True)
            if args.follow is None or r["state"] in FINAL:
                return 0
            args.job = job.id  # the same job on every refresh, even when a newer one starts
            time.sleep(args.follow)
            if not args.json:
                print(f"--- {clock(time.time())} ---", flush=True)
    except StatusError as exc:
        print(f"status: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
