"""The launch on one machine without Slurm (a workstation, `make demo`), and every check before anything starts:
run_grpo_qwen3_4b_mega_verl.sh and helper_grpo_qwen3_4b.sh with the fake container, real reward servers, a real Ray
cluster on loopback, and a stand-in trainer that records what it was given and what it saw. Whole jobs through the
real Slurm are tests/test_slurm_jobs.py."""

import json
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

from demo.run import LOGIN_NODE_CHECK
from launch.plan.procs import free_port, start_process, stop_process, wait_for_http
from launch.plan.reward_check import CheckServer, server_round_trip
from tests.support import REPO, assert_everything_stopped, block_environment, gsm8k_rule_data, job_dir, run, seen

# --- the whole flow ----------------------------------------------------------------------------------------------


RAY_HEAD_TIMEOUT = (
    "Exception: The current node timed out during startup. This could happen because some of the raylet failed to "
    "startup or the GCS has become overloaded."
)


def test_one_node_runs_reward_server_ray_and_the_trainer_starting_a_timed_out_ray_head_again_then_stops_everything(
    job, fake_container, tmp_path
):
    """In a home where a local Ray of the user's left ~/.ray/auth_token (Ray 2.60 writes one at any ray.init()):
    `ray start --head` turned token authentication on from it, and the job's own clients, which sent no token, were
    refused until RAY_JOIN_TIMEOUT. The job gives its Ray a token of its own.
    Ray gives its raylet 30 s to register with the GCS (ray/_private/node.py, raylet_start_wait_time_s, no setting):
    on a loaded node `ray start --head` exits with that message. Here the head's first `ray start` does, as Ray would;
    the head starts it again (RAY_START_RETRIES, as a worker node does) and the job runs, every attempt in one log.
    Merged here (issue 71: one run of the job proves both) is what was
    test_a_head_whose_ray_start_times_out_starts_it_again_and_the_job_runs, its assertions kept: the job exits 0, the
    head's first start failed ("[rank 0] ray start failed (attempt 1/3)"), ray_head.log holds the timeout before
    "Ray runtime started", the trainer saw one Ray node, nothing of the job left."""
    shim, failed = tmp_path / "rayshim", tmp_path / "head_failed_once"
    shim.mkdir()
    (shim / "ray").write_text(
        f'#!/bin/sh\ncase " $* " in *" --head "*) if [ ! -e "{failed}" ]; then touch "{failed}"; '
        f'echo "{RAY_HEAD_TIMEOUT}"; exit 1; fi;; esac\nexec "{Path(sys.executable).parent / "ray"}" "$@"\n'
    )
    (shim / "ray").chmod(0o755)
    stale = Path(job["HOME"]) / ".ray" / "auth_token"
    stale.parent.mkdir(parents=True)
    stale.write_text("a0" * 32)
    user = {k: v for k, v in job.items() if k != "RAY_AUTH_MODE"}  # as a user's shell has it: unset (conftest's off)
    user["PATH"] = f"{shim}{os.pathsep}{job['PATH']}"
    result = run(user | {"RAY_JOIN_TIMEOUT": "60"}, "trainer.total_epochs=2", timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert failed.exists() and "[rank 0] ray start failed (attempt 1/3)" in output, output[-3000:]
    head_log = (job_dir(job) / "ray_head.log").read_text()
    assert head_log.index("timed out during startup") < head_log.index("Ray runtime started"), head_log[-2000:]
    assert stale.read_text() == "a0" * 32, "the user's token is left alone"
    token = job_dir(job) / "ray_auth_token"  # the job's own, for the user's `ray status` into it
    assert token.stat().st_mode & 0o777 == 0o600 and len(token.read_text()) == 64
    assert token.read_text() not in result.stdout + result.stderr, "never printed"
    trainer = seen(job)
    assert trainer["reward_health"] == [200] and trainer["ray_nodes"] == 1 and trainer["ray_gpus"] == 1
    argv = trainer["argv"]
    assert argv[:2] == ["-m", "verl.trainer.main_ppo"]
    assert f"data.train_files={job['CONFIG_TRAIN_FILE']}" in argv, "train and test the right way round"
    assert f"data.val_files={job['CONFIG_TEST_FILE']}" in argv
    assert argv[-1] == "trainer.total_epochs=2", "command-line overrides go last, so they win"
    assert not any("fp8" in a for a in argv), "no FP8 overrides that verl 0.6.1 would silently ignore"
    assert trainer["WANDB_MODE"] == "offline" and trainer["REWARD_SERVER_URLS"].startswith("http://127.0.0.1:")
    logs = job_dir(job)
    assert (logs / "trainer_command.txt").read_text().splitlines() == [job["TRAINER_LAUNCHER"], *argv]
    assert {"ray_head.log", "trainer.log", "reward_urls", "done"} <= {p.name for p in logs.iterdir()}
    (ray_logs,) = logs.glob("ray_logs_*")  # Ray's own, from node-local RAY_TMP_DIR, once Ray stopped
    assert (ray_logs / "raylet.out").is_file() and list(ray_logs.glob("gcs_server.*")), sorted(ray_logs.iterdir())
    assert any(p.name.startswith("reward_server_") for p in logs.iterdir())
    assert (Path(job["CONFIG_OUTPUT_DIR"]) / "TRAINING_DONE").exists()
    (call,) = fake_container.calls("singularity")[-1:]
    assert call["argv"][:2] == ["exec", "--nv"] and job["CONFIG_IMAGE_PATH"] in call["argv"]
    assert call["argv"][-2].endswith("helper_grpo_qwen3_4b.sh")
    assert_everything_stopped(job)


def test_a_wandb_dir_that_cannot_be_created_stops_the_job_before_anything_starts(job, fake_container, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    result = run(job | {"WANDB_DIR": str(blocker / "wandb"), "PREFLIGHT_ONLY": "1"})
    assert result.returncode == 1, result.stdout[-2000:]
    assert "could not create the job's folders" in result.stderr and "WANDB_DIR" in result.stderr
    assert "=== launching on" not in result.stdout and not fake_container.calls("singularity")


# --- failures ----------------------------------------------------------------------------------------------------


def test_a_reward_server_that_never_becomes_healthy_fails_the_job_within_the_deadline(job, tmp_path):
    start = time.monotonic()
    # The preflight's own reward check would stop this first: here it is the job's servers that never get ready. The
    # server hangs before it listens (python3 on PATH runs a sleep in place of reward_server.py, and everything else
    # as it is); the head starts Ray while it waits, and the deadline counts from the server's start.
    hang = tmp_path / "hang"
    hang.mkdir()
    (hang / "python3").write_text(
        f'#!/bin/bash\n[[ "$1" == */reward_server.py ]] && exec sleep 3600\nexec {sys.executable} "$@"\n'
    )
    (hang / "python3").chmod(0o755)
    path = f"{hang}{os.pathsep}{job['PATH']}"
    result = run(job | {"REWARD_START_TIMEOUT": "20", "PREFLIGHT_REWARD": "0", "PATH": path})
    assert result.returncode != 0
    assert time.monotonic() - start < 120
    assert "did not become healthy within REWARD_START_TIMEOUT=20 s of its start" in result.stderr
    assert "not ready after" in result.stderr and "reward_server_" in result.stderr
    assert "=== [rank 0] Ray head on" in result.stdout, "Ray starts while the reward servers load"
    assert not Path(job["FAKE_TRAINER_LOG"]).exists(), "the trainer must not start"
    assert_everything_stopped(job)


def test_the_trainer_exit_code_is_the_jobs_and_everything_stops(job, tmp_path):
    """With REWARD=rule (verl's scorers in its own workers) on GSM8K rule rows: no reward server starts, none is
    checked, and no reward model needs to exist."""
    env = (
        job
        | gsm8k_rule_data(tmp_path)
        | {
            "FAKE_TRAINER_RC": "3",
            "REWARD": "rule",
            "TRAIN_BATCH_SIZE": "8",
            "PPO_MINI_BATCH_SIZE": "8",
            "CONFIG_REWARD_MODEL_PATH": "/nowhere",
        }
    )
    result = run(env)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "trainer exited with 3" in result.stderr
    assert not (Path(job["CONFIG_OUTPUT_DIR"]) / "TRAINING_DONE").exists()
    assert (job_dir(job) / "done").read_text().strip() == "3"
    assert "preflight: reward: REWARD=rule, rules by verl's scorers" in result.stdout
    assert "no reward server (REWARD=rule)" in result.stdout
    assert (
        "reward loop (async rollout) scored a right answer to a openai/gsm8k row 1 by rule, a wrong one 0"
        in result.stdout
    ), result.stdout[-3000:]
    assert seen(job)["reward_health"] == [] and seen(job)["REWARD_SERVER_URLS"] == ""
    assert not [p.name for p in job_dir(job).iterdir() if "reward_server" in p.name]
    assert_everything_stopped(job)


def test_a_finished_training_is_never_run_again(job):
    Path(job["CONFIG_OUTPUT_DIR"]).mkdir(parents=True)
    Path(job["CONFIG_OUTPUT_DIR"], "TRAINING_DONE").touch()
    again = run(job)
    assert again.returncode == 0 and "this training already finished; remove it to train again" in again.stdout
    assert "=== launching on" not in again.stdout and not Path(job["FAKE_TRAINER_LOG"]).exists()


# --- checks before anything starts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"CONFIG_MODEL_PATH": "/nowhere/model"}, "CONFIG_MODEL_PATH=/nowhere/model: no config.json"),
        # a folder the container would bind: the runtime's own mount error would name no setting
        ({"CONFIG_TRAIN_FILE": "/nowhere/train.parquet"}, "CONFIG_TRAIN_FILE=/nowhere/train.parquet: no such file"),
        ({"CONFIG_TEST_FILE": "TRAIN"}, "CONFIG_TRAIN_FILE and CONFIG_TEST_FILE are the same file"),
        ({"CONFIG_USE_SEPARATE_REWARD_NODE": "true"}, "CONFIG_USE_SEPARATE_REWARD_NODE=true needs at least 2 nodes"),
        ({"ALGORITHM": "reinforce"}, "setting error: ALGORITHM='reinforce': use one of grpo, ppo, dapo"),
        (
            {"CONFIG_GPUS_PER_NODE": "4", "ACTOR_PP": "3"},
            "ACTOR_PP x ACTOR_TP = 3 x 1 does not divide the 4 training GPUs",
        ),
        ({"PPO_MINI_BATCH_SIZE": "512"}, "TRAIN_BATCH_SIZE=256 is smaller than PPO_MINI_BATCH_SIZE=512"),
        ({"ROLLOUT_MODE": "fast"}, "ROLLOUT_MODE='fast'"),
        ({"MEGATRON_RECOMPUTE": "partial"}, "MEGATRON_RECOMPUTE='partial': use one of auto, full, selective, off"),
        ({"CONFIG_IMAGE_PATH": "/nowhere/app.sif"}, "CONFIG_IMAGE_PATH=/nowhere/app.sif: no such image"),
        # Ray's own count, whatever the trainer (`ray start --num-cpus` would fail on every node, in the job)
        ({"RAY_NUM_CPUS": "2.5"}, "RAY_NUM_CPUS=2.5 (RAY_NUM_CPUS): Ray's CPUs per node must be a whole number"),
        ({"RAY_NUM_CPUS": "0"}, "RAY_NUM_CPUS=0 (RAY_NUM_CPUS): Ray's CPUs per node must be a whole number of at"),
        ({"REWARD": "rules"}, "REWARD='rules': use rm (the reward model), rule (verl's scorers) or rm+rule"),
        ({"REWARD_RULE_WEIGHT": "heavy"}, "(REWARD_RULE_WEIGHT or reward_kwargs.rule_weight) = 'heavy'"),
        (
            {"REWARD": "rule", "CONFIG_USE_SEPARATE_REWARD_NODE": "true", "SLURM_NNODES": "2"},
            "CONFIG_USE_SEPARATE_REWARD_NODE=true with REWARD=rule: that node would idle",
        ),
    ],
)
def test_bad_settings_stop_the_job_before_anything_starts_naming_the_setting(job, fake_container, overrides, needle):
    if overrides.get("CONFIG_TEST_FILE") == "TRAIN":
        overrides = {"CONFIG_TEST_FILE": job["CONFIG_TRAIN_FILE"]}
    result = run(job | overrides)
    assert result.returncode == 1
    assert needle in result.stderr
    assert "=== launching on" not in result.stdout and not Path(job["FAKE_TRAINER_LOG"]).exists()


