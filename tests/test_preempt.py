"""The save on preemption (launch/job/preempt.py): whether a step and a save fit in the grace left, the lengths it
reads from verl's step lines, and the Ray hook that makes verl's own save-before-expiry check say yes once. The job
on the real Slurm: tests/test_slurm_jobs.py::test_a_preempted_job_saves_the_step_it_is_in_..."""

import subprocess
import sys

import pytest
from verl.utils.checkpoint import checkpoint_manager

from launch.job import preempt
from tests.support import REPO


@pytest.mark.parametrize(
    ("left", "step", "save", "saves", "says"),
    [
        (118, 9, 3, True, "grace 118 s, a step takes ~9 s, a save ~3 s, the stop 20 s"),  # room to spare
        (58, 20, 3, True, "a step takes ~20 s"),  # 20 + 3 + 20 + 15 = 58: just fits
        (57, 20, 3, False, "58 s do not fit"),  # one second short
        (120, 600, 120, False, "755 s do not fit"),  # the article's job: a 10-min step, a 2-min save
        (118, 9, None, True, "a save not measured yet"),  # no save yet in this job: the step and the stop decide
        (30, None, None, True, "no step measured yet in this job, so trying"),  # a start's first step: try
    ],
)
def test_the_save_is_attempted_only_when_a_step_the_save_and_the_stop_fit_in_the_grace(left, step, save, saves, says):
    ok, why = preempt.decide(left, step, save, stop=20)
    assert ok is saves and says in why, why


def test_the_lengths_are_the_longest_of_every_start_and_the_step_is_this_starts_last(tmp_path):
    first, second = tmp_path / "77", tmp_path / "77-r1"
    for folder in (first, second):
        folder.mkdir()
    (first / "trainer.log").write_text(
        "(TaskRunner pid=1) step:1 - timing_s/step:12.5 - timing_s/save_checkpoint:np.float64(4.0)\n"
        "(TaskRunner pid=1) step:2 - timing_s/step:30.0\n"
    )
    (second / "trainer.log").write_text(
        "(TaskRunner pid=2) step:3 - timing_s/step:8.0 - timing_s/save_checkpoint:6.5\n"
        "(TaskRunner pid=2) step:4 - timing_s/step:9.0\n"
        "(TaskRunner pid=2) step:5 - val-core/acc:0.5\n"  # a validation-only line is no step
    )
    assert preempt.lengths(second) == (4, 30.0, 6.5)
    assert preempt.lengths(tmp_path / "78") == (0, None, None), "a start that logged nothing yet"


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
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={"JOB_LOG_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"})  # fmt: skip
    assert run.returncode == 0 and run.stdout.strip().endswith("[True, False]"), run.stdout + run.stderr[-3000:]


def test_the_command_line_prints_the_step_and_exits_0_only_for_a_save(tmp_path, capsys):
    (tmp_path / "trainer.log").write_text("step:1 - timing_s/step:20.0 - timing_s/save_checkpoint:3.0\n")
    assert preempt.main([str(tmp_path), "118", "20"]) == 0
    assert capsys.readouterr().out.startswith("preempted at step 2: saving after this step (grace 118 s,")
    assert preempt.main([str(tmp_path), "40", "20"]) == 1
    assert "preempted at step 2: stopping without a save (" in capsys.readouterr().out
