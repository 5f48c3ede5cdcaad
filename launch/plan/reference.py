"""The reference pages that are generated from the code, so that they cannot drift from it:

    python -m launch.plan.reference write     # docs/settings.md and docs/trainer-command.md from the code
    python -m launch.plan.reference check     # exit 1 naming each page that is not what `write` would make

docs/settings.md is the run script's settings block as a table: each setting's section, default and comment exactly
as the block has them, and the article's name where it had one (ARTICLE_NAMES). docs/trainer-command.md is the trainer
command the defaults make, one override per line, each with the settings that feed it (found by changing one setting
at a time and seeing which overrides move). tests/test_docs.py runs `check`.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from launch.plan.settings import REPO, SettingError, Settings
from launch.plan.trainer_command import FIXED_OVERRIDES, trainer_argv

RUN_SCRIPT = REPO / "run_grpo_qwen3_4b_mega_verl.sh"
SETTINGS_PAGE = REPO / "docs" / "settings.md"
COMMAND_PAGE = REPO / "docs" / "trainer-command.md"

# The article's name for a setting of the block (its run script's CONFIG_* exports, or the trainer key its helper
# hard-coded, with the article's value). A setting missing here had none.
ARTICLE_NAMES = {
    "CONFIG_IMAGE_PATH": "`${CONFIG_HOME_PATH}/singularity/verl_app_v061.sif` in its srun line",
    "CONFIG_MODEL_PATH": "`CONFIG_MODEL_PATH`",
    "CONFIG_REWARD_MODEL_PATH": "`CONFIG_REWARD_MODEL_PATH`",
    "CONFIG_TRAIN_FILE": "`CONFIG_TRAIN_FILE` (it pointed at the test file)",
    "CONFIG_TEST_FILE": "`CONFIG_TEST_FILE` (it pointed at the train file)",
    "CONFIG_OUTPUT_DIR": "`trainer.default_local_dir=${HOME_PATH}/output_model/...`",
    "HF_HOME": "`--env HF_HOME=${CONFIG_HOME_PATH}/.cache/huggingface`",
    "CONFIG_GPUS_PER_NODE": "`CONFIG_GPUS_PER_NODE`",
    "CONFIG_NETWORK_INTERFACE": "`NCCL_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME`, `TP_SOCKET_IFNAME`",
    "WANDB_PROJECT": "`trainer.project_name='llm_safe_hack'`",
    "CONFIG_USE_SEPARATE_REWARD_NODE": "`CONFIG_USE_SEPARATE_REWARD_NODE`",
    "CONFIG_REWARD_DEVICE": "`CONFIG_REWARD_DEVICE`",
    "ALGORITHM": "`algorithm.adv_estimator=grpo`",
    "ROLLOUT_MODE": "`actor_rollout_ref.rollout.mode=async`",
    "ROLLOUT_ENGINE": "`actor_rollout_ref.rollout.name=sglang`",
    "TRAIN_BATCH_SIZE": "`data.train_batch_size=256`",
    "MAX_PROMPT_LENGTH": "`data.max_prompt_length=2048`",
    "MAX_RESPONSE_LENGTH": "`data.max_response_length=4096`",
    "ACTOR_LR": "`actor_rollout_ref.actor.optim.lr=1e-6`",
    "PPO_MINI_BATCH_SIZE": "`actor_rollout_ref.actor.ppo_mini_batch_size=128`",
    "MICRO_BATCH_PER_GPU": "`ppo_micro_batch_size_per_gpu=4`, `log_prob_micro_batch_size_per_gpu=4`",
    "ACTOR_PP": "`actor.megatron.pipeline_model_parallel_size=2` (and ref's)",
    "ACTOR_TP": "`actor.megatron.tensor_model_parallel_size=1` (and ref's)",
    "ROLLOUT_TP": "`actor_rollout_ref.rollout.tensor_model_parallel_size=1`",
    "ROLLOUT_N": "`actor_rollout_ref.rollout.n=4`",
    "ROLLOUT_GPU_MEMORY": "`actor_rollout_ref.rollout.gpu_memory_utilization=0.4`",
    "ROLLOUT_ENFORCE_EAGER": "`actor_rollout_ref.rollout.enforce_eager=true` (now false by default)",
    "KL_LOSS_COEF": "`actor_rollout_ref.actor.kl_loss_coef=0.001`",
    "TOTAL_EPOCHS": "`trainer.total_epochs=1`",
    "SAVE_FREQ": "`trainer.save_freq=25`",
    "TEST_FREQ": "`trainer.test_freq=5`",
    "PROJECT_NAME": "`trainer.project_name='llm_safe_hack'`",
    "EXPERIMENT_NAME": "`trainer.experiment_name='qwen3_4b_grpo_megatron'`",
    "TRAINER_LOGGER": "`trainer.logger=['console','wandb']`",
    "FP8": 'the `+...fp8="e4m3"` and `fp8_recipe="blockwise"` overrides (verl 0.6.1 ignored them)',
    "CONFIG_REWARD_SERVER_PORT": "`CONFIG_REWARD_SERVER_PORT=8000` (the server itself always took 8000)",
    "RAY_PORT": "`ray start --port 6379`",
}

# The article's names that are no settings here, and what took their place.
ARTICLE_ONLY = [
    ("CONFIG_HOME_PATH", "every default path is inside the repository (`$repo`); set each path setting instead"),
    ("CONFIG_NUM_NODES", "`#SBATCH --nodes` (or `sbatch --nodes=N`): the job reads Slurm's node count"),
    ("CONFIG_REWARD_SCRIPT_PATH, CONFIG_REWARD_FUNCTION_NAME",
     "always `reward_score/safe_hack_reward_request.py`, its entry point picked for the rollout mode "
     "(trainer-command.md)"),
    ("REWARD_SERVER_URL", "the job starts the servers and sets `REWARD_SERVER_URLS` for verl's workers"),
    ("MASTER_ADDR, MASTER_PORT", "the head's address comes from the node (`CONFIG_NETWORK_INTERFACE`), its ports are "
     "the job's own"),
    ("VERL_ROOT_DIR, PYTHONPATH, NPROC_PER_NODE, CUDA_VISIBLE_DEVICES",
     "verl is in the image; Slurm gives each node its GPUs"),
]  # fmt: skip

_SECTION = re.compile(r"^# -- (.+?) -+$")
_SETTING = re.compile(r'^([A-Z][A-Z0-9_]*)="\$\{\1:-(.*?)\}"\s*(?:#\s?(.*))?$')


@dataclass(frozen=True)
class BlockSetting:
    name: str
    default: str  # as written in the block, e.g. $repo/verl_app.sif
    comment: str
    section: str
    note: str  # a comment line above it within its section, if any


def block_text() -> str:
    return RUN_SCRIPT.read_text().split("# ---- settings", 1)[1].split("\n# ------------", 1)[0]


def block_settings() -> list[BlockSetting]:
    """Every setting of the run script's block, in its order, with its section and comment."""
    out, section, note, continued = [], "", "", False
    for line in block_text().splitlines():
        if m := _SECTION.match(line):
            section, note = m.group(1).split(" (", 1)[0], ""
        elif m := _SETTING.match(line):
            out.append(BlockSetting(m.group(1), m.group(2), (m.group(3) or "").strip(), section, note))
        elif line.startswith("# "):  # a note of several lines is one paragraph
            note = f"{note} {line[2:].strip()}" if continued else line[2:].strip()
        continued = line.startswith("# ") and not _SECTION.match(line)
    return out


