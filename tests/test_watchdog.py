"""The stall watchdog (launch/job/watchdog.py) piece by piece: the budget of each step from fed step timings, the stacks
of real blocked processes (py-spy, and faulthandler where there is none), the phase read from them, the setting's
refusal, and the status of a stalled start. The whole of it in a job: tests/test_slurm_jobs.py -k hung_in_a_phase."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launch.job import watchdog
from launch.plan import deadline
from launch.plan.refusals import check
from launch.plan.settings import Settings
from launch.watch import health, reading
from tests.support import block_environment

# verl's console line of a step (the training part, and a validation or save when it had one)
STEP = {"timing_s/step": 10.0, "training/global_step": 1.0}


def clock(**changes) -> watchdog.Clock:
    return watchdog.Clock(
        **({"timeout": None, "floor": 100.0, "first": 1000.0, "test_freq": 5, "save_freq": 10, "total": 100} | changes)
    )


def test_auto_gives_the_first_step_its_own_budget_then_three_times_the_longest_step_never_below_the_floor():
    c = clock()
    assert c.budget(0)[0] == 1000, "the first step of a start: loading, compiling"
    c.finished(1, STEP)
    assert c.budget(0)[0] == 100, "3 x 10 s is below the floor"
    c.finished(2, STEP | {"timing_s/step": 60.0})
    seconds, why = c.budget(0)
    assert seconds == 180 and "3 x the longest step 60 s" in why, why
    c.finished(3, STEP)
    assert c.budget(0)[0] == 180, "the longest so far, not the last"


def test_a_step_that_validates_or_saves_gets_the_first_ones_budget_then_three_times_the_longest_measured():
    c = clock()
    c.finished(3, STEP)
    assert c.budget(0)[0] == 100, "step 4 neither validates nor saves"
    c.finished(4, STEP)  # the next, 5, validates: no validation measured yet
    seconds, why = c.budget(0)
    assert seconds == 100 + 1000 and "step 5 validates (STALL_FIRST_STEP=1000 s for a first testing)" in why, why
    c.finished(5, STEP | {"timing_s/testing": 200.0})
    assert c.budget(0)[0] == 100, "step 6 neither validates nor saves"
    c.finished(9, STEP)  # the next, 10, validates and saves
    seconds, why = c.budget(0)
    assert seconds == 100 + 3 * 200 + 1000, why
    c.finished(10, STEP | {"timing_s/testing": 100.0, "timing_s/save_checkpoint": 50.0})
    c.finished(19, STEP)
    assert c.budget(0)[0] == 100 + 3 * 200 + 3 * 50
    c.finished(99, STEP)  # the last step validates and saves whatever the frequencies
    c.test_freq, c.save_freq = 7, 11
    assert c.budget(0)[0] == 100 + 3 * 200 + 3 * 50


def test_a_step_near_verls_save_before_the_time_limit_gets_a_save_and_a_number_is_the_budget_after_the_first_step():
    c = clock(expiry=10_000.0)
    c.finished(1, STEP | {"timing_s/save_checkpoint": 30.0})
    assert c.budget(0)[0] == 100, "far from the expiry: no save"
    assert c.budget(10_000 - 100)[0] == 100 + 90, "within the window verl saves in"
    fixed = clock(timeout=50.0)
    assert fixed.budget(0) == (1000, "the first step of this start: STALL_FIRST_STEP=1000 s")
    fixed.finished(1, STEP | {"timing_s/step": 500.0})
    assert fixed.budget(0) == (50, "STALL_TIMEOUT=50 s")


def test_slow_but_progressing_steps_are_never_past_their_budget_and_a_hang_is():
    """A run as the job test's: a slow first step, a slow validation, a slow save, each past the floor; then a step
    that never ends. Each finished step's wall time against the budget it had when it began."""
    c = clock(floor=15.0, first=400.0, test_freq=2, save_freq=3, total=20)
    wall = {
        1: (95.0, STEP),
        2: (55.0, STEP | {"timing_s/testing": 45.0}),
        3: (52.0, STEP | {"timing_s/save_checkpoint": 42.0}),
        4: (10.0, STEP),
    }
    for step, (took, metrics) in wall.items():
        assert took < c.budget(0)[0], f"step {step} ({took} s) would have been stopped: {c.budget(0)[1]}"
        c.finished(step, metrics)
    assert c.budget(0)[0] == 30, "step 5 neither validates nor saves: 3 x 10 s"