def test_the_articles_grpo_command_passes_verls_own_checks_and_a_typo_does_not(job):
    article = job | {"CONFIG_GPUS_PER_NODE": "4", "ACTOR_PP": "2", "PREFLIGHT_ONLY": "1"}
    ok = run(article)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (
        "composes and passes verl's checks (adv_estimator=grpo, reward_manager=naive, rollout=sglang/async)"
        in ok.stdout
    )
    assert "PREFLIGHT_ONLY=1: nothing started" in ok.stdout
    # the tiny policy's hidden size (64) is one verl's Triton kernel refuses: auto keeps them off, saying so
    assert "verl's fused log-prob kernels off (FUSED_KERNELS=auto: hidden_size 64 is not a multiple of 128" in ok.stdout
    assert "preflight: Megatron log-prob passes per GPU" in ok.stdout
    typo = run(article, "trainer.total_epoch=2")
    assert typo.returncode == 1 and "Could not override 'trainer.total_epoch'" in typo.stderr
    # fixed micro-batches put back by overrides: verl's validate_config asks 1024 sequences to split into them
    micro = run(
        article,
        "actor_rollout_ref.actor.use_dynamic_bsz=False",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
    )
    assert micro.returncode == 1 and "verl 0.6.1 rejects the trainer config" in micro.stderr


