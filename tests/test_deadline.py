"""The save before the time limit (launch/plan/deadline.py): the room verl 0.6.1's window gets for validation and the
save, refusals and warnings when CHECKPOINT_BEFORE_END does not fit the job, and the recipes that never save before
it."""

from pathlib import Path

import pytest

from launch.plan import deadline
from launch.plan.refusals import check, save_deadline_problems
from launch.plan.settings import Settings
from launch.plan.trainer_command import trainer_argv
from tests.support import block_environment

DEFAULTS = block_environment() | dict(
    CONTAINER="none",
    CONFIG_IMAGE_PATH="x.sif",
    CONFIG_MODEL_PATH="m",
    CONFIG_REWARD_MODEL_PATH="r",
    CONFIG_TRAIN_FILE="train.parquet",
    CONFIG_TEST_FILE="test.parquet",
    CONFIG_OUTPUT_DIR="ckpt",
    REWARD_PROMPT_OPENS_THINK="true",  # auto would read the template of a policy that is not here
)
NOW = 1_800_000_000.0
IN_A_JOB = {"SLURM_JOB_ID": "777", "JOB_SIGNAL_LEAD": "900", "JOB_END_TIME": str(int(NOW) + 86400)}
DAPO = {"ALGORITHM": "dapo", "DAPO_DYNAMIC_SAMPLING": "true", "ROLLOUT_MODE": "sync"}


def settings(**overrides) -> Settings:
    return Settings.from_env(DEFAULTS | {k: str(v) for k, v in overrides.items()})


def step_line(step: int, **timing: float) -> str:
    """A step line as verl's console logger prints it (timing_s/* from metric_utils.compute_timing_metrics)."""
    metrics = [f"training/global_step:{step}", "critic/score/mean:0.5", "timing_s/step:300.0"]
    return f"(TaskRunner pid=1) step:{step} - " + " - ".join(metrics + [f"timing_s/{k}:{v}" for k, v in timing.items()])


def earlier_start(logs: Path, name: str, *lines: str) -> None:
    (logs / name).mkdir(parents=True)
    (logs / name / "trainer.log").write_text("\n".join(["Training Progress", *lines]) + "\n")


def test_the_window_gets_room_for_the_longest_validation_and_save_that_earlier_starts_of_the_job_logged(tmp_path):
    logs = tmp_path / "logs"
    earlier_start(logs, "777", step_line(1), step_line(5, testing=95.5, save_checkpoint=210.0))
    earlier_start(logs, "777-r1", step_line(10, testing=120.2), step_line(25, save_checkpoint=180.0))
    earlier_start(logs, "778", step_line(5, testing=9999.0))  # another job: not this one's
    env = {"JOB_LOG_DIR": str(logs / "777-r2"), "JOB_ID": "777"}
    seconds, source = deadline.redundant_time(settings(), env)
    assert seconds == 331, "the longest validation (120.2 s) + the longest save (210 s), rounded up"
    assert "the longest validation (120 s) + the longest save (210 s)" in source and "777-r1/trainer.log" in source


def test_a_first_start_assumes_the_first_guess_and_a_number_set_by_hand_wins(tmp_path):
    env = {"JOB_LOG_DIR": str(tmp_path / "logs" / "777"), "JOB_ID": "777"}
    assert deadline.redundant_time(settings(), env)[0] == deadline.FIRST_GUESS
    assert deadline.redundant_time(settings(ESI_REDUNDANT_TIME=90), env) == (90, "ESI_REDUNDANT_TIME=90")
    assert "ESI_REDUNDANT_TIME='soon': auto or seconds, 0 or more" in check(settings(ESI_REDUNDANT_TIME="soon"), False)
    for value in ("nan", "inf", "-1"):  # float() reads the first two: refused here, not as a ValueError in int() later
        said = check(settings(ESI_REDUNDANT_TIME=value), False)
        assert f"ESI_REDUNDANT_TIME='{value}': auto or seconds, 0 or more" in said


def test_the_main_trainer_gets_the_window_key_and_the_recipes_which_never_check_the_limit_do_not():
    assert "trainer.esi_redundant_time=600" in trainer_argv(settings())
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            "launch.plan.trainer_command.find_recipe",
            lambda name: type("Spec", (), {"submodule_search_locations": ["/r"]}),
        )
        argv = trainer_argv(settings(**DAPO))
    assert not any(a.startswith("trainer.esi_redundant_time=") for a in argv)