def test_after_a_requeue_the_budget_counts_the_steps_and_validations_of_the_earlier_starts(tmp_path):
    logs = tmp_path / "logs"
    (logs / "77").mkdir(parents=True)
    (logs / "77" / "trainer.log").write_text(
        "step:1 - timing_s/step:45 - training/global_step:1\n"
        "step:2 - timing_s/step:9 - timing_s/testing:70.5 - "
        "timing_s/save_checkpoint:20 - training/global_step:2\n"
    )
    env = {
        "STALL_TIMEOUT": "auto",
        "STALL_FLOOR": "100",
        "STALL_FIRST_STEP": "1000",
        "JOB_ID": "77",
        "JOB_LOG_DIR": str(logs / "77-r1"),
    }
    c = watchdog.Clock.from_env(env, ["trainer.test_freq=5", "trainer.save_freq=5", "trainer.test_freq=2"])
    assert (c.test_freq, c.save_freq) == (2, 5), "the trainer command's last value wins"
    c.finished(3, STEP)
    assert c.budget(0)[0] == 3 * 45 + 3 * 70.5 + 3 * 20, "verl has not said its total yet: step 4 may be the last"
    c.total = 20
    assert c.budget(0)[0] == 3 * 45 + 3 * 70.5, "the longest step and validation of the job, not of this start"


@pytest.mark.parametrize("raw", ["soon", "0", "-5", ""])
def test_a_bad_stall_timeout_is_refused_naming_the_setting_and_what_it_takes(raw):
    with pytest.raises(deadline.StallError, match=f"STALL_TIMEOUT={raw!r}: use auto, off, or the seconds"):
        deadline.timeout_setting(raw)
    problems = check(Settings.from_env(block_environment() | {"STALL_TIMEOUT": raw}), check_paths=False)
    assert any(p.startswith(f"STALL_TIMEOUT={raw!r}") for p in problems), problems
    problems = check(Settings.from_env(block_environment() | {"STALL_FLOOR": "0"}), check_paths=False)
    assert "STALL_FLOOR=0: the seconds the stall watchdog allows, 1 or more" in problems


# --- stacks of real processes -------------------------------------------------------------------------------------

TRAINER = """
import contextlib, sys, threading

@contextlib.contextmanager
def marked_timer(name, timing_raw):
    yield

def update_actor_collective():
    print("ready", flush=True)
    threading.Event().wait()

class RayPPOTrainer:
    def fit(self):
        timing_raw = {}
        with marked_timer("step", timing_raw):
            with marked_timer("gen", timing_raw):
                pass
            with marked_timer("update_actor", timing_raw):
                update_actor_collective()

RayPPOTrainer().fit()
"""


@pytest.fixture
def blocked(tmp_path):
    """A Python process blocked inside verl's fit's update_actor timer, as a stand-in trainer file (its name ends in
    trainer.py, as verl's do), with the job's JOB_LOG_DIR, faulthandler on, and its output in a log file."""
    script = tmp_path / "fake_ray_trainer.py"
    script.write_text(textwrap.dedent(TRAINER))
    logs = tmp_path / "job"
    logs.mkdir()
    log = logs / "trainer.log"
    env = dict(os.environ, JOB_LOG_DIR=str(logs), PYTHONFAULTHANDLER="1")
    with open(log, "wb") as out:  # the driver's name as the watchdog finds it
        proc = subprocess.Popen(
            [sys.executable, str(script), "verl.trainer.main_ppo"], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    deadline = time.monotonic() + 60
    while "ready" not in log.read_text() and time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        time.sleep(0.1)
    yield proc, logs, script
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_py_spys_stack_of_a_blocked_process_names_its_frame_and_verls_phase(blocked):
    proc, _, script = blocked
    pyspy = shutil.which("py-spy", path=str(Path(sys.executable).parent))  # a job's PATH has it there
    assert pyspy, "py-spy comes with ray[default], which verl 0.6.1 requires"
    stack = watchdog.command_output([pyspy, *watchdog.PYSPY[1:], str(proc.pid)])
    assert stack and "update_actor_collective" in stack, stack
    assert watchdog.phase_of(stack) == ("update_actor", f"{script}:19")
    assert proc.poll() is None, "py-spy leaves the process running"


def test_without_py_spy_the_node_dump_has_faulthandlers_stack_of_every_thread_and_the_logs_end(blocked, monkeypatch):
    proc, logs, script = blocked
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent.parent / "no-such-bin"))  # no py-spy, no nvidia-smi
    path = watchdog.dump(logs, "n9", env={})
    text = path.read_text()
    assert path == logs / "stall" / "stacks_n9.txt"
    assert f"=== process {proc.pid}: {sys.executable} {script} verl.trainer.main_ppo" in text, text
    assert "stacks by py-spy dump; faulthandler (SIGABRT) where py-spy could not: " in text
    assert "in update_actor_collective" in text and "Fatal Python error: Aborted" in text, text
    assert watchdog.phase_of(text) == ("update_actor", f"{script}:19")
    assert f"--- last 30 lines of {logs / 'trainer.log'} ---" in text
    assert "=== GPUs (nvidia-smi) ===\n(nvidia-smi failed, or is missing)" in text
    assert proc.wait(30) == -6, "SIGABRT ends it: the start is stopped right after"


