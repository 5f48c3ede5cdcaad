"""Preemption that loses nothing: the save after the current step when Slurm's grace allows it, then the requeue.

Slurm 22.05 gives a preempted job the partition's GraceTime (PreemptMode=REQUEUE or CANCEL; without one it stops the job
at once: SIGTERM to every process, srun kills its tasks, KillWait later SIGKILL), and at the grace's start it signals
the batch script alone only with SlurmctldParameters=preempt_send_user_signal: then the job's own --signal (B:USR1)
comes, and the processes of the nodes are left alone until the grace ends (src/slurmctld/preempt.c _preempt_signal;
without that parameter every task gets SIGTERM at the grace's start, verl with it, and the batch script nothing). The run script's USR1 trap
tells the preemption from the time limit by `scontrol show job`'s PreemptTime, asks this module whether a step and a
save fit in the grace left (`python -m launch.job.preempt JOB_LOG_DIR GRACE_LEFT STOP_TIMEOUT`, exit 0: save), and
then writes JOB_LOG_DIR/preempt_requested, waits for verl's tracker file to name a newer step, and requeues the job.

install() is the Ray worker_process_setup_hook that makes verl save: verl 0.6.1's trainer saves after a step when
should_save_ckpt_esi() says the capacity block expires soon (ray_trainer.py:1236-1254, its save-before-the-time-limit
path, launch/plan/deadline.py); the hook answers yes once, after the step in which the request appeared, the first
step of a start too (verl's own check never saves then: no longest step yet). verl then trains on; the run script
stops the job once the save is on disk.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

from launch.job.steps import is_training_step, parse_step_lines
from launch.plan.deadline import earlier_starts, measured

REQUEST = "preempt_requested"
MARGIN = 15  # s between the job's own stop and the grace's end, as the run script's cleanup gives the helpers


def decide(left: float, step: float | None, save: float | None, stop: float) -> tuple[bool, str]:
    """Whether to save after the current step with `left` s of grace: a whole step (the signal may come as one
    starts), the save and the job's stop must fit. No step measured yet (a first step): try; the grace is the bound."""
    if step is None:
        return True, f"grace {left:.0f} s; no step measured yet in this job, so trying: the grace's end is the bound"
    need = step + (save or 0) + stop + MARGIN
    saving = "not measured yet" if save is None else f"~{save:.0f} s"
    why = f"grace {left:.0f} s, a step takes ~{step:.0f} s, a save {saving}, the stop {stop:.0f} s"
    return need <= left, why if need <= left else f"{why}: {need:.0f} s do not fit"


def lengths(log_dir: Path) -> tuple[int, float | None, float | None]:
    """(the last step this start finished, the longest step and the longest save of this job's starts), from verl's
    step lines in each start's trainer.log."""
    env = {"JOB_LOG_DIR": str(log_dir), "JOB_ID": log_dir.name.split("-r")[0]}
    longest = measured([*earlier_starts(env), log_dir])
    log = log_dir / "trainer.log"
    steps = parse_step_lines(log.read_text(errors="replace")) if log.is_file() else {}
    done = max((n for n, m in steps.items() if is_training_step(m)), default=0)
    return done, longest.get("step"), longest.get("save_checkpoint")


def install() -> None:
    """Ray's worker_process_setup_hook: verl's save-before-expiry check also says yes, once, when the run script has
    asked for a save (JOB_LOG_DIR/preempt_requested). verl's module is patched as it is imported, not imported here:
    its import asks torch for the GPUs (verl/utils/device.py), which must wait for Ray to give the worker its own."""
    if CHECK_MODULE in sys.modules:
        _patch(sys.modules[CHECK_MODULE])
    else:
        sys.meta_path.insert(0, _PatchOnImport())


CHECK_MODULE = "verl.utils.checkpoint.checkpoint_manager"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds verl's checkpoint module once, through the other finders, and patches it after it has run."""

    def find_spec(self, name, path, target=None):
        if name != CHECK_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def run_then_patch(module) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = run_then_patch
        return spec


def _patch(checkpoint_manager) -> None:
    check = checkpoint_manager.should_save_ckpt_esi
    request = Path(os.environ.get("JOB_LOG_DIR", "/nonexistent")) / REQUEST
    answered = []

    def should_save_ckpt_esi(*args, **kwargs) -> bool:
        if not answered and request.exists():
            answered.append(True)
            print(f"preemption: saving after this step ({request})", flush=True)
            return True
        return check(*args, **kwargs)

    checkpoint_manager.should_save_ckpt_esi = should_save_ckpt_esi
    trainer = sys.modules.get("verl.trainer.ppo.ray_trainer")  # imported before the hook: it holds the name itself
    if trainer is not None:
        trainer.should_save_ckpt_esi = should_save_ckpt_esi


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    log_dir, left, stop = Path(argv[0]), float(argv[1]), float(argv[2])
    done, step, save = lengths(log_dir)
    ok, why = decide(left, step, save, stop)
    print(f"preempted at step {done + 1}: {'saving after this step' if ok else 'stopping without a save'} ({why})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