@pytest.mark.parametrize(
    "overrides, env, kind, needle",
    [
        # the requeue at the signal (900 s before the limit) would come before verl's expiry
        (
            {"CHECKPOINT_BEFORE_END": 600},
            IN_A_JOB,
            "problem",
            "CHECKPOINT_BEFORE_END=600 is not above the time-limit signal's lead (900 s",
        ),
        # a 20-minute job: the window is over before training starts
        (
            {},
            IN_A_JOB | {"JOB_END_TIME": str(int(NOW) + 1200)},
            "warning",
            "the job has 1200 s left, not more than CHECKPOINT_BEFORE_END=1800: verl's save-before-the-limit window is "
            "over",
        ),
        # 1000 - 900 = 100 s between the expiry and the requeue: a 600 s save does not fit
        (
            {"CHECKPOINT_BEFORE_END": 1000},
            IN_A_JOB,
            "warning",
            "CHECKPOINT_BEFORE_END=1000 leaves 100 s between verl's expiry and the requeue signal",
        ),
        # recipe.dapo never calls should_save_ckpt_esi: said plainly, not promised
        (DAPO, IN_A_JOB, "warning", "recipe.dapo does not save before the time limit"),
        (
            {
                "TRAINER_MODE": "one_step_off",
                "ROLLOUT_MODE": "sync",
                "ROLLOUT_GPUS_PER_NODE": 2,
                "ROLLOUT_ENGINE": "vllm",
            },
            IN_A_JOB,
            "warning",
            "recipe.one_step_off_policy does not save before the time limit",
        ),
        # SAVE_FREQ<=0: no saves at all, said by the plan (the one place that says it)
        ({"SAVE_FREQ": -1}, IN_A_JOB, "line", "SAVE_FREQ<=0: verl saves nothing, before the time limit neither"),
        # the defaults in a day-long job: the plan, no warning
        (
            {},
            IN_A_JOB,
            "line",
            "verl saves after any step that ends within 60 s + its longest step + trainer.esi_redundant_time=600 s of",
        ),
    ],
)
def test_checkpoint_before_end_that_does_not_fit_the_job_is_refused_or_warned_about_with_the_reason(
    overrides, env, kind, needle
):
    problems = save_deadline_problems(settings(**overrides), env)
    lines, warnings = deadline.plan(settings(**overrides), env, now=NOW) if not problems else ([], [])
    found = {"line": lines, "warning": warnings, "problem": problems}
    assert any(needle in text for text in found[kind]), found
    if kind == "line":
        assert warnings == [] and problems == []


# `scontrol show partition -o` and the two lines of `scontrol show config` the run script keeps, as Slurm 22.05 prints
# them for tests/slurm/local_slurm.sh's cluster (debug: never preempted; preemptible: a grace of 120 s; urgent: the top
# PriorityTier, which preempts it)
PARTITIONS = """\
PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A DefaultTime=NONE \
DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=UNLIMITED MinNodes=0 LLN=NO \
MaxCPUsPerNode=UNLIMITED Nodes=n[1-2] PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe=YES:4 \
OverTimeLimit=NONE PreemptMode=OFF State=UP TotalCPUs=16 TotalNodes=2 SelectTypeParameters=NONE JobDefaults=(null) \
DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=16,mem=32000M,node=2,billing=16
PartitionName=preemptible AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO QoS=N/A \
DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=120 Hidden=NO MaxNodes=UNLIMITED MaxTime=UNLIMITED \
MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes=n3 PriorityJobFactor=1 PriorityTier=1 RootOnly=NO ReqResv=NO \
OverSubscribe=NO OverTimeLimit=NONE PreemptMode=REQUEUE State=UP TotalCPUs=8 TotalNodes=1 SelectTypeParameters=NONE \
JobDefaults=(null) DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=8,mem=16000M,node=1,billing=8
PartitionName=urgent AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO QoS=N/A DefaultTime=NONE \
DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED MaxTime=UNLIMITED MinNodes=0 LLN=NO \
MaxCPUsPerNode=UNLIMITED Nodes=n3 PriorityJobFactor=1 PriorityTier=2 RootOnly=NO ReqResv=NO OverSubscribe=NO \
OverTimeLimit=NONE PreemptMode=REQUEUE State=UP TotalCPUs=8 TotalNodes=1 SelectTypeParameters=NONE JobDefaults=(null) \
DefMemPerNode=UNLIMITED MaxMemPerNode=UNLIMITED TRES=cpu=8,mem=16000M,node=1,billing=8
"""
SIGNAL = "PreemptType             = preempt/partition_prio\nSlurmctldParameters     = preempt_send_user_signal"
NO_SIGNAL = "PreemptType             = preempt/partition_prio\nSlurmctldParameters     = enable_configless"


def slurm(partition: str, config: str = SIGNAL, grace: int | None = None) -> dict[str, str]:
    """What the run script exports for a job in `partition`, its GraceTime changed where `grace` is given."""
    partitions = PARTITIONS if grace is None else PARTITIONS.replace("GraceTime=120", f"GraceTime={grace}")
    return {"JOB_PARTITION": partition, "JOB_PARTITIONS": partitions, "JOB_SLURM_CONFIG": config}


