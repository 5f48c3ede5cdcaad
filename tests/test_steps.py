"""The steps verl will train, counted before anything starts as verl 0.6.1 counts them
(RayPPOTrainer._create_dataloader:
batches with drop_last, times the epochs, or trainer.total_training_steps), zero steps refused and a save that
would only come at the end said. verl's own _create_dataloader is the reference the count is checked against."""

import subprocess
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from launch.plan.preflight import step_plan
from tests.support import REPO
from tests.test_algorithms import composed, env, settings  # noqa: F401  (env: the tiny-model settings fixture)


def verls_count(cfg, rows: int) -> int:
    """trainer.total_training_steps as verl 0.6.1's RayPPOTrainer computes it, on `rows` training prompts."""
    from torch.utils.data import SequentialSampler
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = object.__new__(RayPPOTrainer)
    trainer.config = cfg
    train = [{"row": i} for i in range(rows)]
    trainer._create_dataloader(train, [{"row": 0}], lambda batch: batch, SequentialSampler(train))
    return trainer.total_training_steps


@pytest.mark.parametrize(
    "overrides, extra, rows, expected",
    [
        (
            {"TRAIN_BATCH_SIZE": 8, "PPO_MINI_BATCH_SIZE": 8},
            [],
            30,
            "30 training prompts / 8 a step = 3 steps an "
            "epoch (verl drops the last 6: drop_last) x TOTAL_EPOCHS=1 = 3 steps",
        ),
        (
            {"TRAIN_BATCH_SIZE": 8, "PPO_MINI_BATCH_SIZE": 8, "TOTAL_EPOCHS": 3},
            [],
            16,
            "= 2 steps an epoch (verl drops the last 0: drop_last) x TOTAL_EPOCHS=3 = 6 steps",
        ),
        # an override of the total wins, as in verl (the canary sets one)
        (
            {"TRAIN_BATCH_SIZE": 4, "PPO_MINI_BATCH_SIZE": 4},
            ["trainer.total_training_steps=2"],
            40,
            "; trainer.total_training_steps=2 sets the total: 2 steps",
        ),
    ],
)
def test_the_steps_are_counted_as_verls_own_dataloader_counts_them(env, overrides, extra, rows, expected):  # noqa: F811
    cfg = composed(settings(env, **overrides), extra)
    (line,), _, problems = step_plan(cfg, rows)
    assert expected in line and problems == []
    total = int(line.rsplit(" ", 2)[-2])
    assert total == verls_count(cfg, rows)


def test_too_few_prompts_for_one_step_are_refused_where_verl_would_assert_after_the_queue(env):  # noqa: F811
    """The issue's case: 18 training rows with TRAIN_BATCH_SIZE=256 passed every check, then verl asserted."""
    cfg = composed(settings(env))
    _, _, (problem,) = step_plan(cfg, 18)
    assert "verl would train 0 steps: 18 training prompts are fewer than data.train_batch_size=256" in problem
    assert "set TRAIN_BATCH_SIZE to 18 or less" in problem
    with pytest.raises(AssertionError, match="Train dataloader is empty!"):
        verls_count(cfg, 18)
    _, _, (epochs,) = step_plan(composed(settings(env, TOTAL_EPOCHS=0)), 512)
    assert "verl would train 0 steps (TOTAL_EPOCHS=0)" in epochs


@pytest.mark.parametrize(
    "save_freq, needle",
    [
        (25, "SAVE_FREQ=25 is not below the 3 steps verl will train: its only checkpoint is the last step's"),
        (3, "SAVE_FREQ=3 is not below the 3 steps"),
    ],
)
def test_a_job_that_would_save_nothing_before_its_end_is_warned_about(env, save_freq, needle):  # noqa: F811
    cfg = composed(settings(env, TRAIN_BATCH_SIZE=8, PPO_MINI_BATCH_SIZE=8, SAVE_FREQ=save_freq))
    _, warnings, problems = step_plan(cfg, 24)
    assert problems == [] and any(needle in w for w in warnings), warnings
    assert step_plan(composed(settings(env, TRAIN_BATCH_SIZE=8, PPO_MINI_BATCH_SIZE=8, SAVE_FREQ=2)), 24)[1] == []


@pytest.mark.parametrize(
    "overrides, extra, needle",
    [
        # one batch of prompts: more data, a smaller batch or more epochs
        ({}, [], "train more steps: more prompts, a smaller TRAIN_BATCH_SIZE or TOTAL_EPOCHS above 1"),
        # an override of the total: a larger one
        ({}, ["trainer.total_training_steps=1"], "train more steps: a trainer.total_training_steps above 1"),
    ],
)
def test_the_save_advice_for_a_one_step_run_is_one_a_user_can_follow(env, overrides, extra, needle):  # noqa: F811
    """No SAVE_FREQ saves before the end of a single step (verl saves between steps): 'set SAVE_FREQ below 1' was
    impossible; the advice is more steps, and nothing asks for a SAVE_FREQ below 1."""
    cfg = composed(settings(env, TRAIN_BATCH_SIZE=8, PPO_MINI_BATCH_SIZE=8, SAVE_FREQ=1, **overrides), extra)
    _, (warning,), problems = step_plan(cfg, 8 if not extra else 40)
    assert problems == [] and "verl will train only 1 step" in warning and needle in warning, warning
    assert "below 1" not in warning