def block_defaults(repo: str = str(REPO)) -> dict[str, str]:
    """The block's defaults as it exports them, with `repo` as the repository folder."""
    script = f'repo={repo}; source <(sed -n "/^# ---- settings/,/^# ------------/p" {RUN_SCRIPT}); env -0'
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True, cwd=REPO,
                         env={"PATH": "/usr/bin:/bin"}).stdout  # fmt: skip
    return dict(kv.split("=", 1) for kv in out.split("\0") if "=" in kv)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def settings_page() -> str:
    """docs/settings.md: the block, section by section."""
    lines = [
        "# Settings of run_grpo_qwen3_4b_mega_verl.sh",
        "",
        "Generated from the block of settings at the top of the run script by `python -m launch.plan.reference write`",
        '(a test fails when this page and the block differ). Each setting is `NAME="${NAME:-default}"`: edit the',
        "default in the script, or set the name in the environment of `sbatch` (`NAME=value sbatch ...`, or",
        "`sbatch --export=ALL,NAME=value ...`). `$repo` is the repository root (submit from there). What refuses a",
        "value, and why: `launch/plan/refusals.py` (and, on the trainer config composed from the values,",
        "`launch/plan/config_refusals.py`); the trainer keys each one feeds: [trainer-command.md](trainer-command.md).",
        "",
    ]
    header = ["| setting | default | what it is | the article's name |", "|---|---|---|---|"]
    section, note = None, ""
    for s in block_settings():
        if s.section != section:
            section, note = s.section, ""
            lines += [f"## {section}", ""] + (header if not s.note else [])
        if s.note != note:  # a comment inside the section: the settings below it
            note = s.note
            lines += ([""] if lines[-1] else []) + [note, "", *header]
        default = f"`{s.default}`" if s.default else "(empty)"
        article = ARTICLE_NAMES.get(s.name, "")
        lines.append(f"| `{s.name}` | {_cell(default)} | {_cell(s.comment)} | {_cell(article)} |")
    lines += [
        "",
        "## The article's names that are no settings here",
        "",
        "| the article's name | instead |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {_cell(instead)} |" for name, instead in ARTICLE_ONLY]
    return "\n".join(_close_tables(lines)) + "\n"


