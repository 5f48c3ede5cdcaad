"""Each setting is written once: a line in the run script's settings block, which exports it, and a field in
launch.plan.settings that reads that same name with no default of its own."""

import os
import re
from dataclasses import MISSING, fields

import pytest

from launch.plan.refusals import header_problems
from launch.plan.settings import SettingError, Settings
from launch.plan.trainer_command import FIXED_OVERRIDES, HOOK_KEY, PREEMPT_HOOK, USER_HOOK, trainer_argv
from tests.support import REPO, block_environment

RUN_SCRIPT = REPO / "run_grpo_qwen3_4b_mega_verl.sh"


def block_names() -> list[str]:
    block = RUN_SCRIPT.read_text().split("# ---- settings", 1)[1].split("\n# ------------", 1)[0]
    return re.findall(r'^([A-Z][A-Z0-9_]*)="\$\{\1:-', block, flags=re.M)


def test_every_setting_in_the_block_is_exported_by_the_block_itself():
    names, env = block_names(), block_environment()
    assert len(names) > 40
    assert [n for n in names if n not in env] == []


def test_python_reads_only_names_the_block_sets_and_invents_no_defaults():
    read = {f.metadata["env"]: f for f in fields(Settings) if "env" in f.metadata}
    assert set(read) <= set(block_names()), set(read) - set(block_names())
    assert all(f.default is MISSING and f.default_factory is MISSING for f in read.values())
    settings = Settings.from_env(block_environment())
    assert settings.train_batch_size == 256 and settings.separate_reward_node is False


def test_a_missing_or_malformed_setting_names_itself():
    env = block_environment()
    with pytest.raises(SettingError, match="TRAIN_BATCH_SIZE not set"):
        Settings.from_env({k: v for k, v in env.items() if k != "TRAIN_BATCH_SIZE"})
    with pytest.raises(SettingError, match="ACTOR_LR='fast' is not a number"):
        Settings.from_env(env | {"ACTOR_LR": "fast"})
    with pytest.raises(SettingError, match="VAL_DO_SAMPLE='maybe': use true or false"):
        Settings.from_env(env | {"VAL_DO_SAMPLE": "maybe"})
    with pytest.raises(SettingError, match="MICRO_BATCH_PER_GPU='2.5': use auto or a whole number"):
        Settings.from_env(env | {"MICRO_BATCH_PER_GPU": "2.5"})


@pytest.mark.parametrize("name, other", [("STALL_REQUEUE", "true"), ("CONFIG_USE_SEPARATE_REWARD_NODE", "1")])
def test_a_flag_the_job_scripts_compare_takes_only_their_spelling(name, other):
    """bash reads these as `== 1` and `== true`: another word the preflight took as true would be false in the job."""
    spelled = next(f.metadata["spelled"] for f in fields(Settings) if f.metadata.get("env") == name)
    scripts = "".join((REPO / f).read_text() for f in ("run_grpo_qwen3_4b_mega_verl.sh", "helper_grpo_qwen3_4b.sh"))
    assert re.search(rf'"\$\{{?{name}\}}?" == {spelled[0]}\b', scripts), (name, spelled)
    env = block_environment()
    assert Settings.from_env(env | {name: spelled[0]}) != Settings.from_env(env | {name: spelled[1]})
    with pytest.raises(SettingError, match=f"{name}='{other}': use {spelled[0]} or {spelled[1]}"):
        Settings.from_env(env | {name: other})


@pytest.mark.parametrize("algorithm, strategy", [("grpo", "megatron"), ("ppo", "fsdp2"), ("dapo", "megatron")])
def test_the_fixed_trainer_keys_are_in_every_command_and_no_key_is_set_twice(algorithm, strategy):
    # REWARD_PROMPT_OPENS_THINK=auto would read the default policy's template, which is not here
    env = block_environment() | {"ALGORITHM": algorithm, "STRATEGY": strategy, "REWARD_PROMPT_OPENS_THINK": "true"}
    argv = trainer_argv(Settings.from_env(env))
    assert all(fixed in argv for fixed in FIXED_OVERRIDES)
    keys = [a.split("=", 1)[0].lstrip("+") for a in argv if "=" in a and not a.startswith("--")]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)


def test_a_users_own_ray_hook_is_chained_behind_the_jobs_never_dropped():
    """The job's hook (the save on preemption) runs the user's first (launch/job/preempt.py install): a user's hook
    used to replace it, and with it every save on preemption."""
    env = block_environment() | {"REWARD_PROMPT_OPENS_THINK": "true"}
    theirs = "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=my_site.setup"
    argv = trainer_argv(Settings.from_env(env), extra=[theirs, "trainer.total_epochs=2"])
    assert theirs not in argv and argv[-1] == "trainer.total_epochs=2", "the user's other overrides stay last"
    assert f"+{HOOK_KEY}={PREEMPT_HOOK}" in argv
    assert f"+ray_kwargs.ray_init.runtime_env.env_vars.{USER_HOOK}=my_site.setup" in argv