def test_a_login_nodes_preflight_checks_the_cpus_sbatch_will_give_against_what_verl_holds_on_a_node(job):
    """PREFLIGHT_ONLY=1 outside Slurm checks the CPUs the job will get, the header's #SBATCH --cpus-per-task=32, not
    the login node's: 16 GPUs a node with async SGLang rollout hold 33 of Ray's CPUs there (the TaskRunner, one beside
    each GPU, one per rollout server), and verl would wait for ever with 32; sync rollout holds 17."""
    login = {k: v for k, v in job.items() if k != "RAY_NUM_CPUS"} | {
        "CONFIG_GPUS_PER_NODE": "16",
        "ACTOR_PP": "2",
        "PREFLIGHT_ONLY": "1",
        "TRAINER_LAUNCHER": "python3",
        "TRAINER_IS_VERL": "1",
        "PREFLIGHT_DATA": "0",
        "PREFLIGHT_REWARD": "0",
    }
    refused = run(login)
    assert refused.returncode == 1, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert (
        "verl 0.6.1 would stop at run time: RAY_NUM_CPUS=32 Ray CPUs per node (#SBATCH --cpus-per-task=32, what "
        "sbatch gives each node), but verl 0.6.1 holds 33 on a node" in refused.stderr
    ), refused.stderr[-3000:]
    assert "16 for its sglang servers" in refused.stderr and "#SBATCH --cpus-per-task=33 or more" in refused.stderr
    sync = run(login | {"ROLLOUT_MODE": "sync"})  # past the CPUs, to the engine's import (no SGLang here)
    assert "Ray CPUs per node" not in sync.stderr, sync.stderr[-3000:]
    assert "the trainer cannot start here: import sglang fails" in sync.stderr, sync.stderr[-3000:]


