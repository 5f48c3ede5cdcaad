"""The Slurm launch, for real: run_grpo_qwen3_4b_mega_verl.sh and helper_grpo_qwen3_4b.sh against fake
sbatch/srun/scontrol/singularity, real reward servers and a real Ray cluster on loopback, and a fake trainer that
records what it was given and what it saw."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import REPO, RUN, assert_everything_stopped, job_dir, run, seen, slurm

# --- the whole flow ----------------------------------------------------------------------------------------------


def test_one_node_runs_reward_server_ray_and_the_trainer_then_stops_everything(job, fake_cluster):
    result = run(job, "trainer.total_epochs=2")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
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
    assert any(p.name.startswith("reward_server_") for p in logs.iterdir())
    assert (Path(job["CONFIG_OUTPUT_DIR"]) / "TRAINING_DONE").exists()
    (call,) = fake_cluster.calls("singularity")[-1:]
    assert call["argv"][:2] == ["exec", "--nv"] and job["CONFIG_IMAGE_PATH"] in call["argv"]
    assert call["argv"][-2].endswith("helper_grpo_qwen3_4b.sh")
    assert_everything_stopped(job)


def test_two_nodes_with_a_separate_reward_node(job, fake_cluster):
    env = slurm(job, 2, CONFIG_USE_SEPARATE_REWARD_NODE="true", REWARD_REPLICAS="2")
    result = run(env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    trainer = seen(env)
    assert trainer["ray_nodes"] == 1, "the reward node trains nothing and stays out of Ray"
    assert "trainer.nnodes=1" in trainer["argv"]
    port = int(env["CONFIG_REWARD_SERVER_PORT"])
    assert trainer["REWARD_SERVER_URLS"] == f"http://127.0.0.1:{port},http://127.0.0.1:{port + 1}"
    assert trainer["reward_health"] == [200, 200]
    (srun,) = fake_cluster.calls("srun")
    assert srun["argv"][:4] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    assert "--cpus-per-task=1" in srun["argv"], "srun of Slurm 22.05-23.02 does not inherit the CPU count"
    assert ["show", "hostnames", "node[1-2]"] in [c["argv"] for c in fake_cluster.calls("scontrol")]
    assert_everything_stopped(env)


def test_two_training_nodes_join_one_real_ray_cluster_and_each_offline_start_is_its_own_wandb_run_in_one_group(
    job, fake_cluster
):
    # Slurm's end time in its local-time format; verl saves once the expiry (that minus CHECKPOINT_BEFORE_END) nears.
    end = int(time.time()) + 7200
    end_text = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(end))
    env = slurm(
        job, 2, FAKE_JOB_END_TIME=end_text, FAKE_TRAINER_PROBE_NODES="1", PREFLIGHT_DATA="0", PREFLIGHT_REWARD="0"
    )
    run_ids = []
    for restart in ("", "1"):  # the first start, then Slurm's requeue of the same job
        Path(env["FAKE_TRAINER_LOG"]).unlink(missing_ok=True)
        # The fake trainer finishes at once: a real requeue comes before the training is done.
        Path(env["CONFIG_OUTPUT_DIR"], "TRAINING_DONE").unlink(missing_ok=True)
        result = run(env | ({"SLURM_RESTART_COUNT": restart} if restart else {}))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        trainer = seen(env)
        assert (trainer["ray_nodes"], trainer["ray_gpus"]) == (2, 2)
        assert "trainer.nnodes=2" in trainer["argv"]
        nodes = trainer["node_env"]
        assert len(nodes) == 2, "a Ray task ran on every node"
        for node_env in nodes.values():
            # What verl's TaskRunner and workers read, wherever Ray places them.
            assert node_env["MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"] == str(end - 1800)
            assert node_env["token"]
            # Offline (the default), wandb ignores resume: a shared id would be overwritten at `wandb sync`.
            assert node_env["WANDB_RESUME"] is None and node_env["WANDB_RUN_GROUP"] == "qwen3_4b_grpo_megatron-777"
            run_ids.append(node_env["WANDB_RUN_ID"])
    assert sorted(set(run_ids)) == ["qwen3_4b_grpo_megatron-777", "qwen3_4b_grpo_megatron-777-r1"], run_ids
    assert ["show", "job", "777"] in [c["argv"] for c in fake_cluster.calls("scontrol")], "the end time from Slurm"
    logs = sorted(p.name for p in Path(env["CONFIG_LOG_DIR"]).iterdir())
    assert logs == ["777", "777-r1"], "each start of the job logs to its own folder"
    assert any(p.name.startswith("ray_worker_") for p in (Path(env["CONFIG_LOG_DIR"]) / "777-r1").iterdir())


def test_online_a_requeue_resumes_the_jobs_one_wandb_run_and_wandb_dir_exists_before_the_trainer_starts(job):
    env = slurm(job, 1, WANDB_MODE="online", PREFLIGHT_DATA="0", PREFLIGHT_REWARD="0")
    env.pop("WANDB_DIR")  # the job's default: beside each start's logs
    seen_by_start = []
    for restart in ("", "1"):
        Path(env["FAKE_TRAINER_LOG"]).unlink(missing_ok=True)
        Path(env["CONFIG_OUTPUT_DIR"], "TRAINING_DONE").unlink(missing_ok=True)
        result = run(env | ({"SLURM_RESTART_COUNT": restart} if restart else {}))
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        seen_by_start.append(seen(env))
    for trainer, folder in zip(seen_by_start, ("777", "777-r1"), strict=True):
        assert (trainer["WANDB_RUN_ID"], trainer["WANDB_RESUME"]) == ("qwen3_4b_grpo_megatron-777", "allow")
        assert trainer["WANDB_DIR"] == str(Path(env["CONFIG_LOG_DIR"]) / folder / "wandb")
        assert trainer["wandb_dir_is_dir"], "WANDB_DIR exists before the trainer starts"


def test_a_wandb_dir_that_cannot_be_created_stops_the_job_before_anything_starts(job, fake_cluster, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    result = run(job | {"WANDB_DIR": str(blocker / "wandb"), "PREFLIGHT_ONLY": "1"})
    assert result.returncode == 1, result.stdout[-2000:]
    assert "could not create the job's folders" in result.stderr and "WANDB_DIR" in result.stderr
    assert not fake_cluster.calls("srun") and not fake_cluster.calls("singularity")


# --- failures ----------------------------------------------------------------------------------------------------


def test_a_reward_server_that_never_becomes_healthy_fails_the_job_within_the_deadline(job):
    start = time.monotonic()
    # The preflight's own reward check would stop this first: here it is the job's servers that never get ready.
    result = run(job | {"REWARD_START_TIMEOUT": "2", "PREFLIGHT_REWARD": "0"})
    assert result.returncode != 0
    assert time.monotonic() - start < 90
    assert "not ready after 2 s" in result.stderr and "reward_server_" in result.stderr
    assert not Path(job["FAKE_TRAINER_LOG"]).exists(), "the trainer must not start"
    assert_everything_stopped(job)


def test_a_worker_that_never_joins_fails_the_job_with_the_counts(job, fake_cluster):
    real_ray = Path(sys.executable).with_name("ray")
    broken = fake_cluster.bin_dir / "ray"
    # rank 1's `ray start` cannot reach the head; everything else is the real ray
    broken.write_text(f'#!/bin/sh\n[ "$SLURM_PROCID" = 1 ] && [ "$1" = start ] && exit 1\nexec "{real_ray}" "$@"\n')
    broken.chmod(0o755)
    env = slurm(job, 2, RAY_JOIN_TIMEOUT="15", RAY_START_RETRIES="2")
    result = run(env)
    assert result.returncode != 0
    assert "1/2 nodes, 1/2 GPUs after 15 s" in result.stderr
    assert "ray start failed (attempt 2/2)" in result.stderr
    assert "ray_worker_" in result.stderr, "the error points at the worker logs"
    assert not Path(env["FAKE_TRAINER_LOG"]).exists()
    assert_everything_stopped(env)


def test_the_trainer_exit_code_is_the_jobs_and_everything_stops(job):
    result = run(job | {"FAKE_TRAINER_RC": "3"})
    assert result.returncode == 3
    assert "trainer exited with 3" in result.stderr
    assert not (Path(job["CONFIG_OUTPUT_DIR"]) / "TRAINING_DONE").exists()
    assert (job_dir(job) / "done").read_text().strip() == "3"
    assert_everything_stopped(job)


def test_requeue_on_the_time_limit_signal_then_no_rerun_once_finished(job, fake_cluster):
    env = slurm(job, 1, FAKE_TRAINER_SLEEP="120")
    proc = subprocess.Popen(["bash", str(RUN)], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not Path(env["FAKE_TRAINER_LOG"]).exists():
            time.sleep(0.5)
        assert Path(env["FAKE_TRAINER_LOG"]).exists(), "the trainer never started"
        os.kill(proc.pid, signal.SIGUSR1)  # what Slurm's --signal=B:USR1@900 does
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and fake_cluster.calls("scontrol")[-1]["argv"][0] != "requeue":
            time.sleep(0.5)
        assert fake_cluster.calls("scontrol")[-1]["argv"] == ["requeue", "777"]
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)
    Path(env["CONFIG_OUTPUT_DIR"], "TRAINING_DONE").touch()
    again = run(env)
    assert again.returncode == 0 and "already finished" in again.stdout
    assert len(fake_cluster.calls("srun")) == 1, "a finished training is not run again"


# --- checks before anything starts ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, needle",
    [
        ({"CONFIG_MODEL_PATH": "/nowhere/model"}, "CONFIG_MODEL_PATH=/nowhere/model: no config.json"),
        ({"CONFIG_TEST_FILE": "TRAIN"}, "CONFIG_TRAIN_FILE and CONFIG_TEST_FILE are the same file"),
        ({"CONFIG_USE_SEPARATE_REWARD_NODE": "true"}, "CONFIG_USE_SEPARATE_REWARD_NODE=true needs at least 2 nodes"),
        ({"FP8": "true"}, "FP8=true: verl 0.6.1 cannot train in FP8 here"),
        (
            {"CONFIG_GPUS_PER_NODE": "4", "ACTOR_PP": "3"},
            "ACTOR_PP x ACTOR_TP = 3 x 1 does not divide the 4 training GPUs",
        ),
        ({"PPO_MINI_BATCH_SIZE": "512"}, "TRAIN_BATCH_SIZE=256 is smaller than PPO_MINI_BATCH_SIZE=512"),
        ({"ROLLOUT_MODE": "fast"}, "ROLLOUT_MODE='fast'"),
        ({"CONFIG_IMAGE_PATH": "/nowhere/app.sif"}, "CONFIG_IMAGE_PATH=/nowhere/app.sif: no such image"),
    ],
)
def test_bad_settings_stop_the_job_before_anything_starts_naming_the_setting(job, fake_cluster, overrides, needle):
    if overrides.get("CONFIG_TEST_FILE") == "TRAIN":
        overrides = {"CONFIG_TEST_FILE": job["CONFIG_TRAIN_FILE"]}
    result = run(job | overrides)
    assert result.returncode == 1
    assert needle in result.stderr
    assert not fake_cluster.calls("srun") and not Path(job["FAKE_TRAINER_LOG"]).exists()


def test_the_articles_grpo_command_passes_verls_own_checks_and_a_typo_does_not(job):
    article = job | {"CONFIG_GPUS_PER_NODE": "4", "ACTOR_PP": "2", "PREFLIGHT_ONLY": "1"}
    ok = run(article)
    assert ok.returncode == 0, ok.stderr[-3000:]
    assert (
        "composes and passes verl's checks (adv_estimator=grpo, reward_manager=naive, rollout=sglang/async)"
        in ok.stdout
    )
    assert "PREFLIGHT_ONLY=1: nothing started" in ok.stdout
    typo = run(article, "trainer.total_epoch=2")
    assert typo.returncode == 1 and "Could not override 'trainer.total_epoch'" in typo.stderr
    micro = run(article, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3")
    assert micro.returncode == 1 and "verl 0.6.1 rejects the trainer config" in micro.stderr


def test_sync_rollout_uses_the_batch_manager_and_our_batch_function(job):
    result = run(job | {"ROLLOUT_MODE": "sync", "PREFLIGHT_ONLY": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "reward_manager=batch, rollout=sglang/sync" in result.stdout


def test_broken_data_stops_the_job_before_the_queue_with_the_row(job, fake_cluster, tmp_path):
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


def test_preflight_scores_real_rows_through_verls_reward_manager_and_catches_a_wrong_think_setting(job, fake_cluster):
    ok = run(job | {"PREFLIGHT_ONLY": "1"})
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert (
        "preflight: reward verl's naive reward loop (async rollout) scored 8 validation rows through "
        "safe_hack_reward_async" in ok.stdout
    )
    assert "(penalty: cut off mid-reasoning)" in ok.stdout
    wrong = run(job | {"PREFLIGHT_ONLY": "1", "REWARD_PROMPT_OPENS_THINK": "false"})
    assert wrong.returncode == 1
    assert "the reward check failed" in wrong.stderr and "REWARD_PROMPT_OPENS_THINK" in wrong.stderr
    assert not fake_cluster.calls("srun")


def test_an_async_dapo_job_is_checked_through_verls_dapo_reward_loop(job, fake_cluster):
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
            {"TRAINER_MODE": "one_step_off", "STRATEGY": "fsdp2", "ROLLOUT_MODE": "sync", "ROLLOUT_GPUS_PER_NODE": "2",
             "CONFIG_GPUS_PER_NODE": "4", "ROLLOUT_ENGINE": "vllm"},
            "recipe.one_step_off_policy.main_ppo --config-name=one_step_off_ppo_trainer",
        ),
    ],
)  # fmt: skip
def test_recipe_commands_pass_the_whole_preflight_with_verls_recipe_configs(job, fake_cluster, overrides, expected):
    """What the image runs first for a recipe: its config, the data and the reward round trip, before the queue.
    Here verl's recipe configs come from the verbatim copy in tests/fixtures (the image has verl's repository)."""
    recipes = REPO / "tests" / "fixtures" / "verl_v0.6.1_recipes"
    result = run(job | overrides | {"PREFLIGHT_ONLY": "1", "CONTAINER": "none", "PYTHONPATH": str(recipes)})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert f"preflight: {expected} with" in result.stdout and "composes and passes verl's checks" in result.stdout
    manager = "dapo" if "dapo" in expected else "batch"
    assert f"preflight: reward verl's {manager} reward manager scored 8 validation rows" in result.stdout
    assert not fake_cluster.calls("srun")


def test_a_gpu_count_that_disagrees_with_the_allocation_is_refused(job, fake_cluster):
    result = run(slurm(job, 1, SLURM_GPUS_ON_NODE="8"))
    assert result.returncode == 1
    assert "Slurm gave 8 GPUs per node but CONFIG_GPUS_PER_NODE=1" in result.stderr
    assert not fake_cluster.calls("srun")


def test_a_reward_server_that_cannot_start_fails_the_preflight_naming_its_log(job, fake_cluster):
    result = run(job | {"REWARD_START_TIMEOUT": "2", "PREFLIGHT_ONLY": "1"})
    assert result.returncode == 1
    assert "the reward server for the check was not healthy after 2 s" in result.stderr
    assert "preflight_reward_server.log" in result.stderr
