"""`make demo` (demo/run.py): verl 0.6.1's own trainer on the CPU through the real run script, as the canary runs it,
and the CPU adaptations it needs (cpu/verl_shims.py, cpu/megatron_shims.py).

Nothing here is a stand-in: the run script, the preflight, reward servers on the CPU, Ray, `python -m
verl.trainer.main_ppo` (RayPPOTrainer.fit with verl's Megatron workers and its HF rollout), verl's checkpoint manager,
its Megatron merger and launch.merge.verify_hf are the real ones; what verl needs on a CPU is the two modules' overrides
and shims."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cpu import verl_shims
from demo.run import CLIP_NOTE, LOGIN_NODE_CHECK, NEXT_STEPS, shown
from launch.plan.config_refusals import rollout_problems
from launch.plan.preflight import compose, split_command, validate
from launch.plan.settings import Settings
from launch.plan.trainer_command import USER_HOOK, trainer_argv
from tests.support import AGENT_LOOP_TIMING, REPO, SHIM_OUTCOME, block_environment
from tests.test_quickstart import quickstart_lines

STEP_LINE = re.compile(r"\(TaskRunner pid=\d+\)\S* step:(\d+) - (.*)$", re.M)


def metric(line: str, name: str) -> float:
    return float(re.search(rf"(?:^| - ){re.escape(name)}:([-\d.e]+)", line).group(1))


def steps(log: Path) -> dict[int, str]:
    """{step: the rest of its line} for every training step verl's console logger printed (validation-only lines,
    step:0 before training, have no timing_s/step)."""
    return {int(n): rest for n, rest in STEP_LINE.findall(log.read_text()) if "timing_s/step:" in rest}


def test_the_demos_next_steps_are_the_readmes_quickstart_commands():
    assert NEXT_STEPS == quickstart_lines()
    for readme in ("README.md", "README.ja.md"):  # and its last line, the login node's check, is the README's step 4
        assert "`make env`" in (REPO / readme).read_text() and LOGIN_NODE_CHECK in (REPO / readme).read_text(), readme


def test_make_env_says_what_it_installs_and_shows_pips_own_progress():
    """A first `make demo` installs for minutes (3.5 min of silent `pip --quiet` on a loaded machine): each install is
    announced, and pip's Collecting/Downloading/Installing lines show."""
    dry = subprocess.run(
        ["make", "-n", "-B", "env", "VENV=.venv-dry-run"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    pips = [i for i, line in enumerate(dry) if "/pip install" in line]
    first = [i for i in pips if "trying once more" not in dry[i - 1]]  # the requirements' install, tried again once
    assert len(first) == 2 and len(pips) == 3, dry
    for i in pips:
        assert "--quiet" not in dry[i] and " -q " not in dry[i], dry[i]
    for i in first:
        assert dry[i - 1].startswith('echo "make: ') and "installing" in dry[i - 1], dry[i - 1]


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_cpu_overrides_compose_with_the_fsdp2_command_and_hf_is_refused_without_the_hook(mode):
    env = block_environment() | dict(
        CONTAINER="none",
        CONFIG_MODEL_PATH="m",
        CONFIG_REWARD_MODEL_PATH="r",
        CONFIG_TRAIN_FILE="train.parquet",
        CONFIG_TEST_FILE="test.parquet",
        CONFIG_OUTPUT_DIR="ckpt",
        STRATEGY="fsdp2",
        ROLLOUT_MODE=mode,
        REWARD_PROMPT_OPENS_THINK="true",  # no model at "m" to read a chat template from
    )
    module, path, name, overrides = split_command(trainer_argv(Settings.from_env(env), extra=verl_shims.overrides()))
    cfg = compose(name, overrides, path)
    validate(cfg)
    assert cfg.actor_rollout_ref.rollout.name == "hf" and not cfg.actor_rollout_ref.model.use_remove_padding
    assert cfg.actor_rollout_ref.rollout.mode == mode
    assert cfg.trainer.device == "cuda", "verl's placement asks Ray for the GPUs it was told of, not for 'cpu'"
    assert rollout_problems(cfg) == []
    without_hook = [o for o in overrides if "worker_process_setup_hook" not in o and USER_HOOK not in o]
    (problem,) = rollout_problems(compose(name, without_hook, path))
    assert "actor_rollout_ref.rollout.name=hf: verl 0.6.1 registers no such engine" in problem


def test_make_demo_trains_verls_megatron_workers_on_the_cpu_saves_resumes_and_merges(tmp_path):
    """The settings block's default strategy, Megatron: two GRPO steps from scratch with a save after each, a second
    launch resuming verl's Megatron checkpoint at step 2 for step 3, then verl's Megatron merger on what it saved:
    verl's own console lines, checkpoints and merger, checked by the canary as on a cluster, and here again from
    verl's output."""
    out = tmp_path / "demo"
    run = subprocess.run(
        [sys.executable, "-m", "demo.run", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=900
    )
    text = run.stdout + run.stderr
    assert run.returncode == 0, text[-6000:]
    assert "canary: every stage passed" in text and "make demo: every stage passed" in text
    (canary,) = (out / "logs").glob("*/canary")
    trained, resumed = steps(canary / "train" / "trainer.log"), steps(canary / "resume" / "trainer.log")
    assert sorted(trained) == [1, 2] and sorted(resumed) == [3], (sorted(trained), sorted(resumed))
    # A real update: GRPO advantages from scores that differ within a group, and a gradient.
    assert max(metric(trained[n], "critic/advantages/max") for n in trained) > 0
    assert max(metric(line, "actor/grad_norm") for line in (*trained.values(), *resumed.values())) > 0
    assert "val-core/" in trained[2], "validation ran at the last step of stage 1"
    # the settings block's default async rollout: verl's agent loop generated every step, through the HF engine
    command = (canary / "train" / "trainer_command.txt").read_text().splitlines()
    assert "actor_rollout_ref.rollout.mode=async" in command and "actor_rollout_ref.rollout.name=hf" in command
    for line in (*trained.values(), *resumed.values()):
        assert AGENT_LOOP_TIMING in line, line
    resume_log = (canary / "resume" / "trainer.log").read_text()
    assert "Training from scratch" in (canary / "train" / "trainer.log").read_text()
    assert "Setting global step to 2" in resume_log and "Training from scratch" not in resume_log
    (root,) = (out / "checkpoints_canary").iterdir()
    assert "ppo_megatron_trainer" in " ".join(command) and "cpu.megatron_shims.install" in " ".join(command)
    for step in (1, 2, 3):  # verl's Megatron checkpoint manager's files: megatron-core's dist checkpoint
        actor = root / "checkpoints" / f"global_step_{step}" / "actor"
        assert (actor / "dist_ckpt" / "metadata.json").is_file() and (actor / "transformer_config.json").is_file()
        assert not (actor / "fsdp_config.json").exists()
    assert (root / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    merge_log = (canary / "merge.log").read_text()
    assert "-m verl.model_merger merge --backend megatron" in merge_log and "verified " in merge_log
    assert (root / "hf_model" / "config.json").is_file() and (root / "hf_model" / "model.safetensors").is_file()
    # issue 57: the merge's numeric check against verl's own dist_ckpt and merger, printed; ACTOR_LR moves the weights
    # enough that step 1's checkpoint is told apart from step 3's merge by the same check
    assert "numeric check passed: max |d log-prob|" in merge_log and "tolerance fp32" in merge_log
    assert "make demo: the merge's numeric check passed: max |d log-prob|" in run.stdout
    assert "make demo: step 1's checkpoint against that merge: max |d log-prob|" in run.stdout
    assert ": told apart" in run.stdout and not (root / "hf_model" / "UNVERIFIED.txt").exists()
    # issue 44: the run's name, Ray's GPUs on a machine without one, the clip-ratio warning a random policy trips
    assert "tiny_demo_grpo_megatron_canary" in run.stdout and "qwen3_4b_grpo_megatron" not in run.stdout
    assert "GPUs (placeholders: no GPU here, torch computes on the CPU)" in run.stdout
    assert ("hit MAX_RESPONSE_LENGTH" in run.stdout) == (CLIP_NOTE.format(length=32) in run.stdout), "said iff warned"
    # issue 60: quiet by default, the whole output in the log it names at the end
    whole = (out / "demo.log").read_text()
    assert f"the whole output: {out / 'demo.log'}" in run.stdout and "'experiment_name'" in whole, "verl's config dump"
    assert len(run.stdout.splitlines()) < 120 < len(whole.splitlines()), len(run.stdout.splitlines())
    assert all(f"step:{n} - " in run.stdout for n in (1, 2, 3)) and "=== canary: stage merge" in run.stdout
    hints, login = run.stdout.split("next, on a cluster", 1)[1].split("your own files on a login node", 1)
    assert [line.strip() for line in hints.splitlines()[1:]] == quickstart_lines(), "the README's quickstart"
    assert [line.strip() for line in login.splitlines()[1:]] == ["make env", LOGIN_NODE_CHECK], "and then its check"


@pytest.mark.parametrize(
    "line, is_shown",
    [
        ("[2026-12-05 16:15:27] === checks: settings, files (+1s)\n", True),  # a phase of the scripts
        ("[2026-12-05 16:16:01] ERROR: the preflight failed\n", True),
        (
            "\x1b[36m(TaskRunner pid=9894)\x1b[0m step:1 - actor/entropy:3.8 - critic/score/mean:0.1\n",
            True,
        ),  # verl's step
        ("preflight: WARNING: steps: verl will train only 1 step\n", True),
        ("canary summary\n", True),
        ("1 train 2 steps, save each                 passed     109 s\n", True),  # the canary's table
        ("WARNING: 75% of responses hit MAX_RESPONSE_LENGTH=32\n", True),
        ("\x1b[36m(TaskRunner pid=9894)\x1b[0m              'experiment_name': 'x',\n", False),  # verl's config dump
        ("WARNING:2026-12-05 16:19:49,591:CPU RNG state changed within GPU RNG context\n", False),  # a library's
        ("preflight: data train: 70 rows\n", False),
        ("\x1b[36m(TaskRunner pid=1)\x1b[0m bind role actor_rollout method wake_up to class <class 'W'>\n", False),
    ],
)
def test_make_demo_shows_the_phases_verls_steps_and_the_warnings_that_matter(line, is_shown):
    assert shown(line) is is_shown


SHIMS_CHECK = (
    SHIM_OUTCOME
    + r"""
import sys, torch, torch.distributed as dist
from cpu import verl_shims

def verl_calls(address):
    from verl.utils.device import get_torch_device
    from verl.utils.profiler.performance import topk_reduce_ratio_min_max
    from verl.workers.rollout.base import get_rollout_class
    yield outcome("rollout", lambda: get_rollout_class("hf", "sync"))
    yield outcome("backend", lambda: dist.init_process_group("cpu:gloo,cpu:nccl", init_method=address, rank=0,
                                                             world_size=1))
    if not dist.is_initialized():  # a plain gloo group, for the next check
        dist.init_process_group("gloo", init_method=address, rank=0, world_size=1)
    yield outcome("gather", lambda: topk_reduce_ratio_min_max(1.5))
    dist.destroy_process_group()
    device = get_torch_device()
    yield outcome("device", lambda: (device.empty_cache(), device.set_rng_state(device.get_rng_state()),
                                     device.memory_reserved(), device.max_memory_allocated()))

print("before", *verl_calls(sys.argv[1]), sep="|")
verl_shims.install()
from verl.utils.fsdp_utils import CPUOffloadPolicy
from verl.workers.rollout.replica import get_rollout_replica_class
from verl.workers.fsdp_workers import ActorRolloutRefWorker
print("after", *verl_calls(sys.argv[2]), f"pinned: {CPUOffloadPolicy(pin_memory=True).pin_memory}",
      f"replica: {get_rollout_replica_class('hf').__name__}",
      f"then: {ActorRolloutRefWorker.update_actor.__code__.co_filename.rsplit('/', 1)[-1]}", sep="|")
"""
)


def test_without_the_shims_verl_stops_where_they_say_and_with_them_it_goes_on(tmp_path):
    """Each shim of cpu/verl_shims.py on its own, in a fresh interpreter (as a Ray worker gets them): the verl call it
    names fails before install() and works after; then the hook a run names in CPU_RUN_THEN_HOOK (the stall test's,
    which wraps verl's update_actor)."""
    from tests import stall_hook
    from tests.support import free_port

    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    env = os.environ | {verl_shims.THEN_HOOK: stall_hook.HOOK, "STALL_TEST_PLAN": "update_actor:sleep=1:1"}
    run = subprocess.run(
        [sys.executable, "-c", SHIMS_CHECK, *addresses], cwd=REPO, capture_output=True, text=True, env=env, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    before, after = (line.split("|")[1:] for line in run.stdout.splitlines() if line.startswith(("before", "after")))
    assert before == [
        "rollout: AssertionError",
        "backend: ValueError",
        "gather: RuntimeError",
        "device: AttributeError",
    ]
    assert after == [
        "rollout: ok",
        "backend: ok",
        "gather: ok",
        "device: ok",
        "pinned: False",
        "replica: HFReplica",
        "then: stall_hook.py",
    ]
