"""Whole jobs through a real Slurm 22.05: run_grpo_qwen3_4b_mega_verl.sh submitted with sbatch from a fresh clone
of the repository to the local two-node cluster (tests/slurm/local_slurm.sh), stopped with scancel, requeued by its
time-limit signal, on one node or two, with real reward servers on the CPU, a real Ray cluster on loopback, the fake
container (no Singularity here), and the stand-in trainer or, for the requeue, verl's own on the CPU
(cpu/verl_shims.py). Every job state is read from `scontrol show job` and waited for with a deadline; the test's node
sizes go on the sbatch command line, as a user's would."""

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cpu import megatron_shims, verl_shims
from launch.job import node
from launch.job.steps import is_training_step, parse_step_lines
from tests import stall_hook
from tests.real_slurm import FINISHED, NODE_SIZE, slurm_env
from tests.support import (
    MEGATRON_TRAINER,
    REAL_TRAINER,
    REPO,
    RUN,
    assert_everything_stopped,
    dapo_rule_data,
    gsm8k_rule_data,
    job_processes,
    real_trainer_args,
    seen,
    start_http_server,
)

FAST = {"PREFLIGHT_DATA": "0", "PREFLIGHT_REWARD": "0"}  # the preflight's data and reward checks are test_launch's
TWO_NODES = ("--nodes=2", *NODE_SIZE)
# recipe.dapo's entry point (verl 0.6.1's recipes, verbatim: PyPI has none), with the stand-in trainer outside the image
RECIPES = REPO / "tests" / "fixtures" / "verl_v0.6.1_recipes"
DAPO_RECIPE = {
    "ALGORITHM": "dapo",
    "DAPO_DYNAMIC_SAMPLING": "true",
    "ROLLOUT_MODE": "sync",
    "CONTAINER": "none",
    "PYTHONPATH": str(RECIPES),
}


def logs_of(env, job) -> Path:
    """The job's log folder (its first start's)."""
    return Path(env["CONFIG_LOG_DIR"]) / job.id


def test_a_fresh_clones_first_sbatch_on_two_nodes_completes_into_its_output_file_with_one_ray_and_the_save_deadline(
    job, submit, clone, fake_container
):
    """Only the node count and sizes on the command line: the script's own #SBATCH lines, --output=logs/%x-%j.out
    included, which Slurm cannot open unless the clone holds logs/ (it would fail at once, writing nothing).
    RAY_NUM_CPUS above the job's 2 CPUs is Ray's logical count: the nodes' step still gets the allocation's CPUs (srun
    used to be asked for RAY_NUM_CPUS and refused the step: "More processors requested than permitted"). The two
    training nodes join one Ray cluster, and verl's workers on each see the job's save deadline.
    Merged here (issue 71: one two-node job proves both) is what was
    test_two_training_nodes_join_one_ray_cluster_and_every_worker_sees_the_jobs_save_deadline, its assertions kept:
    the job COMPLETED; the trainer saw 2 Ray nodes and 2 GPUs and got trainer.nnodes=2; a Ray task ran on each node,
    whose environment holds MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP = the job's end (StartTime + its time
    limit: Slurm 22.05 sets no SLURM_JOB_END_TIME) - CHECKPOINT_BEFORE_END's 1800 s, and the reward token; Ray's own
    logs of each node (ray_logs_n1, ray_logs_n2, each with raylet.out); the worker's log named for its Slurm node
    (ray_worker_n2.log); nothing of the job left. Where the one-node job asserted one Ray node, one GPU and 3 CPUs, and
    the last container call on n1, this one asserts 2 nodes, 2 GPUs, 3 CPUs a node, and the call on each node."""
    env = job | {"RAY_NUM_CPUS": "3", "FAKE_TRAINER_PROBE_NODES": "1"}
    j = submit(env, "trainer.total_epochs=2", options=("--nodes=2", *NODE_SIZE))
    fields = j.wait()
    out = j.output()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), out[-4000:]
    assert j.out == clone / "logs" / f"grpo-qwen3-4b-{j.id}.out"
    assert f"=== job {j.id}: logs in {logs_of(env, j)}" in out
    assert "fake trainer: step 1/1 done" in out, "the trainer's own log is in the job's output"
    assert f"run_grpo_qwen3_4b_mega_verl.sh exiting (exit_code=0; logs: {logs_of(env, j)})" in out
    trainer = seen(env)
    assert trainer["reward_health"] == [200] and (trainer["ray_nodes"], trainer["ray_gpus"]) == (2, 2)
    assert trainer["ray_cpus"] == 2 * 3, "Ray's logical CPUs: RAY_NUM_CPUS on each node"
    assert trainer["argv"][:2] == ["-m", "verl.trainer.main_ppo"] and trainer["argv"][-1] == "trainer.total_epochs=2"
    assert "trainer.nnodes=2" in trainer["argv"]
    port = env["CONFIG_REWARD_SERVER_PORT"]
    assert (logs_of(env, j) / f"reward_server_n1_{port}.log").exists(), "per-node files carry Slurm's node name"
    assert (Path(env["CONFIG_OUTPUT_DIR"]) / "TRAINING_DONE").exists()
    calls = fake_container.calls("singularity")
    helpers = [c for c in calls if len(c["argv"]) > 1 and c["argv"][-2].endswith("helper_grpo_qwen3_4b.sh")]
    by_node = {call["env"]["SLURMD_NODENAME"]: call for call in helpers}
    assert sorted(by_node) == ["n1", "n2"], [c["env"].get("SLURMD_NODENAME") for c in helpers]
    for call in by_node.values():
        assert call["argv"][:2] == ["exec", "--nv"]
        assert call["env"]["SLURM_STEP_ID"] == "0", "inside srun's step"
        assert call["env"]["SLURM_CPUS_PER_TASK"] == "2", "the step has the allocation's CPUs"
    # Slurm 22.05 sets no SLURM_JOB_END_TIME: the end comes from `scontrol show job` (the start plus the time
    # limit while the job runs; once it has ended, EndTime is when it did), minus CHECKPOINT_BEFORE_END.
    end = int(time.mktime(time.strptime(fields["StartTime"], "%Y-%m-%dT%H:%M:%S"))) + time_limit_s(fields)
    nodes = trainer["node_env"]
    assert len(nodes) == 2, "a Ray task ran on every node"
    ray_logs = {p.name: p for p in logs_of(env, j).glob("ray_logs_*")}  # Ray's own logs of each node, at its stop
    assert set(ray_logs) == {"ray_logs_n1", "ray_logs_n2"}, sorted(ray_logs)
    assert all((p / "raylet.out").is_file() for p in ray_logs.values())
    for node_env in nodes.values():
        assert node_env["MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"] == str(end - 1800)
        assert node_env["token"], "the reward token reaches verl's workers on every node"
    assert (logs_of(env, j) / "ray_worker_n2.log").exists(), "the worker's log carries its Slurm node name"
    assert_everything_stopped(env)


