"""The reward server's settings: each one's environment variable, flag and help, read and checked in one place.

It reads only its own REWARD_* names: the launch scripts' CONFIG_REWARD_* settings reach a server as flags
(LAUNCH_NAMES; CONFIG_REWARD_SERVER_PORT is the *first* port of several servers), never by being inherited.
"""

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args, get_origin


@dataclass(frozen=True)
class Settings:
    """Every setting: (environment variable, flag, help) in `SETTINGS` below."""

    model_path: str = ""
    device: str = "auto"
    host: str = "0.0.0.0"
    port: int = 8000
    max_length: int = 4096
    # How a pair becomes token ids (inputs.InputFormat): which of the ways TRL's RewardTrainer built its inputs.
    input: Literal["conversation", "completion"] = "conversation"
    add_special_tokens: Literal["auto", "true", "false"] = "auto"
    chat_template: Literal["auto", "off"] = "auto"
    append_eos: Literal["auto", "true", "false"] = "auto"
    pack: Literal["auto", "off"] = "auto"
    micro_batch_cost: int = 0  # 0: from the model on a GPU (planner.model_micro_batch_cost), 1024 on the CPU
    compile: Literal["auto", "layers", "off"] = "auto"
    gpu_memory_gib: float = 0.0  # 0: no cap
    auth_token: str = ""
    log_level: str = "info"


SETTINGS: dict[str, tuple[str, str, str]] = {  # name: (environment variable, flag's value, help)
    "model_path": ("REWARD_MODEL_PATH", "DIR", "the reward model's folder (config.json, weights, tokenizer)"),
    "device": ("REWARD_DEVICE", "DEVICE", "cpu | cuda | cuda:N | auto"),
    "port": ("REWARD_PORT", "PORT", "port to listen on"),
    "host": ("REWARD_HOST", "ADDRESS", "address to bind (0.0.0.0: every interface)"),
    "input": ("REWARD_INPUT", "WHAT", "conversation (prompt + response) | completion (the response alone)"),
    "add_special_tokens": ("REWARD_ADD_SPECIAL_TOKENS", "auto|true|false", "add the tokenizer's special tokens"),
    "chat_template": ("REWARD_CHAT_TEMPLATE", "auto|off", "the chat template (auto) or TRL's plain-text rule (off)"),
    "append_eos": ("REWARD_APPEND_EOS", "auto|true|false", "plain text: append EOS (auto: for conversation)"),
    "max_length": ("REWARD_MAX_LENGTH", "TOKENS", "tokens scored per pair; longer input keeps its last tokens"),
    "auth_token": ("REWARD_SERVER_TOKEN", "TOKEN", "if set, requests need 'Authorization: Bearer <token>'"),
    # --help-all only
    "log_level": ("REWARD_LOG_LEVEL", "LEVEL", "debug | info | warning"),
    "pack": ("REWARD_PACK", "auto|off", "auto (models up to Qwen3-1.7B's size: short sequences share a row) | off"),
    "micro_batch_cost": ("REWARD_MICRO_BATCH_COST", "TOKENS", "one more forward's cost in tokens (0: from the model)"),
    "compile": ("REWARD_COMPILE", "auto|layers|off", "auto (per-layer torch.compile on GPU) | layers | off"),
    "gpu_memory_gib": ("REWARD_GPU_MEMORY_GIB", "GIB", "GPU memory the server may take, weights included (0: no cap)"),
}
# What `--help` shows (FIRST), in this order.
_GROUPS = {
    "the model and where it serves": ("model_path", "device", "port", "host"),
    "the format it was trained in (check_format)": ("input", "add_special_tokens", "chat_template", "append_eos"),
    "what is scored, who may ask": ("max_length", "auth_token"),
}
FIRST = tuple(name for names in _GROUPS.values() for name in names)
USAGE = "reward_server --model-path DIR [--device DEVICE] [--port PORT] [--input WHAT] [options]"
DESCRIPTION = """Scores (prompt, response) pairs over HTTP as TRL trained the reward model (docs/reward.md).
  python reward_score/reward_server.py --model-path /models/Unsafe-Reward-Qwen3-1.7B --device cuda:0
Each flag has a REWARD_* environment variable (in brackets); the flag wins."""
EPILOG = """Batching, kernels and logging: --help-all (measured defaults; docs/reward.md)."""


# The values of the settings typed as a Literal (also read by check_format and the launch scripts' refusals).
CHOICES = {f.name: get_args(f.type) for f in fields(Settings) if get_origin(f.type) is Literal}


