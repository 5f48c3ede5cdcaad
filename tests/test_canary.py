"""The canary (CANARY=1): train 2 steps, resume, merge, and one summary, through the real run script.

The container, the trainer and the merger are stand-ins (tests/fakes): the trainer imitates what verl 0.6.1's fit
loop prints and writes (resume messages, step lines, checkpoint layout), so the canary's checks read the same text
they will read on a cluster. Slurm (for the job through sbatch), reward servers, Ray, the preflight,
merge_mcore_to_hf.sh and launch.merge.verify_hf are real."""

import json
import os
import sys
from pathlib import Path

import pytest

from launch.plan.refusals import check
from launch.plan.settings import Settings
from launch.watch import canary
from tests.support import REPO, block_environment, run
from tests.test_run_time import OWN_PORTS, RefusingProxy

# The settings block's own defaults (as run_grpo_qwen3_4b_mega_verl.sh exports them), with placeholder paths.
DEFAULTS = block_environment() | dict(
    CONTAINER="none",
    CONFIG_IMAGE_PATH="x.sif",
    CONFIG_MODEL_PATH="m",
    CONFIG_REWARD_MODEL_PATH="r",
    CONFIG_TRAIN_FILE="train.parquet",
    CONFIG_TEST_FILE="test.parquet",
    CONFIG_OUTPUT_DIR="ckpt",
)


# A whole canary (two launches of the stand-in trainer with their Ray, the merge): ~1 min alone, several beside the slow
# tier's other tests on 2 cores. A deadline for a hang, not a speed check.
CANARY_TIMEOUT = 900


def settings(**overrides) -> Settings:
    return Settings.from_env(DEFAULTS | {k: str(v) for k, v in overrides.items()})


# --- the workload ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, expected",
    [
        ({}, 2),  # the reference job: 2 x 4 responses = 8, one per agent-loop worker, 4 per data-parallel rank
        ({"ROLLOUT_MODE": "sync", "CONFIG_GPUS_PER_NODE": 1, "ACTOR_PP": 1}, 1),  # 4 responses on one GPU
        # micro-batches go by tokens on Megatron too: no rank needs a whole number of MICRO_BATCH_PER_GPU sequences
        ({"ROLLOUT_MODE": "sync", "CONFIG_GPUS_PER_NODE": 8, "ACTOR_PP": 1}, 2),  # 8 ranks, one response each
        ({"SLURM_NNODES": 2, "ROLLOUT_N": 1}, 8),  # 8 GPUs and 8 agent-loop workers: one response each
        (
            {
                "TRAINER_MODE": "one_step_off",
                "STRATEGY": "fsdp2",
                "ROLLOUT_MODE": "sync",
                "ROLLOUT_GPUS_PER_NODE": 2,
                "ROLLOUT_ENGINE": "vllm",
            },
            2,  # 8 responses: 4 per training GPU (one FSDP micro-batch, as verl asserts), 4 per rollout GPU
        ),
    ],
)
def test_the_canary_batch_is_the_fewest_prompts_every_rank_and_worker_gets_an_equal_share(overrides, expected):
    s = settings(**overrides)
    b = canary.batch_size(s)
    assert b == expected
    assert not check(
        Settings.from_env(
            DEFAULTS
            | {k: str(v) for k, v in overrides.items()}
            | {"TRAIN_BATCH_SIZE": str(b), "PPO_MINI_BATCH_SIZE": str(b)}
        ),
        check_paths=False,
    )


def test_the_canary_keeps_the_users_combination_and_shrinks_only_the_workload():
    s = settings(ALGORITHM="dapo", OVERLONG_BUFFER_LEN=1024)
    out = canary.canary_settings(s)
    assert out["SAVE_FREQ"] == "1" and out["TEST_FREQ"] == "2"
    assert out["EXPERIMENT_NAME"] == "qwen3_4b_grpo_megatron_canary", "never the real run's experiment"
    assert out["TRAINER_LOGGER"] == "[console]", "no wandb run is touched"
    # the user's response length and all that depends on it: the clip ratio it reports is the real run's
    kept = {
        "ALGORITHM",
        "TRAINER_MODE",
        "STRATEGY",
        "ACTOR_PP",
        "ACTOR_TP",
        "ROLLOUT_TP",
        "ROLLOUT_N",
        "MAX_RESPONSE_LENGTH",
        "OVERLONG_BUFFER_LEN",
        "MICRO_BATCH_PER_GPU",
    }
    assert not kept & set(out)
    dynamic = settings(ALGORITHM="dapo", DAPO_DYNAMIC_SAMPLING="true", ROLLOUT_MODE="sync")
    assert "data.train_max_samples=-1" in canary.stage_overrides("train", dynamic)
    resume = canary.stage_overrides("resume", settings(TRAIN_BATCH_SIZE=2))
    assert "trainer.total_training_steps=3" in resume and "data.train_max_samples=6" in resume
    assert "trainer.resume_mode=auto" in resume and "trainer.test_freq=-1" in resume