def time_limit_s(fields: dict[str, str]) -> int:
    """`scontrol show job`'s TimeLimit ([D-]HH:MM:SS) in seconds."""
    days, _, clock = fields["TimeLimit"].rpartition("-")
    hours, minutes, seconds = map(int, clock.split(":"))
    return int(days or 0) * 86400 + hours * 3600 + minutes * 60 + seconds


def test_verl_saves_before_the_time_limit_and_the_requeued_job_resumes_its_checkpoint_at_that_step(
    job, submit, tmp_path
):
    """verl's own Megatron workers on the CPU (cpu/megatron_shims.py), the settings block's default. No regular saves
    (trainer.save_freq=1000): every checkpoint
    is verl's save before the expiry (should_save_ckpt_esi: within 60 s + its longest step + trainer.esi_redundant_time
    of MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP, the job's end minus CHECKPOINT_BEFORE_END). Once it has
    saved, the test shortens the time limit (as an admin could), so that Slurm's time-limit signal comes (--signal
    B:USR1@60): the script requeues the job, Slurm holds it (Reason=BeginTime) and starts it again with Restarts=1;
    that start logs to <id>-r1, verl resumes at the step it saved last and trains on, far from its new expiry, unsaved.
    Scored by verl's own rule scorer alone (REWARD=rule on DAPO-shaped rows, the preflight's checks on): no reward
    server anywhere."""
    # 10 epochs of the 32 prompts: more steps than the first start can take before the signal
    env = (
        job
        | MEGATRON_TRAINER
        | dapo_rule_data(tmp_path)
        | {
            "JOB_SIGNAL_LEAD": "60",
            "CHECKPOINT_BEFORE_END": "240",
            "TOTAL_EPOCHS": "10",
            "TRAINER_LOGGER": "[console,wandb]",
            "REWARD": "rule",
        }
    )
    args = real_trainer_args(
        "trainer.total_training_steps=200", "trainer.save_freq=1000", "trainer.test_freq=-1", strategy="megatron"
    )
    j = submit(env, *args, out=tmp_path / "job.out", options=(*NODE_SIZE, "--time=12", "--signal=B:USR1@60"))
    tracker = Path(env["CONFIG_OUTPUT_DIR"]) / "latest_checkpointed_iteration.txt"
    j.wait_for("verl's first save (step 2: the first step of a start has no longest step yet)", tracker.exists, 600)
    started = time.mktime(time.strptime(j.show()["StartTime"], "%Y-%m-%dT%H:%M:%S"))
    j.scontrol("update", f"JobId={j.id}", f"TimeLimit={int((time.time() - started) // 60) + 2}")
    fields = j.wait_until("requeued", lambda f: f.get("Restarts") == "1" and f["JobState"] == "PENDING", 400)
    assert fields["Reason"] == "BeginTime", fields
    first = j.output()
    assert f"time-limit signal: requeueing job {j.id}" in first, first[-4000:]
    assert "stopping this start for the requeue (within STOP_TIMEOUT=20 s); Slurm starts the job again" in first
    assert "run_grpo_qwen3_4b_mega_verl.sh exiting" in first, "this start stopped before Slurm's SIGKILL"
    saved = int(tracker.read_text())
    assert (Path(env["CONFIG_OUTPUT_DIR"]) / f"global_step_{saved}" / "actor" / "dist_ckpt").is_dir(), "not Megatron's"
    assert saved >= 2 and "Force saving checkpoint: ESI instance expiration approaching." in first, first[-4000:]
    assert not (Path(env["CONFIG_OUTPUT_DIR"]) / "global_step_1").exists(), "no save after a start's first step"
    # issue 59: REWARD=rule with verl's scorers alone. The preflight's rule check scored a right and a wrong answer
    # apart, no reward server started, and each step trained on verl's DAPO math score of the tiny policy's wrong
    # answers, -1 (0 would be a response no rule scored; a reward model's score is no whole number)
    assert "scored a right answer to a math_dapo row 1 by rule, a wrong one -1" in first, first[-4000:]
    assert "no reward server (REWARD=rule)" in first and not list(logs_of(env, j).glob("reward_server_n*")), first
    scores = {
        n: m["critic/score/mean"]
        for n, m in parse_step_lines((logs_of(env, j) / "trainer.log").read_text()).items()
        if is_training_step(m)
    }
    assert len(scores) >= saved and set(scores.values()) == {-1}, scores
    # The test does not wait out Slurm's hold; the second start runs one step past the checkpoint, then it is cancelled.
    j.scontrol("update", f"JobId={j.id}", "TimeLimit=30", "StartTime=now")
    j.wait_for(f"step {saved + 1} after the resume", lambda: f" step:{saved + 1} - " in j.output()[len(first) :], 600)
    second = j.output()[len(first) :]
    j.scancel()
    assert j.wait(120)["Restarts"] == "1"
    assert j.output().startswith(first), "the second start appends to the same output file (--open-mode=append)"
    assert f"=== job {j.id}: logs in {logs_of(env, j)}-r1" in second
    assert f"Setting global step to {saved}" in second and f" step:{saved} - " not in second, second[-3000:]
    # Every start runs the whole preflight, the trainer's imports included.
    assert "the trainer's modules import here" in first and "the trainer's modules import here" in second, second
    assert "Force saving checkpoint" not in second, "the new limit is far: verl's window is closed"
    assert sorted(p.name for p in Path(env["CONFIG_LOG_DIR"]).iterdir()) == [j.id, f"{j.id}-r1"]
    # verl's save-before-the-limit window: a first guess, then the validation and save the first start measured
    saves = re.findall(r"timing_s/save_checkpoint:([0-9.e+-]+)", (logs_of(env, j) / "trainer.log").read_text())
    windows = [
        next(a for a in (d / "trainer_command.txt").read_text().splitlines() if a.startswith("trainer.esi_redundant_"))
        for d in (logs_of(env, j), Path(f"{logs_of(env, j)}-r1"))
    ]
    assert windows == [
        "trainer.esi_redundant_time=600",
        f"trainer.esi_redundant_time={math.ceil(max(map(float, saves)))}",
    ]
    # Offline (the default) wandb ignores resume: each start is its own run of verl's, in the job's group.
    runs = sorted(p.name.split("-", 3)[-1] for p in (Path(env["WANDB_DIR"]) / "wandb").glob("offline-run-*"))
    assert runs == [f"qwen3_4b_grpo_megatron-{j.id}", f"qwen3_4b_grpo_megatron-{j.id}-r1"], runs
    for start in (logs_of(env, j), Path(f"{logs_of(env, j)}-r1")):
        assert_everything_stopped(env, logs=start)