def test_the_preflight_refuses_too_little_data_whatever_the_launcher_is_called(env, tmp_path, demo_data):  # noqa: F811
    """A site wrapper, `nsys profile ...` or `py-spy record -- python3` runs verl's trainer as python3 does: the same
    refusal (it used to be a warning for any launcher not named python*). Only TRAINER_IS_VERL=0, which says the
    launcher runs no verl trainer, makes it a warning."""
    rows = pq.read_table(demo_data / "train.parquet").slice(0, 18)
    train = tmp_path / "train18.parquet"
    pq.write_table(rows, train)
    fake_sglang = tmp_path / "engines" / "sglang"  # the engine's import check needs one; the trainer never runs
    fake_sglang.mkdir(parents=True)
    (fake_sglang / "__init__.py").write_text("")
    job = env | {
        "CONFIG_TRAIN_FILE": str(train),
        "CONFIG_TEST_FILE": str(demo_data / "test.parquet"),
        "PREFLIGHT_REWARD": "0",
        "TRAINER_LAUNCHER": "python3",
        "PYTHONPATH": f"{fake_sglang.parent}:{REPO}",
    }

    def preflight(extra_env):
        return subprocess.run(
            [sys.executable, "-m", "launch.plan.preflight"],
            cwd=REPO,
            env=job | extra_env,
            capture_output=True,
            text=True,
            timeout=600,
        )

    refused = preflight({})
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "preflight: steps: 18 training prompts / 256 a step = 0 steps an epoch" in refused.stdout
    assert "preflight: refused: verl would train 0 steps: 18 training prompts are fewer" in refused.stderr
    fits = preflight({"TRAIN_BATCH_SIZE": "8", "PPO_MINI_BATCH_SIZE": "8"})
    assert fits.returncode == 0, fits.stdout[-2000:] + fits.stderr[-3000:]
    assert "= 2 steps an epoch (verl drops the last 2: drop_last) x TOTAL_EPOCHS=1 = 2 steps" in fits.stdout
    assert "SAVE_FREQ=25 is not below the 2 steps" in fits.stderr
    wrapped = preflight({"TRAINER_LAUNCHER": "/opt/site/bin/py-spy-record-verl"})
    assert wrapped.returncode == 1, wrapped.stdout + wrapped.stderr
    assert "preflight: refused: verl would train 0 steps: 18 training prompts are fewer" in wrapped.stderr
    not_verl = preflight({"TRAINER_LAUNCHER": "fake-trainer", "TRAINER_IS_VERL": "0"})
    assert not_verl.returncode == 0, not_verl.stdout[-2000:] + not_verl.stderr[-3000:]
    assert "WARNING: steps: verl would train 0 steps" in not_verl.stderr
    assert "(TRAINER_IS_VERL=0: TRAINER_LAUNCHER runs no verl trainer, so not refused)" in not_verl.stderr
    typo = preflight({"TRAINER_IS_VERL": "no"})
    assert (
        typo.returncode == 1 and "setting error: TRAINER_IS_VERL='no': 1 (TRAINER_LAUNCHER runs verl's" in typo.stderr
    )


def test_the_count_uses_the_rows_verl_keeps_after_its_own_filter(env, tmp_path, demo_data):  # noqa: F811
    """Over-long prompts are dropped by verl's RLHFDataset before it batches: the count is of what is left."""
    table = pq.read_table(demo_data / "train.parquet")
    long = table.to_pylist()[:10]
    for row in long:
        row["prompt"] = [{"role": "user", "content": "word " * 400}]
    train = tmp_path / "with_long.parquet"
    pq.write_table(pa.concat_tables([table, pa.Table.from_pylist(long, schema=table.schema)]), train)
    job = env | {
        "CONFIG_TRAIN_FILE": str(train),
        "CONFIG_TEST_FILE": str(demo_data / "test.parquet"),
        "PREFLIGHT_REWARD": "0",
        "TRAINER_LAUNCHER": "stand-in",
        "TRAINER_IS_VERL": "0",
        "TRAIN_BATCH_SIZE": "4",
        "PPO_MINI_BATCH_SIZE": "4",
        "MAX_PROMPT_LENGTH": "256",
    }
    run = subprocess.run(
        [sys.executable, "-m", "launch.plan.preflight"], cwd=REPO, env=job, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    kept = table.num_rows
    assert f"preflight: steps: {kept} training prompts / 4 a step = {kept // 4} steps an epoch" in run.stdout
