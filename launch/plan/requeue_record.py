"""A requeued start's preflight: what the first start's expensive checks (the reward server's load and round trip, the
trainer's imports) read, recorded when they pass (`logs/<jobid>/preflight_ok.json`), and compared on a requeue
(SLURM_RESTART_COUNT above 0): equal, those checks are skipped; not, they run in full, naming what changed."""

import dataclasses
import hashlib
import json
import os
import re
import sysconfig
from pathlib import Path

from launch.plan.settings import REPO, Settings


def stamps(path) -> list:
    """[name, size, mtime_ns] of a file, or of each file in a folder (not below: a model's or the data's are flat)."""
    p = Path(path)
    files = [] if not path else sorted(p.iterdir()) if p.is_dir() else [p]  # Path("") is the current folder
    return [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files if f.is_file()]


# Settings the expensive checks do not read, which the run script may set anew for each start
UNREAD = ("checkpoint_before_end", "esi_redundant_time", "stall_", "reward_restart")


def fingerprint(settings: Settings, extra: list[str]) -> dict:
    """What the expensive checks (the reward server's load and round trip, the trainer's imports) read: the image (or,
    with CONTAINER=none, the packages installed here), the model folders, the data, our reward code, the settings,
    the reward server's environment and the extra overrides; files by name, size and mtime, our code by content."""
    env, packages = os.environ, Path(sysconfig.get_paths()["purelib"]).glob("*.dist-info")  # names carry versions
    image = sorted(p.name for p in packages) if settings.container == "none" else stamps(settings.image)
    values = {k: v for k, v in dataclasses.asdict(settings).items() if not k.startswith(UNREAD)}
    code = sorted(REPO.glob("reward_score/**/*.py"))  # the server's package too; no user function: nothing for it
    code += [Path(env["REWARD_FUNCTION_PATH"])] if env.get("REWARD_FUNCTION_PATH") else []
    return json.loads(json.dumps(default=str, obj={
        "image": image, "policy_model": stamps(settings.model_path),
        "reward_model": stamps(settings.reward_model_path) if settings.uses_reward_model else [],
        "data": stamps(settings.train_file) + stamps(settings.test_file),
        "reward_code": [[str(f), hashlib.sha256(f.read_bytes()).hexdigest()] for f in code if f.is_file()],
        "settings": values, "overrides": extra,
        "environment": {k: v for k, v in sorted(env.items())
                        if k.startswith(("PREFLIGHT_", "REWARD_", "TRAINER_IS_VERL")) and k != "REWARD_SERVER_TOKEN"},
    }))  # fmt: skip


def skip_expensive(now: dict, record: Path, restarts: str) -> bool:
    """On a requeued start (SLURM_RESTART_COUNT above 0), True where `record`, what the first start's passing checks
    read, equals `now`; says what was compared, or what changed."""
    if restarts in ("", "0"):
        return False
    before = json.loads(record.read_text()) if record.is_file() else {}
    changed = [name for name in now if before.get(name) != now[name]]
    server = now["settings"]["reward"] != "rule" and now["environment"].get("PREFLIGHT_REWARD", "1") == "1"
    what = ("the reward server's load and round trip and " if server else "") + "the trainer's imports"
    if changed:
        print(f"preflight: requeued start: {', '.join(changed)} changed since the first start's checks ({record}): "
              f"{what} run in full")  # fmt: skip
    else:
        print(f"preflight: requeued start: {', '.join(now)} (files by content or name, size and mtime) are as at "
              f"the first start's checks ({record}): {what} skipped")  # fmt: skip
    return not changed


def first_start_record(env) -> Path | None:
    """The record in the first start's log folder (a requeued start's JOB_LOG_DIR ends in -rN); None outside a job."""
    log_dir = env.get("JOB_LOG_DIR")
    return Path(re.sub(r"-r\d+$", "", log_dir), "preflight_ok.json") if log_dir else None


def keep(record: Path | None, now: dict) -> None:
    """Write what the passing full checks read, atomically (a requeue must never read half a record)."""
    if record is not None and record.parent.is_dir():
        record.with_suffix(".tmp").write_text(json.dumps(now))
        os.replace(record.with_suffix(".tmp"), record)