def test_a_preempted_job_saves_the_step_it_is_in_and_resumes_there_and_a_recipe_beside_it_requeues_at_once(
    job, submit, tmp_path
):
    """Two jobs in the partition 'preemptible' (PreemptMode=REQUEUE, GraceTime=120, preempt_send_user_signal:
    tests/slurm/local_slurm.sh), preempted together by one 'urgent' job that needs the whole node:
    - verl's FSDP2 workers on the CPU, SAVE_FREQ out of reach: only the preemption's save can explain where the second
      start resumes. Slurm sends the script's --signal (USR1) to the batch script alone, the script finds a
      PreemptTime, sees a step and a save fit in the grace, asks verl for a save after the step it is in
      (launch/job/preempt.py), waits for verl's tracker file, and requeues the job; the second start resumes at that
      step and trains to the end. The CPU run's own Ray hook (cpu/verl_shims.py's shims) is chained behind the job's,
      not dropped: the trainer command names both, and verl both runs on the CPU and saves.
    - the preflight reads the real partition (scontrol show partition, show config) and says in one line what a
      preemption costs: the first start, with nothing measured, "nothing can be saved here" by the first guesses
      (a 600 s step), SAVE_FREQ=auto every 2 steps; the requeued start, from the first start's measured steps, "a
      preemption saves the step it is in", SAVE_FREQ=auto 25.
    - the DAPO recipe (the stand-in trainer, recipe.dapo's entry point) never calls verl's check: its preflight says
      nothing can be saved, and at the signal the job requeues at once instead of waiting out the grace."""
    env = job | FAST | REAL_TRAINER
    args = real_trainer_args("trainer.total_training_steps=10", "trainer.save_freq=1000", "trainer.test_freq=-1")
    options = (*NODE_SIZE, "--partition=preemptible", "--nodelist=n3")
    # the stand-in trainer as recipe.dapo, on ports and folders of its own (CONTAINER=none: the recipes on PYTHONPATH)
    recipe_env = job | FAST | DAPO_RECIPE | {"FAKE_TRAINER_STEP_SECONDS": "3", "CONFIG_REWARD_SERVER_PORT": ""}
    recipe_env |= {"RAY_TMP_DIR": f"{job['RAY_TMP_DIR']}/recipe"}
    for name in ("CONFIG_LOG_DIR", "CONFIG_OUTPUT_DIR", "FAKE_TRAINER_LOG"):
        recipe_env[name] = str(tmp_path / f"recipe_{name.lower()}")
    j = submit(env, *args, out=tmp_path / "job.out", options=options)
    recipe_args = ("trainer.total_training_steps=1000", "trainer.save_freq=1000")
    recipe = submit(recipe_env, *recipe_args, out=tmp_path / "recipe.out", options=options)
    log, tracker = logs_of(env, j) / "trainer.log", Path(env["CONFIG_OUTPUT_DIR"]) / "latest_checkpointed_iteration.txt"
    recipe_log = logs_of(recipe_env, recipe) / "trainer.log"
    j.wait_for("step 2 of the first start", lambda: log.is_file() and " step:2 - " in log.read_text(), 600)
    recipe.wait_for("the recipe's step 2", lambda: recipe_log.is_file() and " step:2 - " in recipe_log.read_text(), 300)
    urgent = subprocess.run(
        [
            "sbatch",
            "--parsable",
            "--partition=urgent",
            "--nodelist=n3",
            "--cpus-per-task=8",
            "--mem=500M",
            f"--output={tmp_path / 'urgent.out'}",
            "--wrap=sleep 1",
        ],
        env=slurm_env(env),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    preempting = time.monotonic()
    try:
        # Slurm holds a requeued job a while (BeginTime): the test does not wait that out.
        recipe.wait_until("requeued", lambda f: f.get("Restarts") == "1" and f["JobState"] == "PENDING", 300)
        recipe_requeued = time.monotonic() - preempting
        j.wait_until("requeued", lambda f: f.get("Restarts") == "1" and f["JobState"] == "PENDING", 300)
    finally:
        subprocess.run(["scancel", urgent.stdout.strip()], env=slurm_env(env), timeout=30)
    recipe_out = recipe.output()
    recipe.scancel()
    j.scontrol("update", f"JobId={j.id}", "StartTime=now")
    first = j.output()
    preempted = re.search(r"preempted at step (\d+): saving after this step \(grace (\d+) s, a step takes", first)
    saved = re.search(r"preempted: verl saved step (\d+); requeueing job", first)
    assert preempted and saved, first[-4000:]
    step = int(preempted.group(1))
    assert int(saved.group(1)) == step >= 3 and 60 < int(preempted.group(2)) <= 120, first[-4000:]
    assert "Force saving checkpoint: ESI instance expiration approaching." in log.read_text()
    assert "stopping this start for the requeue" in first and "run_grpo_qwen3_4b_mega_verl.sh exiting" in first
    command = (logs_of(env, j) / "trainer_command.txt").read_text().splitlines()
    assert "+ray_kwargs.ray_init.runtime_env.worker_process_setup_hook=launch.job.preempt.install" in command
    assert "+ray_kwargs.ray_init.runtime_env.env_vars.JOB_USER_SETUP_HOOK=cpu.verl_shims.install" in command
    where = "preflight: WARNING: preemption: partition preemptible (PreemptMode=REQUEUE, GraceTime=120 s): "
    assert f"{where}nothing can be saved here: up to 2 steps (~20 min) lost (grace 120 s, a step takes ~600 s" in first
    assert "trainer.save_freq=2" in command, "SAVE_FREQ=auto by the first guesses (the test's own 1000 after it wins)"
    # the recipe: said by its preflight, and requeued at once (the grace is 120 s; waiting it out took 85 s and more)
    said = f"{where}nothing can be saved here: up to 2 steps (~20 min) lost (recipe.dapo never calls verl's save check"
    requeued = "stopping without a save (recipe.dapo.main_dapo never calls verl's save check"
    assert said in recipe_out and requeued in recipe_out, recipe_out[-4000:]
    assert "no save within the grace" not in recipe_out and recipe_requeued < 60, (recipe_requeued, recipe_out[-3000:])
    fields = j.wait(600)
    assert (fields["JobState"], fields["Restarts"]) == ("COMPLETED", "1"), j.output()[-4000:]
    second = Path(f"{logs_of(env, j)}-r1") / "trainer.log"
    steps = sorted(n for n, m in parse_step_lines(second.read_text()).items() if is_training_step(m))
    assert f"Setting global step to {step}" in second.read_text() and steps == list(range(step + 1, 11)), steps
    saves = {p.name for p in Path(env["CONFIG_OUTPUT_DIR"]).glob("global_step_*")}
    assert saves == {f"global_step_{step}", "global_step_10"}, "the preemption's save and the last step's only"
    assert (Path(env["CONFIG_OUTPUT_DIR"]) / "TRAINING_DONE").exists() and tracker.read_text().strip() == "10"
    resumed = j.output()[len(first) :]
    saves_it = (
        r"a preemption saves the step it is in \(grace 120 s, a step takes ~\d+ s, .*; measured by earlier starts\)"
    )
    assert re.search(rf"{re.escape(where[20:])}{saves_it}; SAVE_FREQ=auto: 25", resumed), resumed[:4000]


def test_two_jobs_on_one_node_at_once_each_use_their_own_reward_server_and_ray(job, submit, tmp_path, tiny_models):
    """Default (per-job) ports, and an old server of another job already on the reward port the first job would
    take: both run at once on n1 to the end, each on its own reward server and its own Ray. Each trainer waits for
    the test's go-ahead, given once both have started: they ran at the same time."""
    envs, jobs, go = [], [], tmp_path / "both_trainers_run"
    for name in ("a", "b"):
        env = (
            job
            | FAST
            | {
                "CONFIG_REWARD_SERVER_PORT": "",
                "FAKE_TRAINER_WAIT_FOR": str(go),
                "CONFIG_LOG_DIR": str(tmp_path / f"logs_{name}"),
                "CONFIG_OUTPUT_DIR": str(tmp_path / f"ckpt_{name}"),
                "RAY_TMP_DIR": f"{job['RAY_TMP_DIR']}/{name}",
                "FAKE_TRAINER_LOG": str(tmp_path / f"seen_{name}"),
            }
        )
        envs.append(env)
        # Held at first: the stale server goes on the port the first job's id gives it before the job starts.
        jobs.append(submit(env, out=tmp_path / f"job_{name}.out", options=(*NODE_SIZE, "--nodelist=n1", "--hold")))
    stale_port = node.plan_ports(jobs[0].id, 0, 1)["reward_port"]
    stale = start_http_server(
        [
            sys.executable,
            str(REPO / "reward_score" / "reward_server.py"),
            "--model-path",
            str(tiny_models.reward_model),
            "--device",
            "cpu",
            "--port",
            str(stale_port),
        ],
        tmp_path / "stale.log",
        stale_port,
        env=dict(os.environ, REWARD_SERVER_TOKEN="an-old-jobs-token"),
    )
    try:
        for j in jobs:
            j.scontrol("release", j.id)
        for j, env in zip(jobs, envs, strict=True):
            j.wait_for("its trainer's start", Path(env["FAKE_TRAINER_LOG"]).exists, 400)
        go.write_text("both trainers run")
        done = [j.wait() for j in jobs]
    finally:
        stale.stop()
    outs = [j.output() for j in jobs]
    assert [f["JobState"] for f in done] == ["COMPLETED", "COMPLETED"], "\n\n".join(o[-3000:] for o in outs)
    assert [f["NodeList"] for f in done] == ["n1", "n1"]
    first, second = seen(envs[0]), seen(envs[1])
    ends = [json.loads(Path(env["FAKE_TRAINER_LOG"] + ".end").read_text()) for env in envs]
    assert ends == [{"reward_health": [200]}] * 2, "each trainer ran until both had started, its server still ours"
    urls = [first["REWARD_SERVER_URLS"], second["REWARD_SERVER_URLS"]]
    rays = [next(a for a in t["argv"] if a.startswith("+ray_kwargs.ray_init.address=")) for t in (first, second)]
    assert len(set(urls)) == 2 and len(set(rays)) == 2, (urls, rays)
    assert f":{stale_port}" not in urls[0], "the stale server's port is never ours"
    assert "usual ports on n1 are taken: moved 1 block(s) on" in outs[0]
    # A 200 to each job's own token: the other job's server, or the stale one, would have answered 401.
    assert first["reward_health"] == [200] and second["reward_health"] == [200]
    assert (first["ray_nodes"], second["ray_nodes"]) == (1, 1), "each trainer sees only its own Ray cluster"
    for env in envs:
        assert_everything_stopped(env)


def test_two_nodes_with_a_separate_reward_node_serve_rewards_from_the_last_node_only(job, submit, tmp_path):
    env = job | FAST | {"CONFIG_USE_SEPARATE_REWARD_NODE": "true", "REWARD_REPLICAS": "2"}
    j = submit(env, out=tmp_path / "job.out", options=TWO_NODES)
    fields = j.wait()
    out = j.output()
    assert fields["JobState"] == "COMPLETED" and fields["NodeList"] == "n[1-2]", out[-4000:]
    trainer = seen(env)
    assert trainer["ray_nodes"] == 1 and "trainer.nnodes=1" in trainer["argv"], "the reward node trains nothing"
    port = int(env["CONFIG_REWARD_SERVER_PORT"])
    assert trainer["REWARD_SERVER_URLS"] == f"http://127.0.0.1:{port},http://127.0.0.1:{port + 1}"
    assert trainer["reward_health"] == [200, 200]
    names = {p.name for p in logs_of(env, j).iterdir()}
    assert {f"reward_server_n2_{port}.log", f"reward_server_n2_{port + 1}.log"} <= names, names
    assert "[rank 1] reward node n2 (127.0.0.1): 2 server(s), no training" in out
    assert_everything_stopped(env)


@pytest.mark.parametrize(
    "broken, needles",
    [
        # rank 1's `ray start` hangs without joining: the head's wait ends at its deadline with the counts
        ("exec sleep 600", ["1/2 nodes, 1/2 GPUs after 40 s", "not every node joined the Ray cluster"]),
        # rank 1's `ray start` fails: the worker gives up after its retries, srun stops the head, which says why
        ("exit 1", ["ray start failed (attempt 2/2)", "[rank 0] could not join the Ray head at"]),
    ],
    ids=["hangs", "fails"],
)
def test_a_worker_that_never_joins_fails_the_job_saying_why(job, submit, tmp_path, fake_container, broken, needles):
    real_ray = Path(sys.executable).with_name("ray")
    ray = fake_container.bin_dir / "ray"  # everything else is the real ray
    ray.write_text(f'#!/bin/sh\n[ "$SLURM_PROCID" = 1 ] && [ "$1" = start ] && {broken}\nexec "{real_ray}" "$@"\n')
    ray.chmod(0o755)
    env = job | FAST | {"RAY_JOIN_TIMEOUT": "40", "RAY_START_RETRIES": "2"}  # 40 s: a loaded machine starts Ray slowly
    j = submit(env, out=tmp_path / "job.out", options=TWO_NODES)
    fields = j.wait()
    out = j.output()
    assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "1:0"), out[-4000:]
    for needle in needles:
        assert needle in out, out[-4000:]
    assert "ray_worker_n2.log" in out, "the error points at the worker's log"
    assert not Path(env["FAKE_TRAINER_LOG"]).exists()
    assert_everything_stopped(env)


