"""Prune the checkpoints earlier starts of the job left: verl keeps MAX_CKPT_TO_KEEP only among its own saves.

verl 0.6.1's checkpoint managers (fsdp_checkpoint_manager.py, megatron_checkpoint_manager.py) delete old
`global_step_N` folders from `previous_saved_paths`, a list that starts empty in every process: after a requeue, the
checkpoints of every earlier start stay for ever (~56 GB each for a 4B model with optimizer state). The run script
calls this before each start:

    python -m launch.job.checkpoints CONFIG_OUTPUT_DIR MAX_CKPT_TO_KEEP

It keeps the newest MAX_CKPT_TO_KEEP `global_step_N` folders and always the one `latest_checkpointed_iteration.txt`
names (what `trainer.resume_mode=auto` resumes from); 0 keeps everything.
"""

import re
import shutil
import sys
from pathlib import Path

STEP = re.compile(r"^global_step_(\d+)$")
TRACKER = "latest_checkpointed_iteration.txt"  # verl's record of its newest save, the step resume_mode=auto loads


def saved_step(output_dir: Path) -> int | None:
    """The step verl's tracker file names; None without one (nothing saved yet) or when it holds no step."""
    try:
        return int((output_dir / TRACKER).read_text().strip())
    except (OSError, ValueError):
        return None


def to_remove(output_dir: Path, keep: int) -> list[Path]:
    """The checkpoint folders beyond the newest `keep`, never the one verl resumes from; oldest first."""
    if keep <= 0 or not output_dir.is_dir():
        return []
    steps = sorted((int(m.group(1)), p) for p in output_dir.iterdir() if p.is_dir() and (m := STEP.match(p.name)))
    kept = {step for step, _ in steps[-keep:]} | {saved_step(output_dir)}
    return [p for step, p in steps if step not in kept]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or not argv[1].isdigit():
        print(__doc__, file=sys.stderr)
        return 2
    for path in to_remove(Path(argv[0]), int(argv[1])):
        print(f"checkpoints: removing {path} (MAX_CKPT_TO_KEEP={argv[1]}; left by an earlier start of the job)")
        shutil.rmtree(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
