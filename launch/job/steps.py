"""verl's step lines as the trainer writes them into trainer.log, and the trainer command's overrides
(trainer_command.txt): what the watchdog times on the node and what launch.watch reads back.

verl 0.6.1's console logger prints one line a step, `step:N - key:value - ...` (verl/utils/logger/aggregate_logger.py:
26-51), each value through pprint.pformat; the trainer logs `Total training steps: N` and, on a resume, `Setting
global step to N` (ray_trainer.py's fit and _load_checkpoint).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

ANSI = re.compile(r"\x1b\[[0-9;]*m")
# verl's console logger line, behind the prefix Ray gives a TaskRunner actor's lines in the driver's output
_STEP_LINE = re.compile(r"(?:^|\)\s)step:(\d+) - (.*)$")
_NUMBER = re.compile(r"^(?:np\.\w+\()?([-+0-9.eE]+|nan|inf|-inf|True|False)\)?$")
TOTAL_STEPS = re.compile(r"Total training steps: (\d+)")
RESUMED_AT = re.compile(r"Setting global step to (\d+)")


def number(text: str) -> float | None:
    """A value as verl's console logger prints it (pprint.pformat of a number: 0.5, 3, nan, np.float64(0.5))."""
    m = _NUMBER.match(text.strip())
    if not m:
        return None
    value = m.group(1)
    return {"True": 1.0, "False": 0.0}.get(value) if value in ("True", "False") else float(value)


def parse_step_lines(text: str) -> dict[int, dict[str, float]]:
    """{step: {key: value}} of every console-logger line, the last one of a step winning (validation-only lines,
    `step:0 - val-core/...` before training, included)."""
    steps: dict[int, dict[str, float]] = {}
    for raw in re.split(r"[\r\n]", ANSI.sub("", text)):
        m = _STEP_LINE.search(raw)
        if not m:
            continue
        values = {}
        for item in m.group(2).split(" - "):
            key, sep, value = item.rpartition(":")
            parsed = number(value) if sep else None
            if key and parsed is not None:
                values[key.strip()] = parsed
        if values:
            steps[int(m.group(1))] = values
    return steps


def is_training_step(metrics: dict[str, float]) -> bool:
    """Every entry point times a training step (timing_s/step); a validation-only line has no such key."""
    return "timing_s/step" in metrics


def wall_seconds(metrics: dict[str, float]) -> float:
    """A step's wall time as verl timed its parts: the step, and the validation and save that followed it (timed
    apart: ray_trainer.py:1224-1271)."""
    return sum(metrics.get(f"timing_s/{k}", 0.0) for k in ("step", "testing", "save_checkpoint"))


def override(command: Sequence[str], key: str) -> str | None:
    """The value of a trainer command's last `KEY=VALUE` (or `+KEY=VALUE`), one override an item: the last wins, as
    in Hydra; None where the command does not set the key."""
    return next((a.partition("=")[2] for a in reversed(command) if a.lstrip("+").partition("=")[0] == key), None)


def command_int(command: Sequence[str], key: str, default: int) -> int:
    """The last `KEY=N` of the trainer command (a user's override after the settings' wins there too)."""
    value = override(command, key) or ""
    return int(value) if value.lstrip("-").isdigit() else default
