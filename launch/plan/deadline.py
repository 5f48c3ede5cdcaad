"""The save before the time limit and the preemption: the room verl 0.6.1's check gets, and what a stop costs the job.

verl's main trainer saves after a step when 0 < EXPIRY - now <= 60 s + the longest step so far +
trainer.esi_redundant_time (checkpoint_manager.py:207-229, called at ray_trainer.py:1236-1254 after the step's
validation), EXPIRY being MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP (the job's end minus CHECKPOINT_BEFORE_END).
Its longest step leaves out the validation and the save (ray_trainer.py:1036 vs 1224-1271): ESI_REDUNDANT_TIME gives
the window that room (redundant_time); the recipes never check. A preemption: its cost (preemption), SAVE_FREQ=auto.
This module is the bottom of launch/'s imports: it reads logs and the environment and imports nothing of launch/.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the type only: at run time this module imports nothing of launch/ (tests/test_settings.py)
    from launch.plan.settings import Settings

FIRST_GUESS = 600  # s for a validation and a save before this job measured any (a 4B save with optimizer: minutes)
FIRST_STEP_GUESS = 600  # s a step before this job measured one (the article's job: ~10 min)
VERL_SAVE_SECONDS = 60  # should_save_ckpt_esi's own save_ckpt_duration
MARGIN = 15  # s between a preempted job's own stop and the grace's end, as the run script's cleanup gives the helpers
SAVE_FREQ_DEFAULT = 25  # SAVE_FREQ=auto where a preemption cannot cost more: the setting's default before auto
AUTO_LOSS = 1800  # s of steps SAVE_FREQ=auto lets a preemption that saves nothing cost at most
# verl's console logger prints each number with pprint.pformat: a float as is, a numpy one as np.float64(...) (numpy 2)
_TIMING = re.compile(r"(?:^|\s)timing_s/(step|testing|save_checkpoint):(?:np\.float\d+\()?([0-9.eE+-]+)")


class StallError(ValueError):
    pass


def timeout_setting(raw: str) -> float | None:
    """STALL_TIMEOUT's value: None for auto, 0 for off, else the seconds; a bad value names the setting."""
    if raw == "auto":
        return None
    if raw == "off":
        return 0.0
    if (value := positive_seconds(raw)) is None:
        raise StallError(f"STALL_TIMEOUT={raw!r}: use auto, off, or the seconds a step may take (more than 0)")
    return value


def positive_seconds(raw: str) -> float | None:
    """`raw` as a number of seconds above 0, else None."""
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value > 0 else None


def signal_lead(env: Mapping[str, str]) -> int | None:
    """Seconds before the time limit at which the job requeues itself (its #SBATCH --signal lead, JOB_SIGNAL_LEAD), or
    None where it will not requeue (outside Slurm, or REQUEUE_BEFORE_TIMEOUT=0)."""
    if env.get("REQUEUE_BEFORE_TIMEOUT", "1") != "1" or not env.get("SLURM_JOB_ID"):
        return None
    return int(env.get("JOB_SIGNAL_LEAD") or 0)


def earlier_starts(env: Mapping[str, str]) -> list[Path]:
    """The log folders of this job's earlier starts (<job id>, <job id>-r1, ...) beside this start's own."""
    here, job_id = Path(env.get("JOB_LOG_DIR") or "/nonexistent/-"), env.get("JOB_ID")
    if not job_id or not here.parent.is_dir():
        return []
    pattern = re.compile(rf"^{re.escape(job_id)}(?:-r\d+)?$")
    return sorted(p for p in here.parent.iterdir() if p.is_dir() and pattern.match(p.name) and p != here)


def measured(folders: list[Path]) -> dict[str, float]:
    """The longest step, validation and save (s) that verl logged in these folders' trainer.log, by timing name."""
    longest: dict[str, float] = {}
    for folder in folders:
        log = folder / "trainer.log"
        if not log.is_file():
            continue
        for line in log.read_text(errors="replace").splitlines():
            for name, value in _TIMING.findall(line):
                try:
                    longest[name] = max(longest.get(name, 0.0), float(value))
                except ValueError:
                    continue
    return longest