RAY_WORKER = """
import os, sys, threading, time
import ray

def update_actor_collective(entered):
    open(entered, "w").close()  # the test's sign that the frame is on the stack
    threading.Event().wait()

@ray.remote
class Worker:
    def pid(self):
        return os.getpid()

    def update_actor(self, entered):
        update_actor_collective(entered)

ray.init(num_cpus=1, include_dashboard=False, _temp_dir=sys.argv[1])
worker = Worker.remote()
print("pid", ray.get(worker.pid.remote()), flush=True)
worker.update_actor.remote(sys.argv[2])
time.sleep(600)
"""


@pytest.mark.slow
def test_without_py_spy_a_ray_workers_stack_comes_from_faulthandler_in_its_own_log(tmp_path, monkeypatch):
    """The image's Python 3.12 ray[default] brings no py-spy: a real Ray worker (the job's environment inherited
    through Ray's raylet, PYTHONFAULTHANDLER=1 as the helper exports it) blocked in a method is found by the node
    dump, and its stack, printed by faulthandler into Ray's worker-*.err, names the blocked frame."""
    logs, ray_tmp = tmp_path / "job", Path(f"/tmp/rwd{os.getpid()}")  # Ray's socket paths have a length limit
    logs.mkdir()
    pkill = shutil.which("pkill") or "pkill"
    script = tmp_path / "ray_worker.py"
    script.write_text(textwrap.dedent(RAY_WORKER))
    env = dict(
        os.environ, JOB_LOG_DIR=str(logs), PYTHONFAULTHANDLER="1", RAY_USAGE_STATS_ENABLED="0", HOME=str(tmp_path)
    )
    entered = tmp_path / "entered_update_actor_collective"
    driver = subprocess.Popen(
        [sys.executable, str(script), str(ray_tmp), str(entered)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        text=True,
        start_new_session=True,
    )
    try:
        pid = None
        deadline = time.monotonic() + 180
        while pid is None and time.monotonic() < deadline:
            line = driver.stdout.readline()
            assert line or driver.poll() is None, "the Ray driver exited"
            if line.startswith("pid "):
                pid = int(line.split()[1])
        assert pid, "no Ray worker within 180 s"
        deadline = time.monotonic() + 60  # the method's frame is on the stack, and the worker has its log
        while not (entered.exists() and watchdog.worker_logs(str(ray_tmp), pid)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert entered.exists(), "the worker never entered update_actor_collective within 60 s"
        monkeypatch.setenv("PATH", str(tmp_path / "no-bin"))  # no py-spy
        path = watchdog.dump(logs, "n1", env={"RAY_TMP_DIR": str(ray_tmp)})
        text = path.read_text()
        assert f"=== process {pid}: ray::Worker" in text, text[:3000]
        assert "stacks by py-spy dump; faulthandler (SIGABRT) where py-spy could not: " in text
        section = text[text.index(f"=== process {pid}") :]
        assert "in update_actor_collective" in section, section[:3000]
    finally:
        os.killpg(driver.pid, 9)
        driver.wait()
        subprocess.run([pkill, "-9", "-f", str(ray_tmp)], check=False)
        shutil.rmtree(ray_tmp, ignore_errors=True)


# --- the status of a stalled start --------------------------------------------------------------------------------


def test_a_stalled_start_shows_as_stalled_with_since_when_the_step_the_phase_and_the_stacks(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "noslurm"))  # no Slurm to ask
    (tmp_path / "noslurm").mkdir()
    folder = tmp_path / "logs" / "local-1"
    folder.mkdir(parents=True)
    (folder / "trainer.log").write_text("step:1 - timing_s/step:10 - training/global_step:1\n")
    (folder / "done").write_text("1\n")
    since = time.mktime(time.strptime("2026-12-03 10:00:00", "%Y-%m-%d %H:%M:%S"))
    (folder / "stall.json").write_text(
        json.dumps(
            {
                "since": since,
                "step": 2,
                "phase": "update_actor",
                "budget": 1800,
                "setting": "auto",
                "stacks": str(folder / "stall"),
            }
        )
    )
    job = reading.load(str(folder))
    st, why = health.state(job)
    assert st == "stalled", why
    assert why == (
        f"no step finished since 2026-12-03 10:00 (budget 30 min, STALL_TIMEOUT=auto): hung in step 2, "
        f"phase update_actor; stacks in {folder / 'stall'}"
    )
    assert job.starts[0].how.startswith("stalled (no step finished since")