# --- reading verl's output -------------------------------------------------------------------------------------

# As verl 0.6.1's console logger prints them: the main trainer's (ray_trainer.py:1274-1293) and recipe.dapo's, which
# logs no training/global_step (dapo_ray_trainer.py:392-406); both time the step (timing_s/step).
STEP_1 = (
    "\x1b[36m(TaskRunner pid=4711)\x1b[0m step:1 - training/global_step:1 - training/epoch:0 - critic/score/mean:0.5"
    " - timing_s/step:41.2"
)
STEP_3 = "(TaskRunner pid=4711) step:3 - training/global_step:3 - training/epoch:0 - timing_s/step:40.8"
DAPO_STEP_2 = (
    "(TaskRunner pid=4711) step:2 - val-core/safe_hack/reward/mean@1:0.25 - critic/score/mean:0.5"
    " - timing_s/gen:20.1 - timing_s/step:44.0 - timing_s/testing:12.0 - train/num_gen_batches:1"
)


def checkpoint(root: Path, *steps: int) -> Path:
    for step in steps:
        (root / f"global_step_{step}" / "actor").mkdir(parents=True)
    (root / "latest_checkpointed_iteration.txt").write_text(str(steps[-1]))
    return root


def test_step_lines_are_read_through_rays_actor_prefix_and_colours():
    text = "\n".join(["Training Progress:  50%|#####     | 1/2", STEP_1, "step:2 is not a logger line", STEP_3])
    assert sorted(canary.logged_steps(text)) == [1, 3]


def test_step_lines_are_read_from_every_entry_point_and_a_validation_only_line_is_no_step():
    val_before_train = "(TaskRunner pid=4711) step:0 - val-core/safe_hack/reward/mean@1:0.1 - val-aux/x:0.2"
    text = "\n".join(
        [val_before_train, STEP_1.replace(" - training/global_step:1 - training/epoch:0", ""), DAPO_STEP_2]
    )
    steps = canary.logged_steps(text)
    assert sorted(steps) == [1, 2], "recipe.dapo's lines hold no training/global_step"
    assert any(key.startswith("val-core/") for key in steps[2])


def test_a_resume_passes_only_at_step_2_with_one_more_step_saved(tmp_path):
    ckpt = checkpoint(tmp_path, 1, 2, 3)
    resumed = f"(TaskRunner pid=1) Load from checkpoint folder: {ckpt}/global_step_2\n"
    ok = resumed + "(TaskRunner pid=1) Setting global step to 2\n" + STEP_3
    assert canary.check_resume(ok, ckpt) == []
    scratch = "(TaskRunner pid=1) Training from scratch\n" + "\n".join([STEP_1, STEP_1.replace(":1", ":2"), STEP_3])
    (problem, steps) = canary.check_resume(scratch, ckpt)
    assert "started from step 0 ('Training from scratch')" in problem and "logged steps [1, 2, 3]" in steps
    wrong = resumed + "Setting global step to 1\n" + STEP_3.replace(":3", ":2")
    assert "resumed at step 1, expected 2" in canary.check_resume(wrong, ckpt)[0]
    assert "global_step_3/actor is missing" in canary.check_resume(ok, checkpoint(tmp_path / "b", 1, 2))[0]


