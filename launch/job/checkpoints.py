"""Prune the checkpoints earlier starts of the job left (docs/operations.md, "Old checkpoints"): verl 0.6.1's
checkpoint managers delete old `global_step_N` folders only among their own process's saves (previous_saved_paths).

    python -m launch.job.checkpoints CONFIG_OUTPUT_DIR MAX_CKPT_TO_KEEP   # 0 keeps everything
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