def load_settings(argv: Sequence[str] | None = None, environ: dict[str, str] | None = None) -> Settings:
    """Defaults, then the environment, then command-line flags (which win). Bad values exit with the name to fix."""
    environ = dict(os.environ if environ is None else environ)
    argv = list(sys.argv[1:] if argv is None else argv)
    every = "--help-all" in argv
    width = min(118, shutil.get_terminal_size().columns - 2)
    parser = argparse.ArgumentParser(
        prog="reward_server",
        usage=USAGE,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, width=width, max_help_position=32),
    )
    parser.add_argument("--help-all", action="help", help="show every setting and exit")
    groups = {}
    for title, names in _GROUPS.items():
        group = parser.add_argument_group(title)
        groups.update(dict.fromkeys(names, group))
    tuning = parser.add_argument_group("tuning (measured defaults)") if every else parser
    defaults = Settings()
    values: dict[str, Any] = {}
    for name in [*FIRST, *(f.name for f in fields(Settings) if f.name not in FIRST)]:
        env_name, metavar, help_text = SETTINGS[name]
        kind = type(getattr(defaults, name))
        raw = environ.get(env_name)
        if raw not in (None, ""):
            try:
                values[name] = kind(raw)
            except ValueError:
                parser.error(f"{env_name}={raw!r} is not a valid {kind.__name__}")
        default = getattr(defaults, name)
        default = "required" if name == "model_path" else f"default {'none' if default == '' else default}"
        shown = f"{help_text} [{env_name}, {default}]"
        group = groups.get(name, tuning)
        group.add_argument(
            _flag(name),
            type=kind,
            default=None,
            metavar=metavar,
            help=shown if name in groups or every else argparse.SUPPRESS,
        )
    args = parser.parse_args(argv)
    values.update({k: v for k, v in vars(args).items() if v is not None})
    settings = replace(defaults, **values)
    problems = []
    for name, allowed in CHOICES.items():
        if getattr(settings, name) not in allowed:
            problems.append(f"{SETTINGS[name][0]} must be {' or '.join(allowed)}, got {getattr(settings, name)!r}")
    if settings.micro_batch_cost < 0:
        problems.append(
            f"REWARD_MICRO_BATCH_COST must be 0 (from the model) or a number of tokens, got {settings.micro_batch_cost}"
        )
    if settings.gpu_memory_gib < 0:
        problems.append(f"REWARD_GPU_MEMORY_GIB must be 0 (no cap) or a size in GiB, got {settings.gpu_memory_gib}")
    if not (settings.device in ("auto", "cpu", "cuda") or settings.device.startswith("cuda:")):
        problems.append(f"REWARD_DEVICE must be cpu, cuda, cuda:N or auto, got {settings.device!r}")
    if settings.max_length < 1:
        problems.append(f"REWARD_MAX_LENGTH must be at least 1, got {settings.max_length}")
    if problems:
        parser.error("; ".join(problems))
    return settings


# The run script's names (the article's, for the first two) and the setting helper_grpo_qwen3_4b.sh passes each as.
LAUNCH_NAMES = {
    "CONFIG_REWARD_MODEL_PATH": "model_path",
    "CONFIG_REWARD_DEVICE": "device",
    "CONFIG_REWARD_INPUT": "input",
    "CONFIG_REWARD_ADD_SPECIAL_TOKENS": "add_special_tokens",
    "CONFIG_REWARD_CHAT_TEMPLATE": "chat_template",
    "CONFIG_REWARD_APPEND_EOS": "append_eos",
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def launch_names_not_read(settings: Settings, environ: dict[str, str] | None = None) -> list[str]:
    """One line per CONFIG_REWARD_* name set to something other than what this server runs with (it is not read)."""
    environ = dict(os.environ if environ is None else environ)
    notes = []
    for launch, name in LAUNCH_NAMES.items():
        value, used = environ.get(launch, ""), str(getattr(settings, name))
        if value and value != used:
            notes.append(
                f"{launch}={value} is not read by this server (it reads {SETTINGS[name][0]} or {_flag(name)}; the "
                f"launch scripts pass {launch} as {_flag(name)}): running with {name}={used or '(unset)'}"
            )
    return notes


def check_model_path(path: str) -> str | None:
    """Why `path` cannot be a reward model folder, or None. Checked before anything starts."""
    if not path:
        return "REWARD_MODEL_PATH (or --model-path) is not set: point it at the reward model's folder"
    folder = Path(path)
    if not folder.is_dir():
        return f"the reward model path {path} (--model-path, REWARD_MODEL_PATH): no such directory"
    if not (folder / "config.json").is_file():
        return f"the reward model path {path}: no config.json there (is it the folder save_pretrained wrote?)"
    return None