def test_a_login_node_without_the_engine_passes_every_check_it_can_run_and_lists_what_it_could_not(job):
    """The README's login-node command, where SGLang does not import (this machine, like a login node without the
    image): the data through verl's RLHFDataset and the reward round trip on the CPU run, the engine's import is
    listed as not checked here and why, and the check exits 0, usable as a gate; a real problem still exits 1."""
    env = {k: v for k, v in job.items() if k != "RAY_NUM_CPUS"} | {
        "CONTAINER": "none",
        "PREFLIGHT_ONLY": "1",
        "PREFLIGHT_REWARD_DEVICE": "cpu",
        "TRAINER_LAUNCHER": "python3",
        "TRAINER_IS_VERL": "1",
        "TRAIN_BATCH_SIZE": "8",
        "PPO_MINI_BATCH_SIZE": "8",
    }
    result = run(env)
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, out[-3000:] + err[-3000:]
    assert (
        "preflight: not checked here (CONTAINER=none outside a job; the job's own preflight checks it on its node "
        "before anything starts): the trainer's imports: import sglang fails" in out
    ), out[-3000:]
    assert "preflight: data train: " in out and "preflight: steps: " in out, out[-3000:]
    assert "preflight: reward verl's naive reward loop (async rollout) scored 8 validation rows" in out, out[-3000:]
    assert "preflight: every check that can run here passed" in out and "ERROR" not in err, err[-2000:]
    assert "the trainer cannot start" not in err, err[-2000:]
    for readme in ("README.md", "README.ja.md"):
        assert LOGIN_NODE_CHECK in (REPO / readme).read_text(), readme
    real = run(env | {"PPO_MINI_BATCH_SIZE": "16", "PREFLIGHT_REWARD": "0", "PREFLIGHT_DATA": "0"})
    assert real.returncode == 1 and "ERROR: the preflight failed" in real.stderr, real.stderr[-2000:]
    (kept,) = Path(env["CONFIG_LOG_DIR"]).glob("local-*")  # only the failed one keeps its folder
    assert f"logs: {kept})" in real.stdout


