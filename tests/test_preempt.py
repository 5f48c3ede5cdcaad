"""The save on preemption (launch/job/preempt.py): whether a step, its validation and a save fit in the grace left, the
lengths it reads from verl's step lines, the recipes and a verl without the check (no save: the job requeues at once),
and the Ray hook that makes verl's own save-before-expiry check say yes once, after the run's own hook. The job on the
real Slurm: tests/test_slurm_jobs.py::test_a_preempted_job_saves_the_step_it_is_in_..."""

import subprocess
import sys
import types

import pytest
from verl.utils.checkpoint import checkpoint_manager

from launch.job import preempt
from launch.plan.deadline import decide
from launch.plan.trainer_command import USER_HOOK
from tests.support import REPO


@pytest.mark.parametrize(
    ("left", "step", "save", "validation", "saves", "says"),
    [
        (118, 9, 3, None, True, "grace 118 s, a step takes ~9 s, a save ~3 s, the stop 20 s"),  # room to spare
        (58, 20, 3, None, True, "a step takes ~20 s"),  # 20 + 3 + 20 + 15 = 58: just fits
        (57, 20, 3, None, False, "58 s do not fit"),  # one second short
        (120, 600, 120, None, False, "755 s do not fit"),  # the article's job: a 10-min step, a 2-min save
        (118, 9, None, None, True, "a save not measured yet"),  # no save yet in this job: the step and the stop decide
        (30, None, None, None, True, "no step measured yet in this job, so trying"),  # a start's first step: try
        # issue 70: a 300 s grace, 200 s steps, 60 s saves: a step that does not validate fits (295 s)...
        (300, 200, 60, None, True, "grace 300 s, a step takes ~200 s, a save ~60 s, the stop 20 s"),
        # ...one that validates (120 s) first does not: verl validates, then asks its check, then saves
        (300, 200, 60, 120, False, "a step takes ~200 s, then its validation ~120 s, a save ~60 s, the stop 20 s: 415"),
        (300, 200, 60, 0.0, True, "then its validation not measured yet"),  # no validation measured yet: not counted
    ],
)
def test_the_save_is_attempted_only_when_a_step_its_validation_the_save_and_the_stop_fit_in_the_grace(
    left, step, save, validation, saves, says
):
    ok, why = decide(left, step, save, stop=20, validation=validation)
    assert ok is saves and says in why, why


def test_the_lengths_are_the_longest_of_every_start_and_the_step_is_this_starts_last(tmp_path):
    first, second = tmp_path / "77", tmp_path / "77-r1"
    for folder in (first, second):
        folder.mkdir()
    (first / "trainer.log").write_text(
        "(TaskRunner pid=1) step:1 - timing_s/step:12.5 - timing_s/save_checkpoint:np.float64(4.0)\n"
        "(TaskRunner pid=1) step:2 - timing_s/step:30.0 - timing_s/testing:50.0\n"
    )
    (second / "trainer.log").write_text(
        "(TaskRunner pid=2) Total training steps: 10\n"
        "(TaskRunner pid=2) step:3 - timing_s/step:8.0 - timing_s/save_checkpoint:6.5\n"
        "(TaskRunner pid=2) step:4 - timing_s/step:9.0\n"
        "(TaskRunner pid=2) step:5 - val-core/acc:0.5\n"  # a validation-only line is no step
    )
    assert preempt.lengths(second) == (4, 10, {"step": 30.0, "save_checkpoint": 6.5, "testing": 50.0})
    assert preempt.lengths(tmp_path / "78") == (0, None, {}), "a start that logged nothing yet"


@pytest.mark.parametrize(
    ("command", "done", "says"),
    [
        # step 4 validates (TEST_FREQ=2, the command's last value): 20 + 100 + 3 + 20 + 15 = 158 s do not fit in 118 s
        (
            ["trainer.test_freq=5", "trainer.test_freq=2"],
            3,
            "stopping without a save (grace 118 s, a step takes ~20 s, then its validation ~100 s, a save ~3 s, "
            "the stop 20 s: 158 s do not fit)",
        ),
        (["trainer.test_freq=2"], 2, "saving after this step (grace 118 s"),  # step 3 does not validate: 58 s fit
        (["trainer.test_freq=4"], 9, "stopping without a save ("),  # the last step (verl said 10) validates too
        # the recipes never call verl's check: no save can come, so the job requeues at once
        (
            ["python3", "-m", "recipe.dapo.main_dapo", "trainer.test_freq=5"],
            2,
            "stopping without a save (recipe.dapo.main_dapo never calls verl's save check, so nothing saves on the "
            "signal)",
        ),
    ],
)
def test_the_command_line_counts_the_validation_of_the_step_it_is_in_and_never_waits_for_a_recipe(
    tmp_path, capsys, command, done, says
):
    steps = [f"step:{n} - timing_s/step:20.0 - timing_s/save_checkpoint:3.0" for n in range(2, done + 1)]
    first = "step:1 - timing_s/step:20.0 - timing_s/testing:100.0 - timing_s/save_checkpoint:3.0"
    (tmp_path / "trainer.log").write_text("\n".join(["Total training steps: 10", first, *steps]) + "\n")
    (tmp_path / "trainer_command.txt").write_text("\n".join(command) + "\n")
    assert preempt.main([str(tmp_path), "118", "20"]) == (0 if says.startswith("saving") else 1)
    assert capsys.readouterr().out.startswith(f"preempted at step {done + 1}: {says}")