def _close_tables(lines: list[str]) -> list[str]:
    """A blank line before each heading that follows a table row."""
    out: list[str] = []
    for line in lines:
        if line.startswith("## ") and out and out[-1] != "":
            out.append("")
        out.append(line)
    return out


# Values that change a setting without breaking the command: a number or path becomes another, an enumeration takes
# another of its values. Settings with no entry (and those that need what this machine lacks) are not traced.
_OTHER_VALUES = {"ALGORITHM": ["ppo", "dapo"], "STRATEGY": ["fsdp2"], "ROLLOUT_MODE": ["sync"],
                 "ROLLOUT_ENGINE": ["vllm"], "REWARD_MANAGER": ["naive"], "TRAINER_LOGGER": ["[console]"],
                 "ESI_REDUNDANT_TIME": ["77"], "MEGATRON_RECOMPUTE": ["selective"], "ROLLOUT_GPU_MEMORY": ["0.5"],
                 "FUSED_KERNELS": ["off"]}  # fmt: skip
# What moves a key besides the block: Slurm's node count (the #SBATCH line or sbatch --nodes).
_OUTSIDE_THE_BLOCK = {"#SBATCH --nodes": {"SLURM_NNODES": "3"}}
_NOT_A_SETTING = {
    "custom_reward_function.path": "always this repository's reward function",
    "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook": "every job: the save on preemption (operations.md)",
} | {
    key: "every job: micro-batches by token count (training.md)"
    for key in ("actor_rollout_ref.actor.use_dynamic_bsz", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
                "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "critic.use_dynamic_bsz")
}  # fmt: skip
DEFAULT_POLICY_OPENS_THINK = "true"  # what REWARD_PROMPT_OPENS_THINK=auto reads from Qwen3-4B-Thinking-2507's template
# What FUSED_KERNELS=auto makes of Qwen3-4B's config.json (hidden 2560, tied) at the default ACTOR_PP=2
# (trainer_command.fused_kernels); on keeps them where the config is not here.
DEFAULT_POLICY_FUSED_KERNELS = "on"


def _other_values(name: str, value: str) -> list[str]:
    if name in _OTHER_VALUES:
        return _OTHER_VALUES[name]
    if re.fullmatch(r"-?[0-9]+", value):
        return [str(int(value) + 7)]
    if re.fullmatch(r"[0-9.e+-]+", value):
        return ["0.123"]
    if value in ("true", "false"):
        return ["false" if value == "true" else "true"]
    if value.startswith("/"):
        return ["/elsewhere" + value]
    return [value + "_other"] if value else []


def _key_values(argv: list[str]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in argv if "=" in a and not a.startswith("--"))


def _changed_by(defaults: dict[str, str]) -> dict[str, list[str]]:
    """For each override key of the default command, the settings whose change moves it."""
    base = _key_values(trainer_argv(Settings.from_env(defaults)))
    fed: dict[str, list[str]] = {k: [] for k in base}
    changes = [(s.name, {s.name: other}) for s in block_settings() for other in _other_values(s.name, defaults[s.name])]
    for name, change in [*changes, *_OUTSIDE_THE_BLOCK.items()]:
        try:
            moved = _key_values(trainer_argv(Settings.from_env(defaults | change)))
        except (SettingError, ValueError):
            continue
        for key, val in base.items():
            if moved.get(key) != val and name not in fed[key]:
                fed[key].append(name)
    return fed


def command_page() -> str:
    """docs/trainer-command.md: the default GRPO command, one override per line, with what feeds each."""
    placeholder = "/path/to/repo"
    # auto reads the policy's chat template, which is not here: the page shows what it reads from the default
    # policy's, Qwen3-4B-Thinking-2507's (its generation prompt ends in <think>).
    defaults = block_defaults(placeholder) | {"REWARD_PROMPT_OPENS_THINK": DEFAULT_POLICY_OPENS_THINK,
                                              "FUSED_KERNELS": DEFAULT_POLICY_FUSED_KERNELS}  # fmt: skip
    argv = [a.replace(str(REPO), placeholder) for a in trainer_argv(Settings.from_env(defaults))]  # the reward file
    fed = _changed_by(defaults)
    fixed = {a.split("=", 1)[0] for a in FIXED_OVERRIDES}
    entry = [a for a in argv if "=" not in a or a.startswith("--")]
    overrides = [a for a in argv if a not in entry]
    width = max(len(a) for a in overrides) + 2
    body = [f"python3 {' '.join(entry)}"]  # TRAINER_LAUNCHER's default
    for a in overrides:
        key = a.split("=", 1)[0]
        if fed.get(key):
            why = ", ".join(fed[key])
        elif key in _NOT_A_SETTING:
            why = _NOT_A_SETTING[key]
        elif key in fixed:
            why = "every job (FIXED_OVERRIDES)"
        else:
            why = "the algorithm's own value (ALGORITHM)"
        body.append(f"{a.ljust(width)}# {why}")
    return "\n".join([
        "# The default trainer command",
        "",
        "Generated by `python -m launch.plan.reference write` from the settings block's defaults and",
        "`launch/plan/trainer_command.py` (a test fails when they differ): what the reference job (GRPO, Megatron, SGLang,",
        "async rollout) runs, one Hydra override per line, each with the settings whose change moves it. Every job writes",
        "its own command to `logs/<job id>/trainer_command.txt`, one argument per line; what follows differs from it only in",
        f"`{placeholder}` (your repository), `trainer.esi_redundant_time` (600 s on a first start, then measured:",
        "[operations.md](operations.md)), `prompt_opens_think` (`REWARD_PROMPT_OPENS_THINK=auto` reads your policy's",
        "chat template; Qwen3-4B-Thinking-2507's opens `<think>`: True), the two `use_fused_kernels` keys",
        "(`FUSED_KERNELS=auto` reads your policy's config.json: Qwen3-4B's at `ACTOR_PP=2` runs them) and the two keys",
        "each start adds:",
        "`+ray_kwargs.ray_init.address=` (this job's Ray head) and your own extra overrides, last",
        "(`sbatch run_grpo_qwen3_4b_mega_verl.sh KEY=VALUE ...`: they win).",
        "",
        "Other combinations (`ALGORITHM`, `TRAINER_MODE`, `STRATEGY`, `ROLLOUT_MODE`) change the entry point and keys;",
        "`PREFLIGHT_ONLY=1 bash run_grpo_qwen3_4b_mega_verl.sh` composes yours with verl's own config and prints",
        "how many overrides it has.",
        "",
        "```text",
        *body,
        "```",
        "",
    ])  # fmt: skip


PAGES = {SETTINGS_PAGE: settings_page, COMMAND_PAGE: command_page}

# --- the messages the scripts print, for docs/operations.md -------------------------------------------------------

OPERATIONS_PAGE = REPO / "docs" / "operations.md"
# Where the job and the merge print errors and warnings: the entry scripts and their bash library (die, err, the
# reasons a node reports to the others, the settings the run script refuses before the container starts), and the
# Python they run before and while the job starts (refusals, reading the settings, the preflight, the save deadline,
# each node's ports and address, the wait for Ray, starting a server), and the status command's errors and warnings.
BASH_SOURCES = ("run_grpo_qwen3_4b_mega_verl.sh", "helper_grpo_qwen3_4b.sh", "merge_mcore_to_hf.sh",
                "launch/job/common.sh", "launch/watch/canary.sh")  # fmt: skip
PYTHON_SOURCES = ("launch/plan/refusals.py", "launch/plan/settings.py", "launch/plan/preflight.py", "launch/plan/deadline.py",
                  "launch/plan/config_refusals.py", "launch/plan/trainer_command.py", "launch/plan/reward_check.py",
                  "launch/job/node.py", "launch/job/ray_cluster.py", "launch/plan/procs.py", "launch/watch/reading.py",
                  "launch/watch/health.py", "launch/watch/status.py", "launch/plan/thinking.py",
                  "launch/plan/trainer_imports.py", "launch/job/watchdog.py")  # fmt: skip
MIN_LITERAL = 12  # a message whose every literal piece is shorter is all variables (err "$*"): nothing to key on


@dataclass(frozen=True)
class Message:
    where: str  # file:line
    pieces: tuple[str, ...]  # its literal text, split where a value is filled in

    def text(self) -> str:
        return " ... ".join(self.pieces)


# A $(...) command substitution, nested three deep, and a double-quoted string with its quotes inside such a command
_COMMAND = r"\$\((?:[^()\"\\]|\\.|\"(?:[^\"\\]|\\.)*\"|\((?:[^()]|\([^()]*\))*\))*\)"
_QUOTED = re.compile(r" *(?:\"((?:\\.|" + _COMMAND + r"|[^\"\\])*)\"|'([^']*)')", re.S)
# In a double-quoted string's text: an escaped character (literal), else a value filled in (a command, ${...},
# $name, $1, $*, ...), else a literal character
_TOKEN = re.compile(r"\\(.)|(" + _COMMAND + r"|\$\{[^}]*\}|\$(?:[A-Za-z_][A-Za-z0-9_]*|[0-9*#?@$]))|(.)", re.S)


def _bash_pieces(raw: str) -> list[str]:
    """The literal pieces of a double-quoted string's text: every $(...), ${...} and $name breaks it."""
    out = [""]
    for m in _TOKEN.finditer(raw):
        if m.group(2):
            out.append("")
        else:
            out[-1] += m.group(1) or m.group(3)
    return out


_BASH_MESSAGE = re.compile(r"(?:\b(?:die|err)\s+|\bfailure\+?=|\bmissing\+=\(|printf '(?=ERROR))")


def _where(path: Path, line: int) -> str:
    return f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}:{line}"