def test_a_merge_passes_stage_3_only_with_its_numeric_check_passed_or_skipped_by_setting(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    verified = "verified /x: 26 tensors\n"
    passed = "numeric check passed: max |d log-prob| 1.9e-06, mean 6.5e-07, top-1 changed on 0.0% of 182 probe tokens\n"
    assert canary.check_merge(verified + passed, tmp_path) == []
    assert canary.check_merge(verified + "numeric check skipped (NUMERIC_CHECK=0): ...", tmp_path) == []
    not_run = "numeric check not run: MistralForCausalLM: ...: the result is verified for its structure only"
    assert canary.check_merge(verified + not_run, tmp_path) == [], "a model the check cannot build: said, no failure"
    (problem,) = canary.check_merge(verified, tmp_path)
    assert "launch.merge.check_numeric did not report" in problem


def test_training_without_validation_or_a_save_per_step_fails_stage_1(tmp_path):
    steps = [STEP_1, STEP_1.replace(":1", ":2")]
    assert "no validation metrics" in canary.check_train("\n".join(steps), checkpoint(tmp_path, 1, 2))[0]
    validated = steps[:1] + [steps[1] + " - val-core/safe_hack/reward/mean@1:0.25"]
    assert canary.check_train("\n".join(validated), tmp_path) == []
    (missing,) = canary.check_train("\n".join(validated), checkpoint(tmp_path / "b", 2))
    assert "global_step_1/actor is missing" in missing, "a save after every step, not only the last"


def test_the_summary_shows_each_failure_with_its_log_and_lines_and_the_stages_it_skipped():
    results = {
        "train": {"stage": "train", "status": "passed", "seconds": 300},
        "resume": {
            "stage": "resume",
            "status": "failed",
            "seconds": 90,
            "reason": "verl started from step 0",
            "log": "/logs/777/canary/resume/launch.log",
            "lines": ["Training from scratch"],
        },
    }
    table, ok = canary.summary(results)
    assert not ok
    lines = table.splitlines()
    assert any(line.startswith("1 train 2 steps, save each") and "passed" in line and "300 s" in line for line in lines)
    assert any(line.startswith("2 resume at step 2, run step 3") and "FAILED" in line for line in lines)
    assert "log: /logs/777/canary/resume/launch.log" in table and "| Training from scratch" in table
    assert any(line.startswith("3 merge") and "not run" in line for line in lines)
    assert lines[-1].startswith("canary: FAILED")
    results["resume"] = {"stage": "resume", "status": "passed", "seconds": 90}
    results["merge"] = {"stage": "merge", "status": "passed", "seconds": 60}
    assert canary.summary(results) == (canary.summary(results)[0], True)


def clip_line(step: int, ratio: str) -> str:
    """A step line with verl's response-length metrics (metric_utils.compute_data_metrics), numpy 2's repr included."""
    return (
        f"(TaskRunner pid=4711) step:{step} - response_length/mean:3900.0 - response_length/clip_ratio:{ratio}"
        f" - response_length_non_aborted/clip_ratio:0.0 - timing_s/step:41.0"
    )


def stage_entries(tmp_path: Path, *ratios: str) -> dict[str, dict]:
    """The results of stages 1 and 2 as `check` records them, from step lines with these clip ratios."""
    (tmp_path / "train").mkdir()
    log = tmp_path / "train" / "launch.log"
    log.write_text("\n".join(clip_line(i + 1, r) for i, r in enumerate(ratios)))
    results = tmp_path / "results.jsonl"
    env = block_environment()
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        canary.main(
            [
                "check",
                "train",
                "--rc",
                "1",
                "--seconds",
                "5",
                "--log",
                str(log),
                "--ckpt",
                str(tmp_path),
                "--results",
                str(results),
            ]
        )
    return canary.canary_results(results)


def test_the_summary_reports_verls_clip_ratio_and_warns_when_responses_are_cut_naming_the_setting(tmp_path):
    results = stage_entries(tmp_path, "np.float64(0.625)", "0.75")
    assert results["train"]["clip_ratio"] == {"1": 0.625, "2": 0.75}
    table, _ = canary.summary(results)
    assert (
        "response length: verl's response_length/clip_ratio at MAX_RESPONSE_LENGTH=4096: step 1 0.62, step 2 "
        "0.75 (the share of responses cut at the limit; 69% on average)"
    ) in table
    (warning,) = [line for line in table.splitlines() if line.startswith("WARNING:")]
    assert "69% of responses hit MAX_RESPONSE_LENGTH=4096" in warning and "raise MAX_RESPONSE_LENGTH" in warning
    assert "docs/training.md says what a cut response does to GRPO's signal" in warning


def test_a_low_clip_ratio_is_reported_without_a_warning(tmp_path):
    table, _ = canary.summary(stage_entries(tmp_path, "0.0", "0.03125"))
    assert "2% on average" in table and "WARNING" not in table


def test_the_explaining_lines_end_at_the_last_error_not_at_the_shutdown_noise():
    text = "\n".join(
        ["step ok"] * 30
        + ["Traceback (most recent call last):", "  File x", "RuntimeError: boom"]
        + ["cleanup: stopping ray"] * 20
    )
    lines = canary.explaining_lines(text)
    assert "RuntimeError: boom" in lines and lines[-1] == "cleanup: stopping ray" and len(lines) == 12


# --- the whole canary through the run script -------------------------------------------------------------------


@pytest.fixture
def canary_job(job, tmp_path, fake_container):  # noqa: F811
    merger = fake_container.bin_dir / "fake-merger"
    merger.write_text(  # drops `-m verl.model_merger` as test_merge's does
        f'#!/bin/sh\nshift 2\nexec "{sys.executable}" "{REPO / "tests" / "fakes" / "fake_merger.py"}" "$@"\n'
    )
    merger.chmod(0o755)
    # NUMERIC_CHECK=0: the fake trainer's dist_ckpt/ holds no tensors (make demo runs the check on verl's own)
    return job | {
        "CANARY": "1",
        "MERGER_LAUNCHER": str(merger),
        "FAKE_MERGER_LOG": str(tmp_path / "merger.jsonl"),
        "NUMERIC_CHECK": "0",
    }


def trainer_runs(env) -> list[dict]:
    return [json.loads(line) for line in Path(env["FAKE_TRAINER_LOG"]).read_text().splitlines()]


def merger_calls(env) -> list[list[str]]:
    path = Path(env["FAKE_MERGER_LOG"])
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def canary_logs(env) -> Path:
    (job_dir,) = Path(env["CONFIG_LOG_DIR"]).iterdir()
    return job_dir / "canary"


def files(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def summary_row(output: str, stage: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(canary.STAGES[stage]))


@pytest.fixture
def proxy():
    p = RefusingProxy()
    yield p
    p.close()


def test_the_canary_trains_resumes_and_merges_in_one_job_touches_nothing_of_the_real_run_and_sends_a_proxy_nothing(
    canary_job, tmp_path, tiny_models, proxy
):
    """The run script outside Slurm (a login node, a workstation), as a user with a proxy in the environment and
    MAX_CKPT_TO_KEEP=1 runs it: the whole preflight (the data through verl's dataset, the reward check's server and
    verl's reward loop scoring real rows), then the canary's three stages, which keep every checkpoint they check.
    Merged here (issue 71: one run of the script proves all four) are what were
    - test_run_time.py::test_the_canary_with_a_proxy_sends_it_nothing_and_passes: the proxy saw nothing, the run
      exits 0, "canary: every stage passed";
    - test_run_time.py::test_the_preflight_on_a_login_node_with_a_proxy_sends_it_nothing (a PREFLIGHT_ONLY=1 run):
      the proxy saw nothing, exit 0, "preflight: reward verl's naive reward loop (async rollout) scored 8 validation
      rows" in the output;
    - test_the_canary_passes_whatever_the_entry_point_logs_and_however_few_checkpoints_the_user_keeps
      [keep-one-checkpoint] (MAX_CKPT_TO_KEEP=1: verl's checkpoint manager would delete global_step_1/actor before
      it saves step 2): exit 0, "canary: every stage passed", trainer.max_actor_ckpt_to_keep=0 in both launches."""
    env = proxy.environment(canary_job | OWN_PORTS | {"MAX_CKPT_TO_KEEP": "1", "REWARD_START_TIMEOUT": "90"})
    real = Path(env["CONFIG_OUTPUT_DIR"])
    # The real run, 25 steps in: the canary must neither resume from it nor change it.
    checkpoint(real, 25)
    before = files(tmp_path)
    result = run(env, "trainer.total_training_steps=100", timeout=CANARY_TIMEOUT)
    output = result.stdout + result.stderr
    assert proxy.seen == [], proxy.seen[:5]
    assert result.returncode == 0, output[-4000:]
    assert "preflight: reward verl's naive reward loop (async rollout) scored 8 validation rows" in result.stdout

    first, second = trainer_runs(canary_job)
    canary_ckpt = f"{real}_canary/"
    for seen, steps in ((first, 2), (second, 3)):
        argv = seen["argv"]
        (out,) = [a for a in argv if a.startswith("trainer.default_local_dir=")]
        assert out.startswith(f"trainer.default_local_dir={canary_ckpt}") and out.endswith("/checkpoints")
        assert "trainer.experiment_name=qwen3_4b_grpo_megatron_canary" in argv and "trainer.logger=[console]" in argv
        assert "trainer.save_freq=1" in argv and "data.max_response_length=4096" in argv, "the user's length"
        assert "trainer.max_actor_ckpt_to_keep=0" in argv, "the canary keeps every checkpoint it checks"
        assert argv.index("trainer.total_training_steps=100") < argv.index(f"trainer.total_training_steps={steps}"), (
            "the canary's step count goes after the user's overrides, so it wins"
        )
    logs = canary_logs(canary_job)
    assert "Setting global step to 2" in (logs / "resume" / "launch.log").read_text()
    assert (logs / "train" / "trainer.log").exists() and (logs / "resume" / "trainer.log").exists()
    (merge,) = merger_calls(canary_job)
    assert merge[merge.index("--local_dir") + 1].endswith("/checkpoints/global_step_3/actor")
    assert "verified " in (logs / "merge.log").read_text()
    for stage in canary.STAGES:
        assert " passed " in summary_row(output, stage)
    assert "canary: every stage passed" in output
    assert (logs / "summary.txt").read_text().strip().endswith("canary: every stage passed")
    assert "removing the canary's checkpoints" in output and not Path(canary_ckpt).exists()

    after = files(tmp_path)
    changed = {p for p in after if before.get(p) != after[p]}
    job_logs = str(logs.parent.relative_to(tmp_path))
    records = {"fake_container.jsonl", "trainer_seen.jsonl", "merger.jsonl"}
    outside = {p for p in changed if not p.startswith((job_logs + "/", "home/.cache/")) and p not in records}
    assert not outside, f"the canary wrote outside its folders: {sorted(outside)}"
    assert {p for p in before if p.startswith("ckpt/")} == {p for p in after if p.startswith("ckpt/")}
    assert not (REPO / "hf_models").exists() or not any((REPO / "hf_models").iterdir())


QUICK = {"PREFLIGHT_DATA": "0", "PREFLIGHT_REWARD": "0"}  # the preflight has its own tests
RECIPES = REPO / "tests" / "fixtures" / "verl_v0.6.1_recipes"  # verl 0.6.1's recipes, verbatim (PyPI has none)


def test_the_canary_passes_whatever_the_entry_point_logs(canary_job):
    """recipe.dapo logs `step:N - ...` without training/global_step (dapo_ray_trainer.py:392-406). (However few
    checkpoints the user keeps: the canary's run in test_the_canary_trains_resumes_and_merges_in_one_job...)"""
    overrides = {
        "ALGORITHM": "dapo",
        "DAPO_DYNAMIC_SAMPLING": "true",
        "ROLLOUT_MODE": "sync",
        "CONTAINER": "none",
        "PYTHONPATH": str(RECIPES),
    }
    result = run(canary_job | QUICK | overrides, timeout=CANARY_TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "canary: every stage passed" in output
    first, second = trainer_runs(canary_job)
    assert first["argv"][:2] == ["-m", "recipe.dapo.main_dapo"], "the recipe itself ran"
    assert "training/global_step" not in (canary_logs(canary_job) / "train" / "trainer.log").read_text()
    for seen in (first, second):
        assert "trainer.max_actor_ckpt_to_keep=0" in seen["argv"], "the canary keeps every checkpoint it checks"


@pytest.mark.parametrize(
    "broken, needle",
    [
        ("no_resume", "verl started from step 0 ('Training from scratch')"),
        ("crash_on_resume", "exited with 1"),
    ],
)
def test_a_trainer_that_does_not_resume_fails_stage_2_and_the_job(canary_job, broken, needle):
    result = run(canary_job | QUICK | {"FAKE_TRAINER_BREAK": broken}, timeout=CANARY_TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert " passed " in summary_row(output, "train")
    assert " FAILED " in summary_row(output, "resume") and needle in output
    assert f"log: {canary_logs(canary_job) / 'resume' / 'launch.log'}" in output
    if broken == "crash_on_resume":
        assert "| RuntimeError: could not load the distributed checkpoint" in output, "the lines that explain it"
    assert " passed " in summary_row(output, "merge"), "step 2's checkpoint is still merged and verified"
    assert "kept for inspection" in output


def test_a_merged_model_that_fails_verification_fails_stage_3(canary_job):
    result = run(canary_job | QUICK | {"FAKE_MERGER_BREAK": "missing_shard"}, timeout=CANARY_TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert " passed " in summary_row(output, "resume")
    assert " FAILED " in summary_row(output, "merge")
    # the summary shows the lines up to the error; the whole list, the missing shard first, is in the stage's log
    assert "| verify: missing tensor model.norm.weight [64]" in output and "| verify: FAILED, 13 problem(s)" in output
    log = canary_logs(canary_job) / "merge.log"
    assert f"log: {log}" in output
    assert "verify: shard model-00002-of-00002.safetensors is listed in the index but missing" in log.read_text()


def test_a_trainer_that_fails_in_stage_1_skips_the_stages_that_need_its_checkpoint(canary_job):
    result = run(canary_job | QUICK | {"FAKE_TRAINER_RC": "3"}, timeout=CANARY_TIMEOUT)
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-4000:]
    assert " FAILED " in summary_row(output, "train") and "exited with 3" in output
    assert " skipped " in summary_row(output, "resume") and " skipped " in summary_row(output, "merge")
    assert len(trainer_runs(canary_job)) == 1 and merger_calls(canary_job) == []
    assert os.path.exists(canary_logs(canary_job) / "summary.txt")


def test_canary_1_sbatch_on_two_nodes_passes_every_stage_each_meeting_in_its_own_folder(canary_job, submit, tmp_path):
    """`CANARY=1 sbatch --nodes=2` through the real Slurm: the nodes meet through files in the log folder (cluster.env,
    done), so stage 1's `done` must not stop stage 2's worker before it joins Ray; the table is in the job's output."""
    from tests.real_slurm import NODE_SIZE

    env = canary_job | QUICK
    j = submit(env, out=tmp_path / "canary.out", options=("--nodes=2", *NODE_SIZE, "--time=60"))
    fields = j.wait(600)
    output = j.output()
    assert (fields["JobState"], fields["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
    assert [(seen["ray_nodes"], seen["ray_gpus"]) for seen in trainer_runs(env)] == [(2, 2), (2, 2)]
    assert "canary: every stage passed" in output and "time-limit signal" not in output
    assert (canary_logs(env) / "train" / "done").exists() and (canary_logs(env) / "resume" / "done").exists()


def test_a_bad_setting_stops_the_canary_before_anything_starts_naming_the_setting(canary_job):
    result = run(canary_job | {"CONFIG_GPUS_PER_NODE": "0"})
    assert result.returncode == 1
    assert "CONFIG_GPUS_PER_NODE=0: training needs at least 1 GPU per node" in result.stderr
    assert "=== launching on" not in result.stdout and not Path(canary_job["FAKE_TRAINER_LOG"]).exists()
    assert not Path(canary_job["CONFIG_OUTPUT_DIR"]).exists(), "the real run's folder is not even created"


@pytest.mark.parametrize(
    "overrides",
    [
        {"ALGORITHM": "dapo", "DAPO_DYNAMIC_SAMPLING": "true", "ROLLOUT_MODE": "sync"},
        {
            "TRAINER_MODE": "one_step_off",
            "STRATEGY": "fsdp2",
            "ROLLOUT_MODE": "sync",
            "ROLLOUT_GPUS_PER_NODE": "2",
            "CONFIG_GPUS_PER_NODE": "4",
            "ROLLOUT_ENGINE": "vllm",
        },
    ],
)
def test_the_canary_overrides_compose_with_verls_recipe_configs(canary_job, overrides):
    """The canary runs the user's combination: its overrides must compose with the recipes' configs too."""
    recipes = REPO / "tests" / "fixtures" / "verl_v0.6.1_recipes"
    env = canary_job | QUICK | overrides | {"PREFLIGHT_ONLY": "1", "CONTAINER": "none", "PYTHONPATH": str(recipes)}
    result = run(env)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "composes and passes verl's checks" in result.stdout and "CANARY=1: " in result.stdout