def redundant_time(s: Settings, env: Mapping[str, str]) -> tuple[int, str]:
    """trainer.esi_redundant_time in whole seconds, and where it came from."""
    if s.esi_redundant_time_setting != "auto":
        return int(float(s.esi_redundant_time_setting)), f"ESI_REDUNDANT_TIME={s.esi_redundant_time_setting}"
    folders = earlier_starts(env)
    longest = measured(folders)
    if not longest:
        return FIRST_GUESS, f"ESI_REDUNDANT_TIME=auto: {FIRST_GUESS} s, nothing measured yet by an earlier start"
    testing, save = longest.get("testing", 0.0), longest.get("save_checkpoint", 0.0)
    where = ", ".join(str(f / "trainer.log") for f in folders)
    return math.ceil(testing + save), (
        f"ESI_REDUNDANT_TIME=auto: the longest validation ({testing:.0f} s) + the longest save ({save:.0f} s) "
        f"earlier starts logged ({where})"
    )


def plan(s: Settings, env: Mapping[str, str], now: float | None = None) -> tuple[list[str], list[str]]:
    """(what verl will do, warnings) about saving before the job's time limit, for settings that
    launch.plan.refusals.save_deadline_problems let through."""
    lines: list[str] = []
    warnings: list[str] = []
    lead = signal_lead(env)
    requeue, lead = lead is not None, lead or 0
    save_freq = preemption(s, env)[0]
    if s.uses_recipe:
        saves = f"every SAVE_FREQ={save_freq} steps" if save_freq > 0 else "never (SAVE_FREQ<=0)"
        (warnings if requeue else lines).append(
            f"{s.uses_recipe} does not save before the time limit: verl 0.6.1's recipe trainer never calls its "
            "save-before-expiry check (should_save_ckpt_esi), so CHECKPOINT_BEFORE_END does nothing there; it saves "
            f"{saves}, and a requeue resumes from the last of those (up to SAVE_FREQ steps are trained again)"
        )
        return lines, warnings
    if save_freq <= 0:
        lines.append("SAVE_FREQ<=0: verl saves nothing, before the time limit neither (it requires save_freq > 0)")
        return lines, warnings
    seconds, source = redundant_time(s, env)
    end = env.get("JOB_END_TIME", "")
    if not end.isdigit():  # no time limit here (a login node's preview): the job's own preflight says its plan
        return lines, warnings
    now = time.time() if now is None else now
    left, expiry = int(end) - now, int(end) - s.checkpoint_before_end
    lines.append(
        f"verl saves after any step that ends within 60 s + its longest step + trainer.esi_redundant_time={seconds} s "
        f"of {time.strftime('%F %T', time.localtime(expiry))} (CHECKPOINT_BEFORE_END={s.checkpoint_before_end} s "
        f"before the time limit); {source}"
    )
    if left <= s.checkpoint_before_end:
        warnings.append(
            f"the job has {left:.0f} s left, not more than CHECKPOINT_BEFORE_END={s.checkpoint_before_end}: verl's "
            "save-before-the-limit window is over before training starts, so nothing is saved before the limit "
            "(only every SAVE_FREQ steps); ask for a longer --time or a smaller CHECKPOINT_BEFORE_END"
        )
    save = measured(earlier_starts(env)).get("save_checkpoint", float(seconds))
    room = s.checkpoint_before_end - lead
    if left > s.checkpoint_before_end and room < save + VERL_SAVE_SECONDS:
        warnings.append(
            f"CHECKPOINT_BEFORE_END={s.checkpoint_before_end} leaves {room} s between verl's expiry and "
            + (f"the requeue signal ({lead} s before the limit)" if lead else "the time limit")
            + f", less than a save ({save:.0f} s measured or assumed) and a minute: the last save may be cut off"
        )
    return lines, warnings


def decide(left: float, step: float | None, save: float | None, stop: float, validation: float | None = None):
    """(whether to save after the current step with `left` s of grace, why): a whole step (the signal may come as one
    starts), its validation (None: it validates not; verl validates, then asks should_save_ckpt_esi, then saves:
    ray_trainer.py:1224-1254), the save and the stop must fit. No step measured yet (a first step): try."""
    if step is None:
        return True, f"grace {left:.0f} s; no step measured yet in this job, so trying: the grace's end is the bound"
    need = step + (validation or 0) + (save or 0) + stop + MARGIN
    validates = "" if validation is None else f", then its validation {_about(validation)}"
    why = f"grace {left:.0f} s, a step takes ~{step:.0f} s{validates}, a save {_about(save)}, the stop {stop:.0f} s"
    return need <= left, why if need <= left else f"{why}: {need:.0f} s do not fit"