def test_save_freq_auto_is_the_default_and_outside_a_preemptible_partition_todays_25():
    env = block_environment() | {"REWARD_PROMPT_OPENS_THINK": "true"}
    assert env["SAVE_FREQ"] == "auto"
    assert "trainer.save_freq=25" in trainer_argv(Settings.from_env(env))


@pytest.mark.parametrize(
    "setting, resuming, validates",
    [
        ("auto", False, True),  # a first start validates the model it starts from, as verl does by default
        ("auto", True, False),  # a requeued start resumes a checkpoint: straight to training (issue #58)
        ("true", True, True),
        ("false", False, False),
    ],
)
def test_a_start_that_resumes_a_checkpoint_skips_verls_validation_before_training(
    tmp_path, setting, resuming, validates
):
    if resuming:
        (tmp_path / "latest_checkpointed_iteration.txt").write_text("25")  # what verl's resume_mode=auto reads
    env = block_environment() | {
        "CONFIG_OUTPUT_DIR": str(tmp_path),
        "VAL_BEFORE_TRAIN": setting,
        "REWARD_PROMPT_OPENS_THINK": "true",
    }
    assert f"trainer.val_before_train={validates}" in trainer_argv(Settings.from_env(env))


def test_a_val_before_train_setting_of_neither_value_is_refused_naming_it():
    from launch.plan.refusals import combination_problems

    env = block_environment() | {"VAL_BEFORE_TRAIN": "yes", "REWARD_PROMPT_OPENS_THINK": "true"}
    assert combination_problems(Settings.from_env(env)) == ["VAL_BEFORE_TRAIN='yes': use one of auto, true, false"]


PHASES = ("plan", "job", "watch")  # launch/__init__.py: each imports only the ones before it; merge imports none