def bash_messages(path: Path) -> list[Message]:
    """die and err calls, the `failure` a node reports, the run script's `missing` settings, printf 'ERROR: ...'."""
    found, lines = [], path.read_text().splitlines()
    logical, start = "", 0
    for number, line in enumerate(lines, 1):
        if not logical:
            start = number
        logical += line.rstrip("\\") + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        text, logical = logical, ""
        if text.lstrip().startswith("#"):
            continue
        for m in _BASH_MESSAGE.finditer(text):
            rest, pieces, j = text[m.end() :], [], 0
            if m.group(0).startswith("printf"):
                pieces = [re.split(r"%s|\\n", rest.split("'", 1)[0])]
            else:
                while q := _QUOTED.match(rest, j):
                    pieces.append(_bash_pieces(q.group(1)) if q.group(1) is not None else [q.group(2)])
                    j = q.end()
            flat = tuple(p.strip() for group in pieces for p in group if p.strip())
            if m.group(0) == "failure+=" and found and found[-1].where == _where(path, start - 1):
                # the rest of the reason the line above began: one message
                found[-1] = Message(_where(path, start), found[-1].pieces + flat)
                continue
            found.append(Message(_where(path, start), flat))
    return found


def _py_pieces(node) -> list[str]:

    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        out = [""]
        for value in node.values:
            if isinstance(value, ast.Constant):
                out[-1] += value.value
            else:
                out.append("")
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _py_pieces(node.left), _py_pieces(node.right)
        return [*left[:-1], left[-1] + right[0], *right[1:]]
    if isinstance(node, ast.IfExp):
        return ["", *_py_pieces(node.body), "", *_py_pieces(node.orelse), ""]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join":
        return [""]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [p for element in node.elts for p in ("", *_py_pieces(element))]
    return [""]


