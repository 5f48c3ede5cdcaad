"""Check that an environment can run this project's jobs: what the job imports, the reward server round trip, the
web stack verl's async rollout servers need, and (in the image build) that nothing of the base image moved.

python3 launch/plan/image_check.py                        # the image's %test: the engine is whichever one is installed
python3 launch/plan/image_check.py --record-base /opt/verl_app   # %post, first: the base's packages, before anything
python3 launch/plan/image_check.py --base /opt/verl_app          # %post, last, and %test: nothing of the base moved
python3 launch/plan/image_check.py --engine none --skip-recipes --skip-megatron   # the CPU test environment (PyPI verl)

Modules marked `gpu` are checked strictly only where a GPU is visible (`singularity test --nv`: docs/image.md).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]


def load_by_path(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# By path, as the image holds it (/opt/verl-slurm, no package installed): the standard library only.
procs = load_by_path("procs", HERE / "launch" / "plan" / "procs.py")

# verl 0.6.1's run_unvicorn (verl/workers/rollout/utils.py) starts its async rollout servers with
# `server.should_exit = True; await server.serve(); create_task(server.main_loop())`. From uvicorn 0.41.0 on, serve()
# shuts the started server down when should_exit is already set, so the port closes right after it opens.
UVICORN_FIRST_BREAKING = "0.41.0"


@dataclass(frozen=True)
class Module:
    name: str
    gpu: bool = False  # its import loads CUDA libraries: only checked strictly where a GPU is visible
    why: str = ""


COMMON = [
    Module("verl"),
    Module("verl.trainer.main_ppo", why="the PPO/GRPO entry point"),
    Module("verl.workers.fsdp_workers", why="STRATEGY=fsdp2"),
    Module("verl.model_merger", why="merge_mcore_to_hf.sh"),
    Module("fastapi"),
    Module("starlette"),
    Module("uvicorn"),
    Module("pydantic"),
    Module("prometheus_client"),
    Module("requests"),
]
MEGATRON = [
    Module("megatron.core", why="STRATEGY=megatron"),
    Module("transformer_engine", gpu=True, why="Megatron's fused layers"),
    Module("verl.workers.megatron_workers", gpu=True, why="STRATEGY=megatron"),
]
RECIPES = [
    Module("recipe.dapo.main_dapo", why="ALGORITHM=dapo"),
    Module("recipe.one_step_off_policy.main_ppo", why="TRAINER_MODE=one_step_off"),
]
ENGINES = {
    "sglang": [
        Module("sglang"),
        Module("sgl_kernel", gpu=True),
        Module("verl.workers.rollout.sglang_rollout.sglang_rollout", gpu=True, why="ROLLOUT_MODE=sync"),
        Module("verl.workers.rollout.sglang_rollout.async_sglang_server", gpu=True, why="ROLLOUT_MODE=async"),
    ],
    "vllm": [
        Module("vllm"),
        Module("verl.workers.rollout.vllm_rollout.vllm_rollout_spmd", gpu=True, why="ROLLOUT_MODE=sync"),
        Module("verl.workers.rollout.vllm_rollout.vllm_async_server", gpu=True, why="ROLLOUT_MODE=async"),
    ],
}
# One-step-off builds its weight-sync group through vllm.distributed whatever the engine: only the vLLM image runs it.
ENGINE_RECIPES = {
    "sglang": [],
    "vllm": [
        Module("recipe.one_step_off_policy.distributed_util", why="one-step-off's weight sync"),
        # ...which imports these inside stateless_init_process_group, when the trainer starts: importing the
        # module alone would not show them missing.
        Module("vllm.distributed.utils", why="distributed_util.py: StatelessProcessGroup"),
        Module("vllm.distributed.device_communicators.pynccl", gpu=True, why="distributed_util.py: PyNcclCommunicator"),
        Module("recipe.one_step_off_policy.fsdp_workers", gpu=True, why="one-step-off, STRATEGY=fsdp2"),
        Module("recipe.one_step_off_policy.megatron_workers", gpu=True, why="one-step-off, STRATEGY=megatron"),
    ],
}


def installed(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def detect_engine() -> str:
    """The rollout engine installed here: an image holds exactly one of SGLang and vLLM."""
    found = [name for name in ("sglang", "vllm") if installed(name)]
    if len(found) != 1:
        raise RuntimeError(f"expected exactly one rollout engine (sglang or vllm) installed, found {found or 'none'}")
    return found[0]


def gpu_visible() -> bool:
    """The CUDA driver loads and sees a device: `--nv` bound it in (Singularity shows /dev/nvidia* without it too)."""
    import ctypes

    try:
        return ctypes.CDLL("libcuda.so.1").cuInit(0) == 0
    except OSError:
        return False


def modules_to_check(engine: str, recipes: bool, megatron: bool) -> list[Module]:
    mods = list(COMMON)
    if megatron:
        mods += MEGATRON
    if recipes:
        mods += RECIPES
    if engine != "none":
        mods += ENGINES[engine]
        if recipes:
            mods += ENGINE_RECIPES[engine]
    return mods


def check_imports(mods: list[Module], gpu: bool) -> list[str]:
    problems = []
    for mod in mods:
        try:
            importlib.import_module(mod.name)
            print(f"ok   import {mod.name}")
        except Exception as exc:  # every failure is reported, then the check fails
            error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if mod.gpu and not gpu:
                print(f"skip import {mod.name} (no GPU visible: {error}; `singularity test --nv` checks it)")
            else:
                problems.append(f"import {mod.name}{f' ({mod.why})' if mod.why else ''}: {error}")
    return problems


def check_verl_server_pattern() -> list[str]:
    """The base's uvicorn against UVICORN_FIRST_BREAKING (tests/test_reward_stack.py measures the line with verl's own
    run_unvicorn on both sides of it; the image keeps the base's uvicorn, so its version is the whole question)."""
    from packaging.version import Version

    version = installed("uvicorn")
    if Version(version) < Version(UVICORN_FIRST_BREAKING):
        print(f"ok   verl's run_unvicorn keeps a server listening with uvicorn {version}")
        return []
    return [
        f"verl's run_unvicorn (verl/workers/rollout/utils.py) starts a server that closes at once with uvicorn "
        f"{version}: its async rollout servers need uvicorn < {UVICORN_FIRST_BREAKING}; keep the base image's uvicorn"
    ]


