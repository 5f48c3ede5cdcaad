"""Judging a job that launch/watch/reading.py read: its state and why (pending, running, stalled, finished, failed,
...), the metrics that say whether it learns and their warnings, its progress and ETA over the job's starts, and the
report launch/watch/status.py prints."""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict

from launch.job.steps import is_training_step, wall_seconds
from launch.watch.reading import (
    PREFLIGHT_ONLY,
    Job,
    canary_results,
    clock,
    duration,
    read_text,
    signal_lead,
    stall_text,
)

STALL_MINUTES = 30  # a start that recorded no end and wrote nothing for this long: ended without a record
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
    "val-aux/": "REWARD=rule or rm+rule: each part's mean at validation (rule_score, rm_score); "
    "the rule's rising: more right answers",
}
# The reward's parts verl 0.6.1 logs from reward_extra_info, at validation only (ray_trainer.py:639-660).
REWARD_PARTS = ("/rule_score/mean@", "/rm_score/mean@")
CLIP_HIGH = 0.5
PG_CLIPFRAC_HIGH = 0.3
KL_HIGH = 1.0
ENTROPY_FLOOR = 0.05
# PPO's critic/vf_clipfrac reads at most 1 - 1/(critic updates a step) (docs/training.md#ppos-value-clip)
VF_CLIPFRAC_HIGH = 0.9  # of that ceiling, averaged over the last 5 steps
FINAL = {"finished", "failed", "cancelled", "ended"}


# --- what it all means --------------------------------------------------------------------------------------------


def merged_steps(job: Job) -> dict[int, dict[str, float]]:
    """Every step's metrics across the starts; a step trained again after a requeue keeps its newest values."""
    return {n: metrics for s in job.starts for n, metrics in s.steps.items()}


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
            if slurm["restarts"] > 0:
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
        return "running", (
            f"no end recorded yet, and Slurm does not know the job (or is not here); the trainer last wrote "
            f"{duration(quiet)} ago"
        )
    return "unknown", (
        f"no end recorded, Slurm does not know the job (or is not here), and nothing written for {duration(quiet)}: "
        "killed (kill -9, a lost node, the time limit, out of memory)?"
    )


def canary_failure(job: Job) -> str:
    """The canary's first failed stage and why, from its results.jsonl ("" when none failed, or no canary)."""
    results = canary_results(job.canary / "results.jsonl") if job.canary else {}
    failed = next((e for e in results.values() if e.get("status") == "failed"), None)
    return f"the canary's stage {failed.get('stage')} failed: {failed.get('reason', '?')}" if failed else ""


def finished_reason(job: Job) -> str:
    ckpt, s = job.checkpoint or {}, job.newest
    if s and s.kind == PREFLIGHT_ONLY:
        return "preflight only (PREFLIGHT_ONLY=1): every check passed; nothing was started"
    if s and s.kind == "canary":
        if job.canary and "canary: every stage passed" in read_text(job.canary / "summary.txt"):
            return "the canary passed (CANARY=1): its table below"
        return "exited 0, but no canary table says every stage passed: its stages below"
    if ckpt.get("training_done") or (s and s.trainer_finished):
        return "training finished (TRAINING_DONE)"
    return "exited 0"


def failure_reason(job: Job) -> str:
    """Why the newest start failed, from its own messages: the trainer's first known failure, the run script's and
    the helpers' errors (a failed node's among them)."""
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
    return "; ".join(parts)


def fit_change(values: list[float]) -> float:
    """The change over the values' span by a least-squares line (noise averaged out)."""
    if len(values) < 2:
        return 0.0
    return statistics.linear_regression(range(len(values)), values).slope * (len(values) - 1)


def is_reward_part(key: str) -> bool:
    return key.startswith("val-aux/") and any(part in key for part in REWARD_PARTS)