_RAISED = (
    "SettingError",
    "NodeError",
    "StatusError",
    "ValueError",
    "RuntimeError",
    "TimeoutError",
    "TemplateError",
    "StallError",
)


def python_messages(path: Path) -> list[Message]:
    """What a module adds to its problems or warnings, raises as one of _RAISED, or prints to stderr."""

    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        texts = []
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "append":
            target = node.func.value  # problems.append, or (warnings if ... else lines).append
            names = [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]
            if isinstance(target, (ast.Name, ast.IfExp)) and {"problems", "warnings"} & set(names):
                texts = node.args
        elif isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            if isinstance(node.exc.func, ast.Name) and node.exc.func.id in _RAISED:
                texts = node.exc.args
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
            if any(k.arg == "file" and ast.unparse(k.value) == "sys.stderr" for k in node.keywords):
                texts = node.args
        elif isinstance(node, ast.Return) and path.name.endswith("refusals.py"):  # `return problems + [...]`
            value = node.value.elt if isinstance(node.value, ast.ListComp) else node.value
            texts = [value] if isinstance(value, (ast.List, ast.BinOp, ast.JoinedStr)) else []
        for text in texts:
            pieces = tuple(p.strip() for p in _py_pieces(text) if p.strip())
            if isinstance(node, ast.Return) and not any(len(p) >= MIN_LITERAL for p in pieces):
                continue  # a list of values, not a message
            found.append(Message(_where(path, node.lineno), pieces))
    return found


