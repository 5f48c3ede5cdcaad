"""Fixtures every test can use: isolated caches, tiny models, the fake cluster, short Ray temp dirs."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import real_slurm
from tests.support import REPO, RUN, FakeContainer, pinned_port, stop_ray


@pytest.fixture(autouse=True)
def isolated_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point every HOME-side cache at the test's tmp dir, so tests leave nothing behind and see no stale state."""
    home = tmp_path / "home"
    home.mkdir()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    settings = {
        "HOME": home,
        "TMPDIR": tmp,
        "XDG_CACHE_HOME": home / ".cache",
        "HF_HOME": home / ".cache" / "huggingface",
        "HF_DATASETS_CACHE": home / ".cache" / "huggingface" / "datasets",
        "WANDB_DIR": tmp_path / "wandb",
        "WANDB_MODE": "offline",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "TOKENIZERS_PARALLELISM": "false",
    }
    for key, value in settings.items():
        monkeypatch.setenv(key, str(value))
    # Ray's session dirs must stay short (unix socket paths are limited to 107 bytes): see `ray_tmp`.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    return tmp_path


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """A tiny reward model and policy built from configs once per session (nothing downloaded)."""
    from demo.tiny_models import build_policy_model, build_reward_model

    root = tmp_path_factory.mktemp("tiny_models")
    return SimpleNamespace(
        reward_model=build_reward_model(root / "reward_model"),
        policy=build_policy_model(root / "policy"),
    )