def test_sync_rollout_uses_the_batch_manager_and_our_batch_function(job):
    result = run(job | {"ROLLOUT_MODE": "sync", "PREFLIGHT_ONLY": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "reward_manager=batch, rollout=sglang/sync" in result.stdout
    # A passing preflight leaves no logs/local-* folder behind (its output is on the screen), and says so.
    assert not list(Path(job["CONFIG_LOG_DIR"]).glob("local-*")), list(Path(job["CONFIG_LOG_DIR"]).iterdir())
    assert "exiting (exit_code=0; logs: none kept (the checks passed; their output is above))" in result.stdout


def test_broken_data_stops_the_job_before_the_queue_with_the_row(job, fake_container, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pq.read_table(job["CONFIG_TRAIN_FILE"]).to_pylist()
    rows[2]["reward_model"] = {"style": "model", "ground_truth": ""}
    broken = tmp_path / "broken_train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), broken)
    result = run(job | {"CONFIG_TRAIN_FILE": str(broken), "PREFLIGHT_ONLY": "1"})
    assert result.returncode == 1
    assert "row 3: reward_model.ground_truth is missing or empty" in result.stdout
    assert "train/test parquet files have errors" in result.stderr
    ok = run(job | {"PREFLIGHT_ONLY": "1", "MAX_PROMPT_LENGTH": "70"})
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "over the limit of 70" in ok.stdout and "dropped by data.filter_overlong_prompts" in ok.stdout
    over = int(ok.stdout.split("preflight: data train: ")[1].split(" longer than")[0].split(", ")[1])
    assert over > 0, "verl's own RLHFDataset must drop the same over-long prompts the validator counted"
    assert "longer than data.max_prompt_length=70 tokens (verl drops them)" in ok.stdout


def test_preflight_scores_real_rows_through_verls_reward_manager_and_catches_a_wrong_think_setting(job, fake_container):
    ok = run(job | {"PREFLIGHT_ONLY": "1"})
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (
        "preflight: reward verl's naive reward loop (async rollout) scored 8 validation rows through "
        "safe_hack_reward_async" in ok.stdout
    )
    assert "(penalty: cut off mid-reasoning)" in ok.stdout
    assert "the policy's chat template opens <think> in its generation prompt" in ok.stdout
    wrong = run(job | {"PREFLIGHT_ONLY": "1", "REWARD_PROMPT_OPENS_THINK": "false"})
    assert wrong.returncode == 1
    assert "set REWARD_PROMPT_OPENS_THINK=true (or auto)" in wrong.stderr, wrong.stderr[-2000:]
    assert "=== launching on" not in ok.stdout + wrong.stdout


def test_a_policy_whose_template_opens_no_think_block_is_scored_not_penalized_and_true_is_refused(job, instruct_policy):
    """An Instruct-style policy (no <think> in its prompt): auto tells the reward function so, the preflight's reward
    check scores the response without tags instead of penalizing it, and the job's command carries the value."""
    instruct = job | {"CONFIG_MODEL_PATH": str(instruct_policy)}
    ok = run(instruct | {"PREFLIGHT_ONLY": "1"})
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert "the policy's chat template opens no <think> in its generation prompt" in ok.stdout
    assert "prompt_opens_think=False" in ok.stdout and "(penalty: cut off mid-reasoning)" not in ok.stdout
    assert "scored 8 validation rows" in ok.stdout
    wrong = run(instruct | {"PREFLIGHT_ONLY": "1", "REWARD_PROMPT_OPENS_THINK": "true"})
    assert wrong.returncode == 1
    assert "every answer without </think> would get the penalty" in wrong.stderr
    assert "set REWARD_PROMPT_OPENS_THINK=false (or auto)" in wrong.stderr
    trained = run(instruct)
    assert trained.returncode == 0, trained.stderr[-3000:]
    assert "+custom_reward_function.reward_kwargs.prompt_opens_think=False" in seen(instruct)["argv"]


def test_an_async_dapo_job_is_checked_through_verls_dapo_reward_loop(job, fake_container):
    """Async rollout scores in the agent loop's reward workers: the preflight awaits verl's DAPO reward loop (the
    overlong penalty lives there) on our coroutine entry point, against a real server."""
    ok = run(job | {"PREFLIGHT_ONLY": "1", "ALGORITHM": "dapo"})
    assert ok.returncode == 0, ok.stdout[-2000:] + ok.stderr[-2000:]
    assert (
        "preflight: reward verl's dapo reward loop (async rollout) scored 8 validation rows through "
        "safe_hack_reward_async" in ok.stdout
    )
    assert "(penalty: cut off mid-reasoning)" in ok.stdout


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (
            {"ALGORITHM": "dapo", "DAPO_DYNAMIC_SAMPLING": "true", "ROLLOUT_MODE": "sync"},
            "recipe.dapo.main_dapo --config-name=dapo_megatron_trainer",
        ),
        (
            {
                "TRAINER_MODE": "one_step_off",
                "STRATEGY": "fsdp2",
                "ROLLOUT_MODE": "sync",
                "ROLLOUT_GPUS_PER_NODE": "2",
                "CONFIG_GPUS_PER_NODE": "4",
                "ROLLOUT_ENGINE": "vllm",
            },
            "recipe.one_step_off_policy.main_ppo --config-name=one_step_off_ppo_trainer",
        ),
    ],
)
def test_recipe_commands_pass_the_whole_preflight_with_verls_recipe_configs(job, fake_container, overrides, expected):
    """What the image runs first for a recipe: its config, the data and the reward round trip, before the queue.
    Here verl's recipe configs come from the verbatim copy in tests/fixtures (the image has verl's repository)."""
    recipes = REPO / "tests" / "fixtures" / "verl_v0.6.1_recipes"
    result = run(job | overrides | {"PREFLIGHT_ONLY": "1", "CONTAINER": "none", "PYTHONPATH": str(recipes)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"preflight: {expected} with" in result.stdout and "composes and passes verl's checks" in result.stdout
    manager = "dapo" if "dapo" in expected else "batch"
    assert f"preflight: reward verl's {manager} reward manager scored 8 validation rows" in result.stdout
    fsdp2 = "preflight: verl's fused log-prob kernels off (FUSED_KERNELS=auto: STRATEGY=fsdp2 keeps verl's logits)"
    assert (fsdp2 in result.stdout) == (overrides.get("STRATEGY") == "fsdp2"), "the reason, under fsdp2 only"
    assert "=== launching on" not in result.stdout


def test_a_reward_server_that_never_answers_fails_the_preflight_naming_its_log_and_is_stopped(
    tmp_path, monkeypatch, capsys
):
    """The check's server starts at the preflight's start and is waited for after the config and data checks:
    REWARD_START_TIMEOUT counts from its start, and one that never answers fails the check naming its log."""
    log = tmp_path / "preflight_reward_server.log"
    log.write_text("loading the reward model\n")
    hung = start_process([sys.executable, "-c", "import time; time.sleep(120)"], tmp_path / "hung.out")
    monkeypatch.setenv("REWARD_START_TIMEOUT", "2")
    began = time.monotonic()
    server = CheckServer(hung, f"http://127.0.0.1:{free_port()}", log, began)
    assert server_round_trip(None, None, server) is False
    assert 2 <= time.monotonic() - began < 30
    err = capsys.readouterr().err
    assert (
        "preflight: the reward check failed: TimeoutError: the reward server for the check was not healthy after 2 s"
        in err
    )
    assert f"(server log: {log})" in err and "loading the reward model" in err
    assert hung.poll() is not None, "the check stops its server"


def test_a_check_server_already_healthy_when_waited_for_passes_even_past_its_timeout(tmp_path):
    """Waited for long after its start (the config and data checks ran meanwhile): a server that answers is taken,
    whatever the clock says; the deadline is for one that does not."""
    port = free_port()
    server = start_process([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], tmp_path / "s.log")
    try:
        wait_for_http(server, f"http://127.0.0.1:{port}/", tmp_path / "s.log", 30)
        wait_for_http(server, f"http://127.0.0.1:{port}/", tmp_path / "s.log", 1, since=time.monotonic() - 60)
    finally:
        stop_process(server)


@pytest.mark.parametrize("config", [{"architectures": ["Qwen3ForCausalLM"]}, {"id2label": {"0": "ok", "1": "bad"}}])
def test_a_reward_model_without_a_one_score_head_is_refused_by_the_preflight_before_anything_loads(
    job, tiny_models, tmp_path, config
):
    """A causal LM (the policy) would score with a random head, a two-label classifier's head does not fit the one
    score: its config.json says so, and the preflight refuses it in one line before the check's server starts."""
    model = tmp_path / "rm"
    shutil.copytree(tiny_models.reward_model, model)
    (model / "config.json").write_text(json.dumps(json.loads((model / "config.json").read_text()) | config))
    result = run(job | {"CONFIG_REWARD_MODEL_PATH": str(model), "PREFLIGHT_ONLY": "1"})
    assert result.returncode == 1, result.stdout[-2000:]
    field = "architectures=['Qwen3ForCausalLM']" if "architectures" in config else "num_labels=2 (a classifier's head)"
    (line,) = [x for x in result.stderr.splitlines() if field in x]
    assert line.startswith(f"setting error: the reward model {model} (CONFIG_REWARD_MODEL_PATH"), line
    assert not (job_dir(job) / "preflight_reward_server.log").exists(), "no check server was started"
    assert "preflight: reward verl's" not in result.stdout and "=== launching on" not in result.stdout


# --- the reward model's input format ------------------------------------------------------------------------------


def test_the_reward_format_settings_reach_the_preflights_server_and_the_jobs_servers(job):
    env = job | {
        "CONFIG_REWARD_INPUT": "completion",
        "CONFIG_REWARD_ADD_SPECIAL_TOKENS": "false",
        "PREFLIGHT_DATA": "0",
    }
    result = run(env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    logs = job_dir(env)
    servers = [logs / "preflight_reward_server.log", *logs.glob("reward_server_*.log")]
    assert len(servers) == 2
    for log in servers:
        assert "format=completion (chat template, without special tokens)" in log.read_text(), log
        assert "is not read by this server" not in log.read_text(), "each CONFIG_REWARD_* reaches it as its flag"
    assert_everything_stopped(env)


def test_a_reward_format_setting_the_server_does_not_know_stops_the_job_naming_it(job):
    result = run(job | {"CONFIG_REWARD_INPUT": "prompt"})
    assert result.returncode == 1
    assert "CONFIG_REWARD_INPUT='prompt': use conversation or completion" in result.stderr
    assert "=== launching on" not in result.stdout


# --- REWARD=rule and rm+rule: the rows and the scorers, before the queue -----------------------------------------


def reward_rows(tmp_path, rows):
    """A parquet of verl rows: (data_source, style, ground_truth) each."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / f"rows{len(list(tmp_path.glob('rows*')))}.parquet"
    pq.write_table(
        pa.Table.from_pylist(
            [
                {
                    "data_source": ds,
                    "prompt": [{"role": "user", "content": f"q{i}"}],
                    "reward_model": {"style": style, "ground_truth": truth},
                    "extra_info": {"index": i},
                }
                for i, (ds, style, truth) in enumerate(rows)
            ]
        ),
        path,
    )
    return str(path)


GSM8K_ROW = ("openai/gsm8k", "rule", "4")
USER_FUNCTIONS = {
    "syntax": "def score(:\n",
    "raises": "def score(data_source, solution_str, ground_truth, extra_info=None):\n    raise KeyError('answer')\n",
    "text": "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return 'good'\n",
    "constant": "def score(data_source, solution_str, ground_truth, extra_info=None):\n    return {'score': 1}\n",
    "format": "def score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return float(solution_str.startswith('####'))\n",
}


@pytest.mark.parametrize(
    "reward, rows, function, needle",
    [
        # rule rows judged by the reward model alone: refused with their count and the setting that fits
        (
            "rm",
            [GSM8K_ROW] * 3 + [("safety", "model", "q")],
            "",
            "3 rows have a reward_model.style other than 'model', which REWARD=rm scores (first: {f} row 0, style "
            "'rule'): REWARD=rule or rm+rule",
        ),
        # the article's model rows under a rule: no rule can check the prompt
        ("rm+rule", [("safety", "model", "q")] * 2, "", "2 rows have a reward_model.style other than 'rule'"),
        (
            "rule",
            [GSM8K_ROW, ("openai/gsm8k", "rule", " ")],
            "",
            "1 rows have no reward_model.ground_truth for REWARD=rule's rule to compare with (first: {f} row 1)",
        ),
        # a data_source verl has no scorer for, with the ones it has, read from its own code
        (
            "rule",
            [GSM8K_ROW, ("custom", "rule", "4")],
            "",
            "data_source 'custom' (1 rows, first: {f} row 1) has no scorer in verl 0.6.1's default_compute_score, "
            "which knows DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500",
        ),
        ("rule", [GSM8K_ROW, ("aime2024", "rule", "7")], "", None),  # verl's prefix
        ("rule", [GSM8K_ROW] * 2, "", None),
        # the user's own function, any data_source: imported and called on a few rows
        (
            "rule",
            [("custom", "rule", "4")],
            "syntax",
            "REWARD_FUNCTION_PATH={p} (REWARD_FUNCTION_NAME=score) does not import: SyntaxError",
        ),
        (
            "rm+rule",
            [("custom", "rule", "4")],
            "raises",
            "(REWARD_FUNCTION_NAME=score) raised on {f} row 0: KeyError: 'answer'",
        ),
        (
            "rule",
            [("custom", "rule", "4")],
            "text",
            "returned 'good' for {f} row 0: return a number, or a dict with a 'score'",
        ),
        ("rule", [("custom", "rule", "4")] * 3, "constant", "returned 1.0 for all 12 responses to 3 rows"),
        ("rule", [("custom", "rule", "4")] * 3, "format", None),
    ],
)
def test_rows_that_disagree_with_reward_or_have_no_scorer_are_refused_naming_the_count_and_the_fix(
    tmp_path, reward, rows, function, needle
):
    from launch.plan.reward_check import reward_data_problems

    path = ""
    if function:
        path = tmp_path / f"{function}.py"
        path.write_text(USER_FUNCTIONS[function])
    f = reward_rows(tmp_path, rows)
    problems = reward_data_problems(reward, str(path), "score", [f])
    if needle is None:
        assert problems == []
    else:
        assert len(problems) == 1 and needle.format(f=f, p=path) in problems[0], problems


def test_the_rule_check_scores_a_right_answer_above_a_wrong_one_or_refuses_the_rows(tiny_models, tmp_path, monkeypatch):
    """The check the canary and every job run before training: verl's GSM8K scorer, through verl's batch reward
    manager (sync rollout; the async reward loop: the exit-code job above), gives the right answer to the first
    validation row 1 and a wrong one 0; with a ground_truth it cannot parse (the whole solution text, as data_prep
    wrote it before --preset) it gives both 0: refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from launch.plan.preflight import compose, split_command
    from launch.plan.reward_check import rule_round_trip
    from launch.plan.settings import Settings
    from launch.plan.trainer_command import trainer_argv

    data = gsm8k_rule_data(tmp_path)
    env = (
        block_environment()
        | data
        | {"CONFIG_MODEL_PATH": str(tiny_models.policy), "REWARD": "rule", "ROLLOUT_MODE": "sync"}
    )
    _, path, name, overrides = split_command(
        trainer_argv(Settings.from_env(env | {"REWARD_PROMPT_OPENS_THINK": "true"}))
    )
    cfg = compose(name, overrides, path)
    tokenizer = AutoTokenizer.from_pretrained(tiny_models.policy)
    monkeypatch.setenv("REWARD", "rule")
    (line,) = rule_round_trip(cfg, tokenizer)
    assert line.endswith("scored a right answer to a openai/gsm8k row 1 by rule, a wrong one 0")
    rows = pq.read_table(data["CONFIG_TEST_FILE"]).to_pylist()
    rows[0]["reward_model"]["ground_truth"] = "3+3=6\n#### 6"
    pq.write_table(pa.Table.from_pylist(rows), data["CONFIG_TEST_FILE"])
    with pytest.raises(
        ValueError, match="gave the right answer '3\\+3=6\\\\n#### 6' 0.0 and a wrong one '0' 0.0: it cannot"
    ):
        rule_round_trip(cfg, tokenizer)