def messages() -> list[Message]:
    """Every error or warning message the job and the merge can print, with some literal text to key on."""
    found = [m for name in BASH_SOURCES for m in bash_messages(REPO / name)]
    found += [m for name in PYTHON_SOURCES for m in python_messages(REPO / name)]
    return [m for m in found if any(len(p) >= MIN_LITERAL for p in m.pieces)]


def documented_keys(page: Path = OPERATIONS_PAGE) -> list[str]:
    """The keys of docs/operations.md's message table: the first cell of each row, a piece of a message's text."""
    text = page.read_text() if page.is_file() else ""
    section = text.split("\n## Messages", 1)[1] if "\n## Messages" in text else ""
    return [k.replace("\\|", "|") for k in re.findall(r"^\| `([^`]+)` \|", section, flags=re.M)]  # \| in a table


def undocumented(keys: list[str] | None = None) -> list[Message]:
    keys = documented_keys() if keys is None else keys
    return [m for m in messages() if not any(k in p for k in keys for p in m.pieces)]


def stale_keys(keys: list[str] | None = None) -> list[str]:
    keys = documented_keys() if keys is None else keys
    every = messages()
    return [k for k in keys if not any(k in p for m in every for p in m.pieces)]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv not in (["write"], ["check"]):
        print(__doc__, file=sys.stderr)
        return 2
    stale = []
    for page, make in PAGES.items():
        text = make()
        if argv == ["write"]:
            page.write_text(text)
        elif not page.is_file() or page.read_text() != text:
            stale.append(page.relative_to(REPO))
    for page in stale:
        print(f"{page} is not what the code makes: run python -m launch.plan.reference write", file=sys.stderr)
    missing, unknown = undocumented(), stale_keys()
    for message in missing:
        print(f"docs/operations.md has no entry for {message.where}: {message.text()}", file=sys.stderr)
    for key in unknown:
        print(f"docs/operations.md: no message of the scripts contains `{key}`", file=sys.stderr)
    return 1 if stale or missing or unknown else 0


if __name__ == "__main__":
    sys.exit(main())