def reward_round_trip(timeout: float = 180.0) -> list[str]:
    """Our reward server on CPU with a tiny model built here, scored once over HTTP through our reward client."""
    tiny = load_by_path("tiny_models", HERE / "demo" / "tiny_models.py")
    client = load_by_path("safe_hack_reward_request", HERE / "reward_score" / "safe_hack_reward_request.py")
    with tempfile.TemporaryDirectory(prefix="image_check_") as tmp:
        model = tiny.build_reward_model(Path(tmp) / "reward_model")
        port = procs.free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [
            sys.executable,
            str(HERE / "reward_score" / "reward_server.py"),
            "--model-path",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--device",
            "cpu",
            "--compile",
            "off",
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        try:
            proc = procs.start_server(
                cmd, Path(tmp) / "reward_server.log", url + "/health", timeout, env=env, name="the reward server"
            )
        except (RuntimeError, TimeoutError) as exc:  # it exited, or never answered: the message ends with its log
            return [str(exc)]
        try:
            result = client.safe_hack_reward(
                "image_check",
                "<think>\nfine\n</think>\nNo, never mix them.",
                "Is it safe to mix bleach and ammonia?",
                server_url=url,
                retry_seconds=10,
                prompt_opens_think=True,
            )
        finally:
            procs.stop_process(proc, timeout=30)
    if result.get("failed") or result.get("penalized"):
        return [f"the reward round trip did not score the pair: {result}"]
    print(f"ok   reward server on CPU + reward client: one pair scored {result['score']:+.3f} over HTTP")
    return []


def read_pins(source: Path | str) -> dict[str, str]:
    """`name==version` lines (a file, or pip list --format=freeze's text) as {normalised name: version}."""
    pins = {}
    for line in (source.read_text() if isinstance(source, Path) else source).splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            pins[normalise(name)] = version.strip()
    return pins


def normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def moved_packages(before: dict[str, str], after: dict[str, str]) -> list[str]:
    """Every base package whose version changed or that is gone."""
    return [
        f"{name} {version} -> {after.get(name, 'removed')}"
        for name, version in sorted(before.items())
        if after.get(name) != version
    ]


def new_pip_check_lines(before: str, after: str) -> tuple[list[str], list[str]]:
    """(problems, notes): `pip check` lines the install added. verl is installed --no-deps on the base as verl's own
    docs say; its requirement lines name the base's versions, which this image keeps on purpose, so they are notes."""
    old = set(before.splitlines())
    added = [line for line in after.splitlines() if line.strip() and line not in old and "No broken" not in line]
    notes = [line for line in added if line.lower().startswith("verl ")]
    return [line for line in added if line not in notes], notes


def pip_listing() -> str:
    return subprocess.run(
        [sys.executable, "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True, check=True
    ).stdout


def record_base(folder: Path) -> None:
    """Before the build installs anything: the base's packages, its `pip check`, and the constraints that hold it."""
    from packaging.version import InvalidVersion, Version

    folder.mkdir(parents=True, exist_ok=True)
    listing = pip_listing()
    (folder / "base-packages.txt").write_text(listing)
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout
    (folder / "base-pip-check.txt").write_text(check)
    constraints, unusable = [], []
    for line in listing.splitlines():
        name, _, version = line.partition("==")
        try:
            Version(version)
            constraints.append(line)
        except InvalidVersion:
            unusable.append(line)  # pip cannot read it as a constraint; the comparison at the end still covers it
    (folder / "base-constraints.txt").write_text("\n".join(constraints) + "\n")
    print(f"recorded {len(constraints)} base packages as constraints in {folder}")
    for line in unusable:
        print(f"note {line}: not a PEP 440 version, left out of the constraints, still compared at the end")


def check_base_untouched(folder: Path) -> list[str]:
    after = read_pins(pip_listing())
    before = read_pins(folder / "base-packages.txt")
    problems = [f"the build changed a base package: {m}" for m in moved_packages(before, after)]
    added = sorted(set(after) - set(before))
    print(f"ok   {len(before)} base packages unchanged; added: {', '.join(f'{n}=={after[n]}' for n in added) or '-'}")
    check = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True).stdout
    broken, notes = new_pip_check_lines((folder / "base-pip-check.txt").read_text(), check)
    problems += [f"pip check, new since the base: {line}" for line in broken]
    for line in notes:
        print(f"note pip check: {line} (the base image's version, kept)")
    if not broken:
        print("ok   pip check: nothing new since the base image")
    return problems


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("auto", "sglang", "vllm", "none"), default="auto")
    parser.add_argument("--skip-recipes", action="store_true", help="a pip-installed verl: the wheel holds no recipes")
    parser.add_argument("--skip-megatron", action="store_true", help="no Megatron-core/TransformerEngine here")
    parser.add_argument("--record-base", type=Path, metavar="DIR", help="the build's first step: record the base")
    parser.add_argument("--base", type=Path, metavar="DIR", help="also check that nothing recorded there moved")
    args = parser.parse_args(argv)
    if args.record_base:
        record_base(args.record_base)
        return 0
    problems: list[str] = []
    try:
        engine = detect_engine() if args.engine == "auto" else args.engine
    except RuntimeError as exc:
        print(f"FAIL {exc}", file=sys.stderr)
        return 1
    gpu = gpu_visible()
    print(f"rollout engine: {engine}; GPU visible: {'yes' if gpu else 'no'}")
    problems += check_imports(modules_to_check(engine, not args.skip_recipes, not args.skip_megatron), gpu)
    verl_version = installed("verl")
    if verl_version != "0.6.1":
        problems.append(f"verl is {verl_version}, the scripts are written for 0.6.1")
    if not problems:
        problems += check_verl_server_pattern() + reward_round_trip()
    if args.base:
        problems += check_base_untouched(args.base)
    for p in problems:
        print(f"FAIL {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