def test_a_reward_nodes_server_that_dies_stops_the_head_with_the_same_message(job, submit, tmp_path):
    """The watchdog runs on every node: the reward node's failure (no restarts allowed here) reaches the head, which
    srun stops, through the job's folder."""
    env = (
        job
        | FAST
        | {
            "CONFIG_USE_SEPARATE_REWARD_NODE": "true",
            "REWARD_REPLICAS": "1",
            "FAKE_TRAINER_SLEEP": "300",
            "REWARD_RESTARTS": "0",
        }
    )
    j = submit(env, out=tmp_path / "job.out", options=TWO_NODES)
    j.wait_for_file(Path(env["FAKE_TRAINER_LOG"]), 240)
    (server,) = [p for p in job_processes(logs_of(env, j)) if "reward_server.py" in p]
    os.kill(int(server.split()[0]), signal.SIGKILL)
    fields = j.wait(120)
    out = j.output()
    port = env["CONFIG_REWARD_SERVER_PORT"]
    died = f"reward server (port {port}) on n2 died (log: {logs_of(env, j)}/reward_server_n2_{port}.log)"
    assert fields["JobState"] == "FAILED", out[-4000:]
    assert f"[rank 1] {died}" in out and f"[rank 0] {died}" in out, out[-4000:]
    assert_everything_stopped(env)