def test_a_verl_without_the_check_trains_on_says_so_once_and_a_preemption_then_waits_for_no_save(
    tmp_path, monkeypatch, capsys
):
    """Where verl lacks should_save_ckpt_esi the patch must not break the import of verl's module in every worker."""
    monkeypatch.setenv("JOB_LOG_DIR", str(tmp_path))
    for _ in range(2):  # two workers of one start import verl's module
        preempt._patch(types.ModuleType(preempt.CHECK_MODULE))
    assert capsys.readouterr().out.count(f"{preempt.CHECK_MODULE} has no should_save_ckpt_esi") == 1
    (tmp_path / "trainer.log").write_text("step:1 - timing_s/step:20.0 - timing_s/save_checkpoint:3.0\n")
    assert preempt.main([str(tmp_path), "118", "20"]) == 1
    assert "stopping without a save (this verl has no should_save_ckpt_esi" in capsys.readouterr().out


def test_a_runs_own_hook_runs_first_and_the_preemption_save_wraps_what_it_patched(tmp_path, monkeypatch):
    """A user's worker_process_setup_hook is chained (the trainer command passes it in USER_HOOK): it runs first, as
    the first code of the worker, and when it replaces verl's check the job's answer still comes, then theirs."""
    from verl.trainer.ppo import ray_trainer

    monkeypatch.setattr(checkpoint_manager, "should_save_ckpt_esi", checkpoint_manager.should_save_ckpt_esi)
    monkeypatch.setattr(ray_trainer, "should_save_ckpt_esi", ray_trainer.should_save_ckpt_esi)
    theirs = types.ModuleType("a_users_hook")
    theirs.install = lambda: setattr(checkpoint_manager, "should_save_ckpt_esi", lambda **kwargs: "theirs")
    monkeypatch.setitem(sys.modules, theirs.__name__, theirs)
    monkeypatch.setenv(USER_HOOK, "a_users_hook.install")
    monkeypatch.setenv("JOB_LOG_DIR", str(tmp_path))
    preempt.install()
    (tmp_path / preempt.REQUEST).touch()
    answers = [ray_trainer.should_save_ckpt_esi(max_steps_duration=5.0) for _ in range(2)]
    assert answers == [True, "theirs"], "the preemption's save once, then the user's own check"


def test_the_hook_makes_verls_check_say_yes_once_after_the_request_and_leaves_it_alone_otherwise(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setattr(checkpoint_manager, "should_save_ckpt_esi", checkpoint_manager.should_save_ckpt_esi)
    monkeypatch.setenv("JOB_LOG_DIR", str(tmp_path))
    monkeypatch.delenv("MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", raising=False)
    monkeypatch.delenv("SAGEMAKER_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP", raising=False)
    preempt.install()
    check = checkpoint_manager.should_save_ckpt_esi
    assert not check(max_steps_duration=0), "no request: verl's own answer (no expiry: no)"
    (tmp_path / preempt.REQUEST).touch()
    # verl's own check says no after a start's first step (no longest step yet): the request still saves there
    assert [check(max_steps_duration=0), check(max_steps_duration=5.0)] == [True, False], "once, then verl's own"
    assert f"preemption: saving after this step ({tmp_path / preempt.REQUEST})" in capsys.readouterr().out


def test_the_hook_imports_nothing_of_verl_and_patches_its_check_as_verls_trainer_imports_it(tmp_path):
    """In a fresh process, as a Ray worker starts: verl's import asks torch for the GPUs, which must wait for Ray."""
    script = (
        "import sys; from launch.job import preempt; preempt.install()\n"
        "assert not [m for m in sys.modules if m.startswith('verl')], 'the hook imported verl'\n"
        "from verl.trainer.ppo import ray_trainer\n"
        f"open({str(tmp_path / preempt.REQUEST)!r}, 'w').close()\n"
        "print([ray_trainer.should_save_ckpt_esi(max_steps_duration=0) for _ in range(2)])\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={"JOB_LOG_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("[True, False]"), run.stdout + run.stderr[-3000:]


def test_each_workers_heap_is_frozen_after_its_init_model_and_verls_dispatch_stays(tmp_path):
    """The job's hook wraps verl's worker classes as their module is imported: after init_model (here a stand-in body
    on the real class, no model built) the heap is frozen, so verl's gc.collect() calls skip what init built; the
    method keeps verl's dispatch attributes, which verl's worker group reads from the class."""
    script = (
        "import gc, sys; from launch.job import preempt; preempt.install()\n"
        "from verl.single_controller.base.decorator import MAGIC_ATTR\n"
        "from verl.workers import fsdp_workers as w\n"
        "init = w.ActorRolloutRefWorker.init_model\n"
        "assert hasattr(init, MAGIC_ATTR) and init.__wrapped__ is not init\n"
        "(cell,) = [c for c in init.__closure__ if c.cell_contents is init.__wrapped__]\n"
        "cell.cell_contents = lambda self: None  # verl's own body would build a model\n"
        "before = gc.get_freeze_count(); kept = [object() for _ in range(1000)]\n"
        "init(None)\n"
        "print(before, gc.get_freeze_count() - before)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={"JOB_LOG_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    before, frozen = map(int, run.stdout.split()[-2:])
    assert before == 0 and frozen >= 1000, run.stdout
