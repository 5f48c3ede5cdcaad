"""The real Slurm the launch tests submit to: tests/slurm/local_slurm.sh's two-node cluster on this machine.

`cluster()` starts it if it is not running (installing Slurm when it is missing, as root) and fails with the reason
when it cannot; `sbatch()` submits a script from a folder, as a user does, and returns a `Job` whose state is read
from `scontrol show job` (there is no accounting database) and waited for with a deadline.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCAL_SLURM = REPO / "tests" / "slurm" / "local_slurm.sh"
SLURM_DIR = Path(os.environ.get("LOCAL_SLURM_DIR", "/var/lib/local-slurm"))
SLURM_CONF = SLURM_DIR / "slurm.conf"
NODES = ("n1", "n2")
# What a test job asks of a node (the options on the sbatch command line win over the script's #SBATCH lines).
NODE_SIZE = ("--mem=3G", "--cpus-per-task=2", "--gpus-per-node=1")
FINISHED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
)


def slurm_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    return dict(os.environ if env is None else env, SLURM_CONF=str(SLURM_CONF))


def cluster() -> str:
    """Start the local cluster (idempotent: about a second when it runs) and return its node table; raise with the
    script's own output when it cannot start here."""
    run = subprocess.run(
        ["bash", str(LOCAL_SLURM), "start"],
        capture_output=True,
        text=True,
        timeout=900,
        env=slurm_env() | {"LOCAL_SLURM_DIR": str(SLURM_DIR)},
    )
    if run.returncode:
        raise RuntimeError(
            f"the local Slurm cluster could not start (tests/slurm/local_slurm.sh start, exit {run.returncode}):\n"
            f"{run.stdout[-2000:]}{run.stderr[-3000:]}"
        )
    status = subprocess.run(
        ["bash", str(LOCAL_SLURM), "status"], capture_output=True, text=True, timeout=60, env=slurm_env()
    )
    if status.returncode:
        raise RuntimeError(f"the local Slurm cluster started but is not usable:\n{status.stdout}{status.stderr}")
    return status.stdout


def parse_job(text: str) -> dict[str, str]:
    """`scontrol show job -o ID` as {field: value}. Values hold no spaces except Command and the like, which come
    last on the line; every field read here (JobState, Reason, Restarts, ExitCode, NodeList, EndTime) is a word."""
    return dict(re.findall(r"(\S+?)=(\S*)", text))


@dataclass
class Job:
    """One submitted job: its id, its Slurm output file, and what it was submitted with."""

    id: str
    out: Path
    env: dict[str, str]
    argv: list[str] = field(default_factory=list)

    def show(self) -> dict[str, str]:
        """The job as `scontrol show job` has it now."""
        run = subprocess.run(
            ["scontrol", "show", "job", "-o", self.id],
            capture_output=True,
            text=True,
            timeout=30,
            env=slurm_env(self.env),
        )
        assert run.returncode == 0, f"scontrol show job {self.id}: {run.stderr}"
        return parse_job(run.stdout)

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def wait_until(self, what: str, ready: Callable[[dict[str, str]], bool], timeout: float) -> dict[str, str]:
        """Poll the job until `ready(fields)` holds; at the deadline fail with what was seen and the output's end."""
        deadline = time.monotonic() + timeout
        while True:
            fields = self.show()
            if ready(fields):
                return fields
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"job {self.id}: not {what} after {timeout:.0f} s: JobState={fields.get('JobState')} "
                    f"Reason={fields.get('Reason')} Restarts={fields.get('Restarts')}\n{cluster_state(self.env)}"
                    f"--- {self.out} ---\n{self.output()[-4000:]}"
                )
            time.sleep(1)

    def wait(self, timeout: float = 400) -> dict[str, str]:
        """Until the job has finished (JobState COMPLETED, FAILED, CANCELLED, ...); its final fields."""
        return self.wait_until("finished", lambda f: f.get("JobState") in FINISHED, timeout)

    def wait_for_file(self, path: Path, timeout: float) -> None:
        """Until `path` exists; fail early, with the output, if the job ends first."""
        self.wait_for(f"{path} to appear", path.exists, timeout)

    def wait_for(self, what: str, ready: Callable[[], bool], timeout: float) -> None:
        """Until `ready()` holds while the job runs; fail early, with the output, if the job ends first."""
        deadline = time.monotonic() + timeout
        while not ready():
            state = self.show().get("JobState")
            if state in FINISHED or time.monotonic() > deadline:
                raise AssertionError(
                    f"job {self.id}: waited in vain for {what} (JobState={state} after "
                    f"{timeout - max(deadline - time.monotonic(), 0):.0f} s)\n{self.output()[-4000:]}"
                )
            time.sleep(0.5)

    def scancel(self, *args: str) -> None:
        subprocess.run(["scancel", *args, self.id], check=True, timeout=30, env=slurm_env(self.env))

    def scontrol(self, *args: str) -> None:
        subprocess.run(["scontrol", *args], check=True, timeout=30, env=slurm_env(self.env))


def sbatch(
    env: Mapping[str, str],
    script: str,
    *args: str,
    cwd: Path,
    options: Sequence[str] = NODE_SIZE,
    out: Path | None = None,
) -> Job:
    """`sbatch OPTIONS [--output=OUT] SCRIPT ARGS...` from `cwd`, with `env` as the job's environment (sbatch
    exports the caller's whole environment, as it does for a user). Without `out` the script's own #SBATCH
    --output line decides where the output goes, relative to `cwd`."""
    argv = ["sbatch", "--parsable", *options, *([f"--output={out}"] if out else []), script, *args]
    run = subprocess.run(argv, cwd=cwd, env=slurm_env(env), capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"{' '.join(argv)} was refused: {run.stderr}"
    job_id = run.stdout.strip().split(";")[0]
    job = Job(job_id, Path(), dict(env), argv)
    job.out = Path(job.show()["StdOut"])
    return job


def copy_tree(src: Path, dst: Path) -> Path:
    """What a clone of the repository holds: the tracked files and the untracked ones git does not ignore, as they
    are in the working tree now (so uncommitted work is tested too), and nothing that is ignored (no logs/ output,
    no .venv)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=src,
        capture_output=True,
        check=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = src / name
        if not source.is_file():  # deleted in the working tree, not yet in the index
            continue
        target = dst / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)
    return dst


def cluster_state(env: Mapping[str, str]) -> str:
    """The nodes (state, CPUs allocated/idle/other/total, free memory, drain reason) and the queue, for a failure's
    message: what else held the cluster when a job did not start or finish."""
    said = []
    for argv in (["sinfo", "-N", "-o", "%N %T %C %e %E"], ["squeue", "-o", "%i %j %T %R %N %M"]):
        run = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=slurm_env(env))
        said.append(f"--- {' '.join(argv[:1])} ---\n{run.stdout}{run.stderr}")
    return "".join(said)


def cancel_all(jobs: Sequence[Job], timeout: float = 120) -> None:
    """scancel every job still queued or running and wait until Slurm says each has finished, so that no test's
    job outlives it."""
    for job in jobs:
        if job.show().get("JobState") not in FINISHED:
            job.scancel()
    for job in jobs:
        job.wait(timeout)