@pytest.fixture(scope="session")
def instruct_policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny policy with an Instruct-style chat template: its generation prompt opens no `<think>`."""
    from demo.tiny_models import INSTRUCT_POLICY_CHAT_TEMPLATE, build_policy_model

    return build_policy_model(
        tmp_path_factory.mktemp("instruct_policy") / "policy", chat_template=INSTRUCT_POLICY_CHAT_TEMPLATE
    )


@pytest.fixture
def fake_container(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeContainer:
    """Fake singularity/apptainer first on PATH; `fake_container.calls("singularity")` returns their calls."""
    cluster = FakeContainer(bin_dir=tmp_path / "fakebin", log=tmp_path / "fake_container.jsonl").install()
    monkeypatch.setenv("PATH", f"{cluster.bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_CLUSTER_LOG", str(cluster.log))
    return cluster


@pytest.fixture
def ray_tmp(monkeypatch: pytest.MonkeyPatch):
    """A short per-test Ray temp dir (/tmp/rayXXXX): pytest's tmp paths overflow Ray's socket path limit."""
    path = Path(tempfile.mkdtemp(prefix="ray", dir="/tmp"))
    monkeypatch.setenv("RAY_TMPDIR", str(path))
    yield path
    stop_ray(path)
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    from demo.data import write_demo

    return write_demo(tmp_path_factory.mktemp("data"), n=40)


@pytest.fixture
def job(tmp_path, tiny_models, demo_data, fake_container):
    """Environment for one job of the launch tests (tests.support.run): tiny models, demo data, free ports, the fake
    trainer, fake cluster programs."""
    trainer = tmp_path / "fakebin" / "fake-trainer"
    trainer.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{REPO / "tests" / "fakes" / "fake_trainer.py"}" "$@"\n')
    trainer.chmod(0o755)
    image = tmp_path / "verl_app.sif"
    image.write_text("fake image")
    ray_tmp = Path(tempfile.mkdtemp(prefix="rayj", dir="/tmp"))
    ports = pinned_port(4)  # the reward servers
    env = dict(
        os.environ,
        PATH=f"{fake_container.bin_dir}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        CONTAINER="singularity",
        CONFIG_IMAGE_PATH=str(image),
        CONFIG_MODEL_PATH=str(tiny_models.policy),
        CONFIG_REWARD_MODEL_PATH=str(tiny_models.reward_model),
        CONFIG_TRAIN_FILE=str(demo_data / "train.parquet"),
        CONFIG_TEST_FILE=str(demo_data / "test.parquet"),
        CONFIG_OUTPUT_DIR=str(tmp_path / "ckpt"),
        CONFIG_LOG_DIR=str(tmp_path / "logs"),
        CONFIG_REWARD_DEVICE="cpu",
        CONFIG_GPUS_PER_NODE="1",
        ACTOR_PP="1",
        CONFIG_NETWORK_INTERFACE="lo",
        CONFIG_REWARD_SERVER_PORT=str(ports),
        RAY_TMP_DIR=str(ray_tmp),
        RAY_NUM_CPUS="1",
        STOP_TIMEOUT="20",
        TRAINER_LAUNCHER=str(trainer),
        TRAINER_IS_VERL="0",  # the fake trainer is no verl: the preflight skips verl's imports, says so
        FAKE_TRAINER_LOG=str(tmp_path / "trainer_seen.jsonl"),
    )
    for key in [k for k in env if k.startswith("SLURM_")]:  # a test run inside an allocation is not a job's step
        del env[key]
    yield env
    stop_ray(ray_tmp)  # what a job left behind (each test asserts there is nothing), then its files
    shutil.rmtree(ray_tmp, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster() -> str:
    """The local Slurm cluster (tests/slurm/local_slurm.sh), started if it is not running; every test that needs it
    fails with the reason when it cannot run here, never skips."""
    try:
        return real_slurm.cluster()
    except RuntimeError as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def clone(tmp_path_factory, slurm_cluster) -> Path:
    """What a user's fresh clone holds (tracked and unignored files, no logs/ output, no .venv): the folder the launch
    tests submit from, as a user submits from the repository root."""
    return real_slurm.copy_tree(REPO, tmp_path_factory.mktemp("clone"))


@pytest.fixture
def submit(clone):
    """`submit(env, *hydra_args, script=..., options=..., out=..., cwd=...)`: sbatch a script from the clone (by
    default the run script, with the test node sizes on the command line); every job still queued or running is
    cancelled, and waited for, after the test."""
    jobs: list[real_slurm.Job] = []

    def submit(env, *args, script=RUN.name, options=real_slurm.NODE_SIZE, out=None, cwd=None) -> real_slurm.Job:
        job = real_slurm.sbatch(env, script, *args, cwd=cwd or clone, options=options, out=out)
        jobs.append(job)
        return job

    yield submit
    real_slurm.cancel_all(jobs)


# The suite's longest tests (each a launch of verl's trainer or a job that waits minutes: 2-15 min on 2 cores), started
# first, in this order. The Makefile runs xdist with --maxschedchunk 1, and xdist keeps every worker one test ahead:
# the test after the one it starts is already its own, started only when that one ends. So each long test here is
# followed by a short one (`pytest_collection_modifyitems`): the test a worker waits behind while a long one runs is a
# short one, and the next long test goes to the first worker that is free (in the plain order the second longest sat
# behind the longest on one worker, and the two ran one after the other). xdist's default hands each worker a quarter
# of its share at once, in one piece: every test below went to the first worker (41 of its minutes).
# By the slow tier's --durations (2026-12-07, 2 cores shared with other suites: see docs/development.md).
LONGEST_FIRST = (
    "tests/test_quickstart.py::",
    "tests/test_slurm_jobs.py::test_a_worker_hung_in_a_phase",
    "tests/test_slurm_jobs.py::test_a_preempted_job_saves_the_step_it_is_in",
    "tests/test_demo.py::test_make_demo_trains_",
    "tests/test_slurm_jobs.py::test_ppo_with_two_pipeline_stages",
    "tests/test_slurm_jobs.py::test_verl_saves_before_the_time_limit",
    "tests/test_status.py::test_a_requeued_job_shows_where_it_resumes",
    "tests/test_canary.py::test_canary_1_sbatch_on_two_nodes",
    "tests/test_canary.py::test_the_canary_trains_resumes_and_merges",
    "tests/test_slurm_jobs.py::test_a_worker_that_never_joins",
    "tests/test_canary.py::test_a_merged_model_that_fails_verification",
    "tests/test_canary.py::test_a_trainer_that_does_not_resume",
    "tests/test_megatron_cpu.py::test_fused_log_probs_reach_the_actor",
    "tests/test_check_numeric.py::test_every_dense_family",  # 1.5-3 min a case: verl's save, then the merge
    "tests/test_launch.py::test_a_policy_whose_template_opens_no_think_block",
    "tests/test_canary.py::test_the_canary_passes_whatever_the_entry_point_logs",
    "tests/test_slurm_jobs.py::test_two_jobs_on_one_node_at_once",
    "tests/test_gpu_job.py::test_the_job_takes_real_grpo_steps",
    "tests/test_megatron_memory.py::test_the_plan_benchmark_runs",
    "tests/test_run_time.py::test_two_sync_rollout_jobs_on_one_node",
    "tests/test_merge.py::test_an_fsdp2_critic_merges",
)


def _longest_first(item) -> int:
    return next((i for i, prefix in enumerate(LONGEST_FIRST) if item.nodeid.startswith(prefix)), len(LONGEST_FIRST))


# `make test-fast` runs what is left without the `slow` marker; the tests below get it here rather than by hand. A test
# is slow when it takes a fixture that starts a job, a Slurm cluster, Ray or verl's workers (megatron_merges: their
# saves and merges); lives in a module whose tests launch a trainer, a job, a benchmark or the merge script; or took
# over 5 s in the unit tier's run (`--durations`, 2026-12-05: a preflight, an import check in a scratch environment, a
# server's start, a client's retry budget).
SLOW_FIXTURES = {"submit", "clone", "slurm_cluster", "job", "ray_tmp", "megatron_merges"}
SLOW_MODULES = {
    "test_canary.py",
    "test_demo.py",
    "test_quickstart.py",
    "test_gpu_job.py",
    "test_megatron_cpu.py",
    "test_megatron_memory.py",
    "test_trl_formats.py",
    "test_slurm_jobs.py",
    "test_ray_cluster.py",
    "test_run_time.py",
    "test_merge.py",
    "test_reward_bench.py",
}
SLOW_TESTS = (
    "test_steps.py::test_the_preflight_refuses_too_little_data",
    "test_steps.py::test_the_count_uses_the_rows_verl_keeps",
    "test_algorithms.py::test_every_accepted_combination_composes",
    "test_algorithms.py::test_async_rollout_is_refused_where",
    "test_algorithms.py::test_the_preflight_stops_a_job_whose_engine",
    "test_algorithms.py::test_a_missing_engine_or_recipe",
    "test_algorithms.py::test_one_step_off_imports_where",
    "test_algorithms.py::test_the_preflight_stops_the_issues_batch",
    "test_verl_app_def.py::test_post_on_a_base_holding",
    "test_verl_app_def.py::test_the_build_check_passes_when",
    "test_verl_app_def.py::test_the_install_line_resolves",
    "test_reward_stack.py::test_the_image_check_passes",
    "test_reward_client.py::test_eight_processes_appending",
    "test_reward_client.py::test_verl_reward_managers_call",
    "test_reward_client.py::test_the_async_reward_loop_passes",
    "test_reward_client.py::test_the_server_killed_mid_run",
    "test_reward_client.py::test_a_4xx_is_never_retried",
    "test_reward_client.py::test_a_dead_server_with_a_6_s_budget",
    "test_reward_server.py::test_the_port_stays_closed_while",
    "test_reward_server.py::test_health_answers_only_once",
    "test_reward_server.py::test_a_model_that_cannot_load_exits",
    "test_check_format.py::test_the_command_recommends",
    "test_preempt.py::test_the_hook_imports_nothing_of_verl",
    "test_harness.py::test_the_makefiles_two_tiers_hold",  # two whole collections: 20-60 s, a third of make test-fast
)


def is_slow(item) -> bool:
    return (
        bool(SLOW_FIXTURES.intersection(item.fixturenames))
        or item.path.name in SLOW_MODULES
        or item.nodeid.removeprefix("tests/").startswith(SLOW_TESTS)
    )


def pytest_collection_modifyitems(items):
    """Mark the slow tests (see SLOW_FIXTURES); then the longest first, in LONGEST_FIRST's order, each followed by a
    quick one, then the rest in their order: the same order in every xdist worker."""
    for item in items:
        if is_slow(item) and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)
    items.sort(key=_longest_first)
    longest = [item for item in items if _longest_first(item) < len(LONGEST_FIRST)]
    rest = items[len(longest) :]
    quick = [item for item in rest if is_quick(item)][: len(longest)]
    rest = [item for item in rest if item not in quick]
    items[:] = [test for i, long in enumerate(longest) for test in (long, *quick[i : i + 1])] + rest


def is_quick(item) -> bool:
    """A slow-tier test that is in it only for its module's sake (a parser, a table, a formula: seconds at most)."""
    return bool(item.get_closest_marker("slow")) and not (
        SLOW_FIXTURES.intersection(item.fixturenames)
        or item.nodeid.removeprefix("tests/").startswith(SLOW_TESTS)
        or item.path.name in ("test_trl_formats.py", "test_megatron_cpu.py")  # a model trained, a worker built
        or _longest_first(item) < len(LONGEST_FIRST)
    )
