"""Preemption that loses nothing: the save after the current step when Slurm's grace allows it, then the requeue
(docs/operations.md#preemption: what Slurm sends, what the run script's USR1 trap does).

    python -m launch.job.preempt JOB_LOG_DIR GRACE_LEFT STOP_TIMEOUT   # exit 0: a step, its validation and a save fit

install() is the Ray worker_process_setup_hook that makes verl's save-before-expiry check (should_save_ckpt_esi,
ray_trainer.py:1236-1254) say yes once after the run script wrote JOB_LOG_DIR/preempt_requested; a verl without the
check trains on without the preemption save, said once (NO_CHECK). It also freezes each worker's heap after its
init_model (_freeze_after_init: verl's gc.collect calls then skip the models' objects).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

from launch.job.steps import TOTAL_STEPS, command_int, is_training_step, parse_step_lines
from launch.plan.deadline import decide, earlier_starts, measured
from launch.plan.trainer_command import USER_HOOK

REQUEST = "preempt_requested"
NO_CHECK = "preempt_no_check"  # written by the first worker whose verl has no should_save_ckpt_esi


def lengths(log_dir: Path) -> tuple[int, int | None, dict[str, float]]:
    """(the last step this start finished, verl's total steps if it said, the longest step, validation and save of
    this job's starts by timing name), from verl's lines in each start's trainer.log."""
    env = {"JOB_LOG_DIR": str(log_dir), "JOB_ID": log_dir.name.split("-r")[0]}
    log = log_dir / "trainer.log"
    text = log.read_text(errors="replace") if log.is_file() else ""
    done = max((n for n, m in parse_step_lines(text).items() if is_training_step(m)), default=0)
    total = TOTAL_STEPS.findall(text)
    return done, int(total[-1]) if total else None, measured([*earlier_starts(env), log_dir])


def install() -> None:
    """Ray's worker_process_setup_hook, after the run's own (USER_HOOK: the worker's first code, as Ray runs one alone;
    what it patches of verl's, the job's patch wraps). verl's module is patched as it is imported, not imported here:
    its import asks torch for the GPUs (verl/utils/device.py), which must wait for Ray to give the worker its own."""
    if user := os.environ.pop(USER_HOOK, ""):
        module, _, name = user.rpartition(".")
        getattr(importlib.import_module(module), name)()
    for name, patch in {CHECK_MODULE: _patch, **dict.fromkeys(WORKER_MODULES, _freeze_after_init)}.items():
        if name in sys.modules:
            patch(sys.modules[name])
        else:
            sys.meta_path.insert(0, _PatchOnImport(name, patch))


CHECK_MODULE = "verl.utils.checkpoint.checkpoint_manager"
WORKER_MODULES = ("verl.workers.megatron_workers", "verl.workers.fsdp_workers")


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds one of verl's modules once, through the other finders, and patches it after it has run."""

    def __init__(self, module: str, patch) -> None:
        self.module, self.patch = module, patch

    def find_spec(self, name, path, target=None):
        if name != self.module:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def run_then_patch(module) -> None:
            run(module)
            self.patch(module)

        spec.loader.exec_module = run_then_patch
        return spec


def _freeze_after_init(workers) -> None:
    """verl's gc.collect() calls (its optimizer offload, aggressive_empty_cache) walk every object a worker built: 1.29
    s an update at Qwen3-4B's stage on one H100, 0.00 with the heap frozen (benchmarks/README.md, the Megatron plan).
    So each worker's heap is frozen (gc.freeze) once its init_model has built the models and optimizers."""

    def frozen_after(init):
        @functools.wraps(init)  # verl's dispatch attributes stay on the method
        def init_model(self, *args, **kwargs):
            out = init(self, *args, **kwargs)
            gc.freeze()
            return out

        return init_model

    for name in ("ActorRolloutRefWorker", "CriticWorker"):
        if (cls := getattr(workers, name, None)) is not None:
            cls.init_model = frozen_after(cls.init_model)


def _patch(checkpoint_manager) -> None:
    check = getattr(checkpoint_manager, "should_save_ckpt_esi", None)
    log_dir = Path(os.environ.get("JOB_LOG_DIR", "/nonexistent"))
    if check is None:  # a verl without the check trains on; a preemption saves nothing (said by a start's first)
        with contextlib.suppress(OSError):
            (log_dir / NO_CHECK).touch(exist_ok=False)
            print(f"preemption: {CHECK_MODULE} has no should_save_ckpt_esi: no save on preemption", flush=True)
        return
    request = log_dir / REQUEST
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
    done, total, longest = lengths(log_dir)
    command_file = log_dir / "trainer_command.txt"
    command = command_file.read_text().splitlines() if command_file.is_file() else []
    test_freq = command_int(command, "trainer.test_freq", -1)
    validates = test_freq > 0 and ((done + 1) % test_freq == 0 or done + 1 == total)
    recipe = next((a for a in command if a.startswith("recipe.")), None)  # the entry point: -m recipe.dapo.main_dapo
    if recipe:
        ok, why = False, f"{recipe} never calls verl's save check, so nothing saves on the signal"
    elif (log_dir / NO_CHECK).exists():
        ok, why = False, "this verl has no should_save_ckpt_esi, so nothing saves on the signal"
    else:
        validation = longest.get("testing", 0.0) if validates else None
        ok, why = decide(left, longest.get("step"), longest.get("save_checkpoint"), stop, validation)
    print(f"preempted at step {done + 1}: {'saving after this step' if ok else 'stopping without a save'} ({why})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