def _about(seconds: float | None) -> str:
    return f"~{seconds:.0f} s" if seconds else "not measured yet"


def preemption(s: Settings, env: Mapping[str, str]) -> tuple[int, list[str], list[str]]:
    """(trainer.save_freq, lines, warnings): SAVE_FREQ resolved, and one line on what a preemption costs this job, from
    the partition and Slurm's settings the run script read (export_checkpoint_deadline). SAVE_FREQ=auto: 25, or where
    a preemption may save nothing, the steps that with a save take at most AUTO_LOSS (docs/operations.md#preemption)."""
    auto = s.save_freq_setting == "auto"
    every = SAVE_FREQ_DEFAULT if auto else int(s.save_freq_setting)
    said = f"SAVE_FREQ={s.save_freq_setting}" + (f": {every}" if auto else "")
    partitions = [dict(re.findall(r"(\w+)=(\S*)", line)) for line in env.get("JOB_PARTITIONS", "").splitlines()]
    name = env.get("JOB_PARTITION", "")
    part = next(
        (p for p in partitions if p.get("PartitionName") == name or not name and p.get("Default") == "YES"), None
    )
    if part is None:
        return every, [f"not known here (scontrol showed no partition {name or 'marked default'}); {said}"], []
    config = env.get("JOB_SLURM_CONFIG", "")
    mode = part.get("PreemptMode", "OFF")
    grace = int(part.get("GraceTime") or 0)
    where = f"partition {part['PartitionName']} (PreemptMode={mode}, GraceTime={grace} s)"
    # preempt/partition_prio: only a partition of a higher PriorityTier preempts (which nodes it shares: not checked)
    tier = int(part.get("PriorityTier") or 1)
    outranked = "partition_prio" not in config or any(int(p.get("PriorityTier") or 1) > tier for p in partitions)
    if "preempt/none" in config or not {"REQUEUE", "CANCEL"} & set(mode.split(",")) or not outranked:
        return every, [f"{where}: no preemption requeues or cancels this job here; {said}"], []
    longest = measured(earlier_starts(env))
    source = "measured by earlier starts" if longest else "first guesses: nothing measured yet"
    longest = longest or {"step": FIRST_STEP_GUESS, "save_checkpoint": FIRST_GUESS}
    step, save = longest.get("step", FIRST_STEP_GUESS), longest.get("save_checkpoint")
    testing = longest.get("testing", 0.0) if s.test_freq > 0 else None
    stop = float(env.get("STOP_TIMEOUT") or 20)
    plain, validating = decide(grace, step, save, stop), decide(grace, step, save, stop, testing)
    blockers = [
        (grace <= 0, "GraceTime=0: Slurm stops the job at once"),
        ("preempt_send_user_signal" not in config, "no preempt_send_user_signal: every task gets SIGTERM at once"),
        (bool(s.uses_recipe), f"{s.uses_recipe} never calls verl's save check"),
        (not s.preempt_save, "PREEMPT_SAVE=0"),
        (every <= 0, "SAVE_FREQ<=0: verl saves nothing"),
        (not plain[0], plain[1]),
    ]
    blocker = next((why for bad, why in blockers if bad), None)
    if blocker is None and validating[0]:
        return every, [f"{where}: a preemption saves the step it is in ({validating[1]}; {source}); {said}"], []
    cost = step + (testing or 0) / max(s.test_freq, 1)  # a step, and its share of the validations
    if auto:
        every = min(SAVE_FREQ_DEFAULT, max(1, int((AUTO_LOSS - (save or 0)) // cost)))
        said = f"SAVE_FREQ=auto: {every}"
    lost = f"up to {every} steps (~{every * cost / 60:.0f} min) lost" if every > 0 else "every step lost"
    warnings: list[str] = []
    warnings.append(
        f"{where}: nothing can be saved here: {lost} ({blocker}; {source}); {said}"
        if blocker
        else f"{where}: a preemption saves the step it is in unless that step validates (every TEST_FREQ="
        f"{s.test_freq} steps: {validating[1]}), then {lost} ({source}); {said}"
    )
    return every, [], warnings