def test_a_failed_check_ends_the_job_failed_with_the_message_in_its_output_file(job, submit, tmp_path):
    """The checks run inside the allocation too (the settings may differ from the login node's): a GPU count that
    disagrees with Slurm's, a setting the Python preflight refuses, a save deadline that only a job has, and fewer
    CPUs per task than verl's trainer holds on a node (sbatch's option over the header's; verl's own trainer)."""
    gpus = submit(job, out=tmp_path / "gpus.out", options=("--mem=3G", "--cpus-per-task=2", "--gpus-per-node=2"))
    verl = {k: v for k, v in job.items() if k != "RAY_NUM_CPUS"} | {
        "TRAINER_LAUNCHER": "python3",
        "TRAINER_IS_VERL": "1",
    }
    cpus = submit(verl, out=tmp_path / "cpus.out", options=("--mem=3G", "--cpus-per-task=1", "--gpus-per-node=1"))
    unknown = submit(job | {"ALGORITHM": "reinforce"}, out=tmp_path / "unknown.out")
    # the requeue at the header's signal (900 s before the limit) would come before verl's expiry
    early = submit(job | {"CHECKPOINT_BEFORE_END": "600"}, out=tmp_path / "early.out")
    for j, needle in (
        (gpus, "Slurm gave 2 GPUs per node but CONFIG_GPUS_PER_NODE=1: make #SBATCH --gpus-per-node match"),
        (unknown, "setting error: ALGORITHM='reinforce': use one of grpo, ppo, dapo"),
        (early, "setting error: CHECKPOINT_BEFORE_END=600 is not above the time-limit signal's lead (900 s"),
        # async SGLang on 1 GPU: the TaskRunner, a CPU beside the GPU and one for the server
        (cpus, "RAY_NUM_CPUS=1 Ray CPUs per node (the job's --cpus-per-task), but verl 0.6.1 holds 3 on a node"),
    ):
        fields = j.wait()
        out = j.output()
        assert (fields["JobState"], fields["ExitCode"]) == ("FAILED", "1:0"), out[-3000:]
        assert needle in out and "=== launching on" not in out, out[-3000:]
    assert not Path(job["FAKE_TRAINER_LOG"]).exists()


