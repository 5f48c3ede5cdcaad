"""The trainer's imports: what the trainer command imports before it can train (the rollout engine, the entry module,
verl's agent loop, a recipe's modules, tensorboard's writer), tried in a fresh interpreter as the trainer will import
them, each failure named with its fix. The preflight starts the check alongside its other checks and says what it found
after them (launch.plan.preflight.report_imports).
"""

import subprocess
import sys
import tempfile

# What the one-step-off recipe's weight sync imports whatever the engine (recipe/one_step_off_policy/
# distributed_util.py, inside stateless_init_process_group, so importing the recipe module alone does not show it).
ONE_STEP_OFF_VLLM = ("vllm.distributed.device_communicators.pynccl", "vllm.distributed.utils")


# What verl's tensorboard logger writes with (verl/utils/tracking.py _TensorboardAdapter): it needs the tensorboard
# package, which verl's wheel depends on but the image does not install (verl_app.def installs verl --no-deps): only
# its base image can hold it.
TENSORBOARD_WRITER = "torch.utils.tensorboard"

# What async rollout imports when the trainer builds its workers (ray_trainer.py:770, init_workers): verl's agent loop,
# whose agent_loop.py:26 imports cachetools, which verl 0.6.1 does not declare (SGLang and vLLM bring it).
AGENT_LOOP = "verl.experimental.agent_loop"

# The engine a rollout name needs, where that is not a package of its own name: `hf` is verl's own HF generate, which
# only the CPU runs of make demo and the tests register (cpu/verl_shims.py; config_refusals.rollout_problems).
ENGINE_MODULES = {"hf": "verl.workers.rollout.hf_rollout"}


def trainer_modules(module: str, cfg) -> list[str]:
    """What the trainer command imports before it can train: the rollout engine, the entry module, with async rollout
    verl's agent loop, and a recipe's trainer (for one-step-off, its workers for actor.strategy). verl's own worker
    modules are the image's to check (its %test): Megatron's pull in TransformerEngine, which a login node without a
    GPU driver may not load."""
    engine = cfg.actor_rollout_ref.rollout.name
    modules = [ENGINE_MODULES.get(engine, engine), module]
    if cfg.actor_rollout_ref.rollout.mode == "async":
        modules.append(AGENT_LOOP)
    if module.startswith("recipe.one_step_off_policy."):
        package = "recipe.one_step_off_policy"
        workers = "megatron_workers" if cfg.actor_rollout_ref.actor.strategy == "megatron" else "fsdp_workers"
        modules += [f"{package}.ray_trainer", f"{package}.{workers}", f"{package}.distributed_util", *ONE_STEP_OFF_VLLM]
    elif module.startswith("recipe.dapo."):
        modules += ["recipe.dapo.dapo_ray_trainer"]
    logger = cfg.trainer.logger
    if "tensorboard" in ([logger] if isinstance(logger, str) else list(logger)):
        modules.append(TENSORBOARD_WRITER)
    return modules


_IMPORT_EACH = """
import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        print(name, f"{type(exc).__name__}: {exc}".replace("\\n", " ")[:300], sep="\\t", flush=True)
"""


def start_import_check(modules: list[str]) -> subprocess.Popen:
    """Import each module in a fresh interpreter, as the trainer will (this one has already imported verl, and an
    engine's import may set process-wide state), in the background: import_problems collects it. Its output goes to
    files, never an undrained pipe."""
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        [sys.executable, "-c", _IMPORT_EACH, *modules], stdout=out, stderr=err, start_new_session=True
    )
    proc.output_files = (out, err)
    return proc


def import_problems(
    modules: list[str], engine: str, timeout: float = 600, started: subprocess.Popen | None = None
) -> list[str]:
    """One line per module that fails to import in a fresh interpreter (start_import_check's, `started` where it is
    already running), naming it and the fix."""
    run = started or start_import_check(modules)
    try:
        run.wait(timeout)
    except subprocess.TimeoutExpired:
        run.kill()
        run.wait()
        return [f"importing {', '.join(modules)} took over {timeout:.0f} s"]
    for file in run.output_files:
        file.seek(0)
    stdout, stderr = (file.read() for file in run.output_files)
    if run.returncode:
        return [f"importing {', '.join(modules)} crashed the interpreter (exit {run.returncode}): {stderr[-500:]}"]
    problems = []
    for line in stdout.splitlines():
        name, _, error = line.partition("\t")
        if name.split(".")[0] == engine or name.startswith("vllm."):
            fix = (
                f"ROLLOUT_ENGINE={engine} needs {engine} where the trainer runs: use the {engine} image "
                f"(CONFIG_IMAGE_PATH), or the engine that image has"
            )
        elif name.startswith("recipe."):
            fix = "verl's recipes come from its git tag (the image built from verl_app.def has them; PyPI has none)"
        elif name == AGENT_LOOP:
            fix = (
                "ROLLOUT_MODE=async runs verl's agent loop, which imports cachetools (undeclared by verl 0.6.1; the "
                "SGLang and vLLM images hold it): install it there, or ROLLOUT_MODE=sync"
            )
        elif name == TENSORBOARD_WRITER:
            fix = "TRAINER_LOGGER has tensorboard, which needs the tensorboard package there: drop it from it"
        else:
            fix = "the trainer's own imports: the image (or local environment) is incomplete"
        problems.append(f"import {name} fails ({error}): {fix}")
    return problems