def launch_imports() -> dict[str, set[str]]:
    """{module: the launch modules it imports}, as `phase.module`, for every module of launch/, imports inside
    functions included (a lazy import is still a dependency: it only hides a circle until the function runs); those
    under `if TYPE_CHECKING:` are for annotations only and never run."""
    import ast

    graph = {}
    for path in sorted((REPO / "launch").glob("*/*.py")):
        tree, found = ast.parse(path.read_text()), set()
        typing_only = {
            id(n)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and ast.unparse(block.test) == "TYPE_CHECKING"
            for n in ast.walk(block)
        }
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                found |= {".".join(a.name.split(".")[1:3]) for a in node.names if a.name.startswith("launch.")}
            elif (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").count(".") == 1
                and node.module.startswith("launch.")
            ):
                found |= {f"{node.module.split('.')[1]}.{a.name}" for a in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("launch."):
                found.add(".".join(node.module.split(".")[1:3]))
        module = f"{path.parent.name}.{path.stem}"
        graph[module] = found - {module} - {f"{path.parent.name}.__init__"}
    return graph


def test_launch_modules_import_each_other_in_one_direction():
    graph = launch_imports()
    assert graph and all(m.split(".")[0] in (*PHASES, "merge") for m in graph), sorted(graph)
    done: list[str] = []

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, f"an import circle: {' -> '.join((*path, module))}"
        if module not in done:
            for dependency in sorted(graph.get(module, ())):
                visit(dependency, (*path, module))
            done.append(module)

    for module in graph:
        visit(module, ())
    # the order launch/plan/settings.py's docstring names: the time-limit maths and the settings at the bottom, the
    # trainer command over both, the refusals over it
    assert graph["plan.deadline"] == set() and graph["plan.settings"] == set()
    for bottom in ("plan.deadline", "plan.settings"):
        assert (
            done.index(bottom)
            < done.index("plan.trainer_command")
            < done.index("plan.refusals")
            < done.index("plan.preflight")
        )
    assert done.index("plan.config_refusals") < done.index("plan.preflight")
    assert done.index("plan.reward_check") < done.index("plan.preflight")


def test_launchs_phases_import_only_the_phases_before_them():
    """The plan made before the queue imports no code of the job's run time, which imports none of the watching; the
    merge's checks import none of the phases (launch/__init__.py), only each other."""
    for module, dependencies in launch_imports().items():
        phase = module.split(".")[0]
        allowed = {"merge"} if phase == "merge" else set(PHASES[: PHASES.index(phase) + 1])
        wrong = sorted(d for d in dependencies if d.split(".")[0] not in allowed)
        assert not wrong, f"launch/{module.replace('.', '/')}.py imports {wrong}: move the shared code down a phase"


RUN_TEXT = (REPO / "run_grpo_qwen3_4b_mega_verl.sh").read_text()


@pytest.mark.parametrize(
    "block, header, env, refused",
    [
        ("8", "4", "8", True),  # the block edited, the header not: the case
        ("4", "8", "4", True),  # the header edited, the block not
        ("8", "h100:8", "8", False),  # a typed GPU count agrees
        (
            "4",
            "4",
            "1",
            False,
        ),  # a value from the environment (the tests', sbatch --gpus-per-node with it) is the user's
        ("8", "8", "8", False),
    ],
)
def test_the_login_node_check_holds_the_headers_gpus_per_node_against_the_blocks_setting(block, header, env, refused):
    text = RUN_TEXT.replace('CONFIG_GPUS_PER_NODE:-4}"', f'CONFIG_GPUS_PER_NODE:-{block}}}"').replace(
        "#SBATCH --gpus-per-node=4", f"#SBATCH --gpus-per-node={header}"
    )
    line = next(n for n, x in enumerate(text.splitlines(), 1) if x.startswith("#SBATCH --gpus-per-node="))
    problems = header_problems(text, {"CONFIG_GPUS_PER_NODE": env})
    assert problems == (
        [
            f"CONFIG_GPUS_PER_NODE={env}, but line {line} of run_grpo_qwen3_4b_mega_verl.sh, #SBATCH "
            f"--gpus-per-node={header}, gives each node {header}: change line {line} to #SBATCH "
            f"--gpus-per-node={env} (or CONFIG_GPUS_PER_NODE to {header}); the job would be refused "
            "only after its wait in the queue"
        ]
        if refused
        else []
    )
    assert header_problems(RUN_TEXT, {"CONFIG_GPUS_PER_NODE": "4"}) == [], "the script as shipped agrees with itself"


def login_environment(monkeypatch, env: dict) -> None:
    """The environment of a login node's check: no SLURM_*, and CONFIG_NUM_NODES unset but restored afterwards (the
    check sets it from the header in os.environ)."""
    for key in [k for k in os.environ if k.startswith("SLURM_")]:  # a test run inside an allocation is no job
        monkeypatch.delenv(key)
    monkeypatch.setenv("CONFIG_NUM_NODES", "")
    monkeypatch.delenv("CONFIG_NUM_NODES")
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_the_preflight_on_a_login_node_refuses_a_header_that_disagrees_with_the_block(tmp_path, monkeypatch, capsys):
    """PREFLIGHT_ONLY=1 outside a job runs the check, before anything else; inside a job Slurm's count is checked."""
    from launch.plan import preflight

    (tmp_path / "run_grpo_qwen3_4b_mega_verl.sh").write_text(
        RUN_TEXT.replace('CONFIG_GPUS_PER_NODE:-4}"', 'CONFIG_GPUS_PER_NODE:-8}"')
    )
    monkeypatch.setattr(preflight, "REPO", tmp_path)
    env = block_environment() | {"CONFIG_GPUS_PER_NODE": "8", "PREFLIGHT_ONLY": "1", "PREFLIGHT_REWARD": "0"}
    login_environment(monkeypatch, env)
    assert preflight.main([]) == 1
    assert (
        "setting error: CONFIG_GPUS_PER_NODE=8, but line 7 of run_grpo_qwen3_4b_mega_verl.sh" in capsys.readouterr().err
    )


@pytest.mark.parametrize("nodes, refused", [("1", True), ("2", False)])
def test_the_login_node_check_plans_for_the_nodes_the_header_asks_for(tmp_path, monkeypatch, capsys, nodes, refused):
    """A separate reward node needs 2 nodes: outside a job the check reads them from #SBATCH --nodes, not 1."""
    from launch.plan import preflight

    text = RUN_TEXT.replace("#SBATCH --nodes=1", f"#SBATCH --nodes={nodes}")
    (tmp_path / "run_grpo_qwen3_4b_mega_verl.sh").write_text(text)
    monkeypatch.setattr(preflight, "REPO", tmp_path)
    env = block_environment() | {"CONFIG_USE_SEPARATE_REWARD_NODE": "true", "PREFLIGHT_ONLY": "1"}
    login_environment(monkeypatch, env)
    assert preflight.main([]) == 1  # the block's model and data paths are not here
    err = capsys.readouterr().err
    assert ("needs at least 2 nodes (the last one runs only reward servers); this job has 1" in err) == refused, err
