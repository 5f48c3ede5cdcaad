"""Inside an interactive allocation: `salloc --nodes=N --gpus-per-node=G ...`, then `bash
run_grpo_qwen3_4b_mega_verl.sh`
in its shell runs the job in that allocation (srun into it, as a batch job does), never requeues it, writes its output
to CONFIG_LOG_DIR as Slurm would for a batch job, and Ctrl-C stops everything it started on every node. Real Slurm
(the local cluster), reward servers, Ray and preflight; the stand-in container and trainer."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

from tests.real_slurm import NODE_SIZE, Job, slurm_env
from tests.support import RUN, assert_everything_stopped, seen

FAST = {"PREFLIGHT_DATA": "0", "PREFLIGHT_REWARD": "0"}  # the preflight's own checks are test_launch's
SALLOC = ("salloc", "--immediate=300", "--nodes=1", *NODE_SIZE, "--time=60")  # waits for other jobs, not for ever


def allocation(output: str) -> Job:
    job_id = re.search(r"salloc: Granted job allocation (\d+)", output).group(1)
    return Job(job_id, Path(), dict(os.environ))


def test_in_salloc_the_script_runs_the_job_on_the_allocations_nodes_and_never_requeues_it(job, clone):
    env = job | FAST
    run = subprocess.run(
        [*SALLOC, "bash", RUN.name],
        cwd=clone,
        env=slurm_env(env),
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=600,
    )
    out = run.stdout
    assert run.returncode == 0, out[-4000:]
    j = allocation(out)
    assert f"in the interactive allocation of job {j.id}: the job runs here and never requeues" in out
    node = re.search(r"=== launching on 1 node\(s\): (n[12]) \(head n[12]\)", out).group(1)
    assert j.show()["NodeList"] == node, "the allocation's node, through srun"
    trainer = seen(env)
    assert (trainer["ray_nodes"], trainer["ray_gpus"]) == (1, 1) and trainer["reward_health"] == [200]
    assert (Path(env["CONFIG_OUTPUT_DIR"]) / "TRAINING_DONE").exists()
    # what a batch job's Slurm output file would hold: every line of the job
    (saved,) = Path(env["CONFIG_LOG_DIR"]).glob(f"*-{j.id}.out")
    assert f"run_grpo_qwen3_4b_mega_verl.sh exiting (exit_code=0; logs: {Path(env['CONFIG_LOG_DIR']) / j.id})" in (
        saved.read_text()
    )
    fields = j.show()
    assert fields["Restarts"] == "0" and fields["BatchFlag"] == "0", fields
    assert_everything_stopped(env)


def script_of(salloc: subprocess.Popen, timeout: float = 60) -> int:
    """The pid of the command salloc runs (its child, in a process group of its own: the terminal's foreground)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and (proc / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(salloc.pid):
                    return int(proc.name)
            except OSError:
                continue
        time.sleep(0.2)
    raise AssertionError("salloc started no command")


def test_ctrl_c_in_salloc_stops_what_the_script_started_on_every_node_and_nothing_requeues(job, clone, tmp_path):
    """A terminal's Ctrl-C: SIGINT to the foreground process group, the script's and srun's (salloc runs its command
    in one). The script asks the helpers on the nodes to stop (their own SIGTERM), waits for them, then exits 130."""
    env = job | FAST | {"FAKE_TRAINER_SLEEP": "300", "STOP_TIMEOUT": "20"}
    log = tmp_path / "salloc.out"
    with open(log, "w") as out:
        salloc = subprocess.Popen(
            [*SALLOC, "bash", RUN.name],
            cwd=clone,
            env=slurm_env(env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 400
        while not Path(env["FAKE_TRAINER_LOG"]).exists():
            assert salloc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        os.killpg(os.getpgid(script_of(salloc)), signal.SIGINT)
        assert salloc.wait(timeout=120) == 130, log.read_text()[-4000:]
    finally:
        if salloc.poll() is None:
            os.killpg(salloc.pid, signal.SIGKILL)
    out = log.read_text()
    assert "stop signal: stopping the job on every node (within STOP_TIMEOUT=20 s)" in out, out[-4000:]
    # the node's helper stopped its own processes (on its own SIGTERM, not srun's SIGKILL): its last line is there
    assert "[rank 0] stop signal: stopping what this node started" in out, out[-4000:]
    assert "[rank 0] stopped what it started; exit code 143" in out, out[-4000:]
    assert "run_grpo_qwen3_4b_mega_verl.sh exiting (exit_code=130" in out, out[-4000:]
    assert not (Path(env["CONFIG_OUTPUT_DIR"]) / "TRAINING_DONE").exists()
    assert json.loads(Path(env["FAKE_TRAINER_LOG"]).read_text())["argv"], "the trainer had started"
    assert allocation(out).show()["Restarts"] == "0"
    assert_everything_stopped(env)
