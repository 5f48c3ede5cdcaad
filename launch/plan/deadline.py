"""The save before the time limit: the room verl 0.6.1's check gets, and whether the job's time limit lets it work.

verl's main trainer saves after a step when 0 < EXPIRY - now <= 60 s + the longest step so far +
trainer.esi_redundant_time (verl/utils/checkpoint/checkpoint_manager.py:207-229, called at
verl/trainer/ppo/ray_trainer.py:1236-1254, after the step's validation), where EXPIRY is
MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP (the job's end minus CHECKPOINT_BEFORE_END, exported by the run
script). The longest step is timed without the validation and the save that follow it (ray_trainer.py:1036 vs
1224-1271), so a validation or a save longer than 60 s could carry the job past the whole window unsaved. The job
gives the window that room: ESI_REDUNDANT_TIME seconds, `auto` = the longest validation plus the longest save that
earlier starts of this job logged (`timing_s/testing`, `timing_s/save_checkpoint` on verl's step lines), or
FIRST_GUESS before anything was measured.

The recipes never make the check: recipe/dapo/dapo_ray_trainer.py:372-376 and
recipe/one_step_off_policy/ray_trainer.py:648-652 save every trainer.save_freq steps (and at the last) only, so a
requeue there resumes from the last SAVE_FREQ save.

This module is the bottom of launch/'s imports: it reads logs and the environment and imports nothing of launch/
(launch.plan.trainer_command builds the trainer command with redundant_time; launch.plan.refusals refuses what cannot
work, with signal_lead; the preflight prints plan's lines and warnings).
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
VERL_SAVE_SECONDS = 60  # should_save_ckpt_esi's own save_ckpt_duration
MARGIN = 15  # s between a preempted job's own stop and the grace's end, as the run script's cleanup gives the helpers
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
    here, job_id = env.get("JOB_LOG_DIR"), env.get("JOB_ID")
    if not here or not job_id:
        return []
    here = Path(here)
    pattern = re.compile(rf"^{re.escape(job_id)}(?:-r\d+)?$")
    if not here.parent.is_dir():
        return []
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
    if s.uses_recipe:
        saves = f"every SAVE_FREQ={s.save_freq} steps" if s.save_freq > 0 else "never (SAVE_FREQ<=0)"
        (warnings if requeue else lines).append(
            f"{s.uses_recipe} does not save before the time limit: verl 0.6.1's recipe trainer never calls its "
            "save-before-expiry check (should_save_ckpt_esi), so CHECKPOINT_BEFORE_END does nothing there; it saves "
            f"{saves}, and a requeue resumes from the last of those (up to SAVE_FREQ steps are trained again)"
        )
        return lines, warnings
    if s.save_freq <= 0:
        lines.append("SAVE_FREQ<=0: verl saves nothing, before the time limit neither (it requires save_freq > 0)")
        return lines, warnings
    seconds, source = redundant_time(s, env)
    end = env.get("JOB_END_TIME", "")
    if not end.isdigit():
        lines.append(
            f"no time limit known here: in a Slurm job verl saves from CHECKPOINT_BEFORE_END={s.checkpoint_before_end} "
            f"s before it (window: 60 s + the longest step + {seconds} s; {source})"
        )
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