def test_a_job_submitted_from_outside_the_repository_fails_naming_the_folder_to_submit_from(
    job, submit, tmp_path, clone
):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "logs").mkdir(parents=True)  # else Slurm could not even open the output file
    j = submit(job, script=str(clone / RUN.name), cwd=elsewhere)
    fields = j.wait()
    out = j.output()
    assert j.out == elsewhere / "logs" / f"grpo-qwen3-4b-{j.id}.out"
    assert fields["JobState"] == "FAILED", out
    assert f"ERROR: submitted from {elsewhere}, which is not the repository: cd to the repository, then sbatch" in out


def test_the_local_cluster_script_is_idempotent_and_reports_both_nodes(slurm_cluster):
    script = REPO / "tests" / "slurm" / "local_slurm.sh"
    again = subprocess.run(["bash", str(script), "start"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "ready:" in again.stdout, again.stdout + again.stderr
    status = subprocess.run(["bash", str(script), "status"], capture_output=True, text=True, timeout=60)
    assert status.returncode == 0, status.stdout
    assert "n1 idle" in status.stdout or "n1 mix" in status.stdout or "n1 alloc" in status.stdout, status.stdout
    assert "gpu:4" in status.stdout


def test_ppo_with_two_pipeline_stages_on_two_nodes_trains_verls_megatron_actor_and_critic_and_both_merge(
    job, submit, tmp_path
):
    """The article's backend across the local Slurm's two nodes: PPO (GAE with verl's Megatron critic) with ACTOR_PP=2,
    so each node's Ray worker holds one pipeline stage of the actor, the reference and the critic
    (cpu/megatron_shims.py;
    gloo where NCCL would be). Two steps with a save each; then `sbatch merge_mcore_to_hf.sh` twice: the actor's PP=2
    dist checkpoint through verl's Megatron merger, and the critic's own Hugging Face save (critic.checkpoint
    .save_contents with hf_model, docs/merge.md) into a value model by launch/merge/critic_to_hf.py."""
    calls = tmp_path / "user_function_calls.txt"
    user = tmp_path / "my_reward.py"  # the user's own rule (verl's custom_reward_function contract), alone: no server
    user.write_text(
        f"def length_rule(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    with open({str(calls)!r}, 'a') as f:\n        f.write(data_source + '\\n')\n"
        f"    return (len(solution_str) + len(str(ground_truth))) % 7 / 6\n"
    )
    env = (
        job
        | FAST
        | MEGATRON_TRAINER
        | gsm8k_rule_data(tmp_path)
        | {
            "ALGORITHM": "ppo",
            "ACTOR_PP": "2",
            "FUSED_KERNELS": "on",  # auto keeps verl's logits where they fit (the Megatron plan): the kernels asked for
            "TRAINER_LOGGER": "[console]",
            "REWARD": "rule",
            "REWARD_FUNCTION_PATH": str(user),
            "REWARD_FUNCTION_NAME": "length_rule",
        }
    )
    args = real_trainer_args(
        "trainer.total_training_steps=2",
        "trainer.test_freq=-1",
        "critic.checkpoint.save_contents=[model,optimizer,extra,hf_model]",
        strategy="megatron",
    )
    j = submit(env, *args, out=tmp_path / "job.out", options=(*TWO_NODES, "--time=30"))
    fields = j.wait(1200)
    out = j.output()
    assert (fields["JobState"], fields["ExitCode"], fields["NodeList"]) == ("COMPLETED", "0:0", "n[1-2]"), out[-5000:]
    logs = logs_of(env, j)
    command = (logs / "trainer_command.txt").read_text().splitlines()
    # FUSED_KERNELS=on at PP=2 with the tied tiny policy: for the actor and the reference (its `+` key), each pipeline
    # stage's last through cpu/megatron_shims.py's stand-in for verl's Triton kernel
    for override in (
        "algorithm.adv_estimator=gae",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "critic.megatron.pipeline_model_parallel_size=2",
        "trainer.nnodes=2",
        "actor_rollout_ref.model.use_fused_kernels=True",
        "+actor_rollout_ref.ref.use_fused_kernels=True",
    ):
        assert override in command, command
    assert "preflight: verl's fused log-prob kernels on (FUSED_KERNELS=on)" in out, out[-5000:]
    trainer_log = (logs / "trainer.log").read_text()
    assert megatron_shims.FUSED_STAND_IN_LINE in trainer_log, trainer_log[-3000:]
    steps = {int(n): line for n, line in re.findall(r" step:(\d+) - (.*)", trainer_log) if "timing_s/step:" in line}
    assert sorted(steps) == [1, 2], trainer_log[-3000:]
    for line in steps.values():
        assert float(re.search(r"critic/grad_norm:([-\d.e]+)", line).group(1)) > 0, "the critic learned"
        assert float(re.search(r"actor/grad_norm:([-\d.e]+)", line).group(1)) > 0
    # issue 59: REWARD=rule with the user's function: verl's workers called it on each response, no server started
    assert calls.read_text().splitlines().count("openai/gsm8k") >= 4, "2 steps x 2 responses, scored by the function"
    assert "no reward server (REWARD=rule)" in out and not list(logs.glob("reward_server_n*")), out[-3000:]
    step = Path(env["CONFIG_OUTPUT_DIR"]) / "global_step_2"
    for role in ("actor", "critic"):
        assert (step / role / "dist_ckpt" / "metadata.json").is_file(), f"megatron-core's dist checkpoint of the {role}"
    assert (step / "critic" / "huggingface" / "config.json").is_file()
    assert_everything_stopped(env)

    merges = {}
    for role in ("actor", "critic"):
        target = tmp_path / f"hf_{role}"
        m = submit(
            env | {"ROLE": role, "TARGET_DIR": str(target)},
            script="merge_mcore_to_hf.sh",
            out=tmp_path / f"merge_{role}.out",
            options=("--mem=3G", "--cpus-per-task=1", "--gpus-per-node=1"),
        )
        fields = m.wait(600)
        merges[role] = m.output()
        assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), merges[role][-4000:]
        assert (target / "config.json").is_file() and f"done: {target}" in merges[role]
    assert "-m verl.model_merger merge --backend megatron" in merges["actor"], "verl's merger, both stages in one"
    assert "verified " in merges["actor"] and "tied embeddings, no lm_head" in merges["actor"]
    assert "-> score.weight" in merges["critic"] and "value model, value head score.weight [1, 64]" in merges["critic"]
    # issue 57: each merge's numeric check against the PP=2 dist checkpoint read without verl's merger
    assert "numeric check passed: max |d log-prob|" in merges["actor"], merges["actor"][-3000:]
    assert "numeric check passed: max |d value|" in merges["critic"], merges["critic"][-3000:]


def test_a_worker_hung_in_a_phase_is_stopped_with_its_stacks_requeued_once_and_failed_when_the_hang_comes_back(
    job, submit, tmp_path
):
    """verl's own trainer on the CPU, with tests/stall_hook.py in its Ray workers: slow but progressing first (the
    first step's loading, step 2's validation and step 3's save each take 35 s more, longer than STALL_FLOOR=30 s:
    never stopped), then update_actor blocks for ever at its 5th call (step 5), alive and silent as a collective that
    never returns. The head's watchdog keeps every worker's stack, says the step and phase, stops the start, and the
    job requeues once; the requeued start resumes from step 3's save (its hook counts again: its loading and step 6's
    save are 35 s slower, neither stopped) and hangs again at its 4th update_actor (step 7, which neither validates nor
    saves: its budget is 3 x the longest step, not a validation's): the job ends failed. Nothing of either start is
    left. The generation's delay is the first start's alone: its 3rd call
    there is step 2's validation, in the requeued start step 5's rollout, a plain step whose budget is 3 x the longest
    step, the 30 s floor where steps take seconds: a stall by the rule (CI's unloaded run stopped it there)."""
    marker = tmp_path / "hangs"
    plan = "init_model:sleep=35:1,generate_sequences:sleep=35:3@0,save_checkpoint:sleep=35:1,update_actor:block:5@0,"
    plan += "update_actor:block:4@1"
    env = (
        job
        | FAST
        | REAL_TRAINER
        | {
            "STALL_TIMEOUT": "auto",
            "STALL_FLOOR": "30",
            "STALL_FIRST_STEP": "400",
            "STALL_REQUEUE": "1",
            "TEST_FREQ": "2",
            "SAVE_FREQ": "3",
            "TOTAL_EPOCHS": "10",
            "STALL_TEST_PLAN": plan,
            "STALL_TEST_MARKER": str(marker),
            verl_shims.THEN_HOOK: stall_hook.HOOK,
            "REWARD": "rm+rule",
            "REWARD_RULE_WEIGHT": "2",
            **dapo_rule_data(tmp_path),  # issue 59: both judges, mixed
        }
    )
    args = real_trainer_args("trainer.total_training_steps=20")
    j = submit(env, *args, out=tmp_path / "job.out", options=(*NODE_SIZE, "--time=60"))
    fields = j.wait_until("requeued or ended", lambda f: f.get("Restarts") == "1" or f["JobState"] in FINISHED, 1200)
    first = j.output()
    assert fields["Restarts"] == "1", first[-5000:]
    logs = logs_of(env, j)
    stall = json.loads((logs / "stall.json").read_text())
    assert (stall["step"], stall["phase"]) == (5, "update_actor"), stall
    assert "WorkerDict.actor_rollout_update_actor" in stall["tasks"], stall
    stacks_files = sorted((logs / "stall").glob("stacks_n*.txt"))  # one node: n1 or n2, wherever Slurm put the job
    assert len(stacks_files) == 1, stacks_files
    stacks = stacks_files[0].read_text()
    assert "stall_test_blocked_forever" in stacks and "update_actor" in stacks, stacks[-3000:]
    assert "--- last 30 lines of" in stacks and "=== GPUs (nvidia-smi) ===" in stacks
    said = re.search(
        r"\[rank 0\] the trainer stalled: no training step finished for \d+ s, past the budget of (\d+) s"
        r" \(STALL_TIMEOUT=auto: .*\): hung in step 5, phase update_actor .*: " + re.escape(str(logs / "stall")),
        first,
    )
    assert said, first[-5000:]
    assert f"the trainer stalled: requeueing job {j.id} once (STALL_REQUEUE=1)" in first, first[-3000:]
    # no false positive: steps 1-4 ran on, the slow ones included
    steps = parse_step_lines((logs / "trainer.log").read_text())
    assert sorted(n for n, m in steps.items() if is_training_step(m)) == [1, 2, 3, 4], first[-3000:]
    assert steps[2]["timing_s/testing"] >= 35 and steps[3]["timing_s/save_checkpoint"] >= 35, steps
    # REWARD=rm+rule through verl's real trainer: each validation logs both parts (verl's reward_extra_info) and the
    # score it trained on is 1 x the reward model's + 2 x the rule's (means are linear: the same sum of the means).
    # The rule is verl's DAPO math scorer, which gives the tiny policy's wrong answers -1: a part that scored.
    for n in (2, 4):
        part = {k.split("/")[-2]: v for k, v in steps[n].items() if k.startswith("val-") and k.endswith("/mean@1")}
        assert {"reward", "rm_score", "rule_score"} <= set(part), steps[n]
        assert part["rule_score"] == -1 and part["reward"] == pytest.approx(part["rm_score"] - 2, abs=1e-3), part
    assert_everything_stopped(env, logs=logs)

    # The test does not wait out Slurm's hold (Reason=BeginTime), only the second of the requeue: slurmd refuses a
    # job's credential issued within the second its old one was revoked ("Job credential revoked": FAILED at once).
    ended = time.mktime(
        time.strptime(re.findall(r"^\[([\d-]+ [\d:]+)\] run_grpo\S+ exiting", first, re.M)[-1], "%Y-%m-%d %H:%M:%S")
    )
    j.wait_until(
        "held for the requeue",
        lambda f: f["JobState"] == "PENDING" and f["Reason"] == "BeginTime" and time.time() > ended + 2,
        120,
    )
    j.scontrol("update", f"JobId={j.id}", "StartTime=now")
    fields = j.wait(1200)
    out = j.output()
    second = out[len(first) :]
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("FAILED", "1:0", "1"), second[-5000:]
    assert "Setting global step to 3" in (Path(f"{logs}-r1") / "trainer.log").read_text()
    again = json.loads((Path(f"{logs}-r1") / "stall.json").read_text())
    assert (again["step"], again["phase"]) == (7, "update_actor"), again
    assert f"the trainer stalled in two starts in a row ({logs}, then this one): not requeueing" in second, second[
        -3000:
    ]
    assert_everything_stopped(env, logs=Path(f"{logs}-r1"))
    shown = subprocess.run(
        [sys.executable, "-m", "launch.watch.status", j.id, "--log-dir", env["CONFIG_LOG_DIR"]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert "stalled" in shown.stdout and "hung in step 7, phase update_actor" in shown.stdout, shown.stdout

    # from each hang (the hook's own time) to its start's end (the run script's last line)
    hangs = [float(line.split()[1]) for line in marker.read_text().splitlines()]
    ends = [
        time.mktime(time.strptime(m, "%Y-%m-%d %H:%M:%S"))
        for m in re.findall(r"^\[([\d-]+ [\d:]+)\] run_grpo_qwen3_4b_mega_verl\.sh exiting", out, flags=re.M)
    ]
    assert len(hangs) == 2 and len(ends) == 2, (hangs, ends)
    for hang, end, record in zip(hangs, ends, (stall, again), strict=True):
        took = end - hang
        print(f"hang to the start's end: {took:.0f} s (budget {record['budget']} s)")
        assert took < record["budget"] + 120, "the budget, the stacks and the stop"