@pytest.mark.parametrize(
    ("overrides", "env", "measured", "save_freq", "said"),
    [
        # never preempted: PreemptMode=OFF, or the top PriorityTier (no partition outranks it): today's 25
        (
            {},
            slurm(""),
            None,
            25,
            "partition debug (PreemptMode=OFF, GraceTime=0 s): no preemption requeues or "
            "cancels this job here; SAVE_FREQ=auto: 25",
        ),
        ({}, slurm("urgent"), None, 25, "no preemption requeues or cancels this job here"),
        ({}, {}, None, 25, "not known here (scontrol showed no partition marked default); SAVE_FREQ=auto: 25"),
        # a grace, the signal, and a step that fits (earlier starts measured it): the save comes; 25
        (
            {},
            slurm("preemptible"),
            (9, 3, None),
            25,
            "partition preemptible (PreemptMode=REQUEUE, GraceTime=120 s): a "
            "preemption saves the step it is in (grace 120 s, a step takes ~9 s, then its validation not measured yet, "
            "a "
            "save ~3 s, the stop 20 s; measured by earlier starts); SAVE_FREQ=auto: 25",
        ),
        # a first start: the first guesses (a 600 s step, 600 s for a save) do not fit 120 s: every 2 steps
        (
            {},
            slurm("preemptible"),
            None,
            2,
            "nothing can be saved here: up to 2 steps (~20 min) lost (grace 120 s, a "
            "step takes ~600 s, a save ~600 s, the stop 20 s: 1235 s do not fit; first guesses: nothing measured yet)",
        ),
        # Slurm's default: SIGTERM to every task at the grace's start; 200 s steps, 60 s saves: 8 steps (1660 s)
        (
            {},
            slurm("preemptible", NO_SIGNAL),
            (200, 60, None),
            8,
            "nothing can be saved here: up to 8 steps (~27 min) "
            "lost (no preempt_send_user_signal: every task gets SIGTERM at once",
        ),
        (
            {},
            slurm("preemptible", grace=0),
            (9, 3, None),
            25,
            "nothing can be saved here: up to 25 steps (~4 min) lost (GraceTime=0: Slurm stops the job at once",
        ),
        # issue 70: a 300 s grace, 200 s steps, 60 s saves and a 120 s validation every TEST_FREQ=5 steps
        (
            {},
            slurm("preemptible", grace=300),
            (200, 60, 120),
            7,
            "a preemption saves the step it is in unless that step "
            "validates (every TEST_FREQ=5 steps: grace 300 s, a step takes ~200 s, then its validation ~120 s, a save "
            "~60 "
            "s, the stop 20 s: 415 s do not fit), then up to 7 steps (~26 min) lost",
        ),
        # the recipes never make verl's check; a SAVE_FREQ set by hand stays as set
        (
            DAPO,
            slurm("preemptible"),
            (9, 3, None),
            25,
            "nothing can be saved here: up to 25 steps (~4 min) lost (recipe.dapo never calls verl's save check",
        ),
        ({"SAVE_FREQ": 10}, slurm("preemptible", NO_SIGNAL), (200, 60, None), 10, "up to 10 steps (~33 min) lost"),
        (
            {"PREEMPT_SAVE": 0},
            slurm("preemptible"),
            (9, 3, None),
            25,
            "lost (PREEMPT_SAVE=0; measured by earlier starts)",
        ),
    ],
)
def test_the_preflight_says_in_one_line_what_a_preemption_costs_and_save_freq_auto_bounds_it(
    tmp_path, overrides, env, measured, save_freq, said
):
    logs = tmp_path / "logs"
    if measured:
        step, save, testing = measured
        timing = {"save_checkpoint": save} | ({"testing": testing} if testing else {})
        steps = [step_line(1), step_line(2, **timing)]
        earlier_start(logs, "777", *(line.replace("timing_s/step:300.0", f"timing_s/step:{step}") for line in steps))
    env = env | {"JOB_LOG_DIR": str(logs / "777-r1"), "JOB_ID": "777", "STOP_TIMEOUT": "20"}
    every, lines, warnings = deadline.preemption(settings(**overrides), env)
    assert every == save_freq and len(lines + warnings) == 1, (lines, warnings)
    assert said in (lines + warnings)[0], (lines + warnings)[0]
    assert bool(warnings) == ("lost" in said), "a loss is a warning"


def test_save_freq_auto_reaches_the_trainer_command_and_a_bad_value_is_refused(monkeypatch):
    for name, value in slurm("preemptible", NO_SIGNAL).items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("JOB_LOG_DIR", raising=False)  # a first start: the first guesses, every 2 steps
    assert "trainer.save_freq=2" in trainer_argv(settings())
    assert "trainer.save_freq=10" in trainer_argv(settings(SAVE_FREQ=10))
    assert "SAVE_FREQ='often': auto or a number of steps (0 or less: no saves)" in check(settings(SAVE_FREQ="often"))


# --- through the run script: tests/test_slurm_jobs.py (a requeued start's window from its first start's timings, and a
# CHECKPOINT_BEFORE_END below the signal's lead refused inside the allocation)