def series(steps: dict[int, dict[str, float]], key: str) -> list[tuple[int, float]]:
    return [(n, m[key]) for n, m in sorted(steps.items()) if key in m]


def metric_summary(steps: dict[int, dict[str, float]]) -> dict[str, dict]:
    """The newest value of each metric that matters, its change over the last WINDOW steps, and its healthy range."""
    out = {}
    keys = [k for k in METRICS if not k.endswith("/")]
    keys += sorted({k for m in steps.values() for k in m if k.startswith("val-core/") or is_reward_part(k)})
    for key in keys:
        points = series(steps, key)
        if not points:
            continue
        finite = [v for _, v in points[-WINDOW:] if math.isfinite(v)]
        healthy = METRICS.get(key) or METRICS[key.split("/", 1)[0] + "/"]
        out[key] = {
            "step": points[-1][0],
            "value": points[-1][1],
            "change": fit_change(finite),
            "over": len(finite),
            "healthy": healthy,
        }
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
            warnings.append(
                f"{key} is {value} at step {last}: a NaN or inf in the reward or the update; "
                "rewards.jsonl and the reward servers' logs say whether the reward is"
            )
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
        warnings.append(
            f"KL climbing: actor/kl_loss is {kl[-1]:.3g} (above {KL_HIGH}): the policy is far from the "
            "reference; lower ACTOR_LR or raise KL_LOSS_COEF"
        )
    clipfrac = [v for _, v in series(train, "actor/pg_clipfrac")[-5:] if math.isfinite(v)]
    if clipfrac and statistics.mean(clipfrac) > PG_CLIPFRAC_HIGH:
        warnings.append(
            f"actor/pg_clipfrac averaged {statistics.mean(clipfrac):.2f} over the last {len(clipfrac)} "
            f"steps (above {PG_CLIPFRAC_HIGH}): the updates are too large; lower ACTOR_LR"
        )
    vf_clip = [v for _, v in series(train, "critic/vf_clipfrac")[-5:] if math.isfinite(v)]
    ceiling = 1.0 if critic_updates is None else 1 - 1 / critic_updates  # a step's first update cannot be clipped
    if vf_clip and ceiling > 0 and statistics.mean(vf_clip) >= VF_CLIPFRAC_HIGH * ceiling:
        warnings.append(
            f"critic/vf_clipfrac averaged {statistics.mean(vf_clip):.2f} over the last {len(vf_clip)} steps (the most "
            f"it can read is {ceiling:.2f}): the critic cannot follow the rewards, and PPO runs as REINFORCE "
            "(docs/training.md). Raise CRITIC_CLIPRANGE_VALUE (auto: half the reward range)"
        )
    entropy = [v for _, v in series(train, "actor/entropy") if math.isfinite(v)]
    if entropy and entropy[-1] < ENTROPY_FLOOR:
        warnings.append(
            f"actor/entropy fell to {entropy[-1]:.3g} (from {entropy[0]:.3g}): the policy has collapsed "
            "onto a few answers; lower ACTOR_LR, and look for a shortcut the reward model pays for"
        )
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
    restarts = [r for start in job.starts for r in start.reward_restarts]
    if restarts:
        latest = restarts[-1]
        warnings.append(
            f"reward servers restarted {len(restarts)} time(s) in this job, the last at "
            f"{clock(latest['when'])} after: {latest['reason']} (log: {latest['log']})"
        )
    if prog.get("total") and prog.get("time_limit_s") and prog.get("steps_per_start") == 0:
        warnings.append(
            f"a start of {duration(prog['time_limit_s'])} saves no step: its startup "
            f"({duration(prog.get('startup_s') or 0)}) and CHECKPOINT_BEFORE_END={job.checkpoint_before_end} leave "
            f"less than a step ({duration(prog['wall_per_step_s'])}); ask for a longer --time"
        )
    return warnings


def report(job: Job) -> dict:
    """Everything the status says, as data (launch/watch/status.py renders it)."""
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
