"""Helpers shared by the tests: free loopback ports, processes that are waited for, the fake cluster's log."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from launch import procs
from launch.procs import free_port, http_get, tail  # noqa: F401  (the tests import them from here)

REPO = Path(__file__).resolve().parent.parent
FAKES = Path(__file__).resolve().parent / "fakes"
FAKE_PROGRAMS = ("sbatch", "srun", "scontrol", "singularity", "apptainer")


@dataclass
class Process:
    """A background process whose output goes to a log file, with the URL it serves once it is ready."""

    popen: subprocess.Popen
    log: Path
    url: str = ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM the process group, SIGKILL after `timeout`; return the exit code."""
        return procs.stop_process(self.popen, timeout)


def start_process(cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None, cwd: Path = REPO) -> Process:
    return Process(procs.start_process(cmd, log, env, cwd), log)


def wait_for_http(proc: Process, url: str, timeout: float = 60.0, expect: int = 200) -> None:
    """Poll `url` until it answers `expect`; fail early if the process dies, with its log tail."""
    procs.wait_for_http(proc.popen, url, proc.log, timeout, expect)


def start_http_server(
    cmd: Sequence[str],
    log: Path,
    port: int,
    env: Mapping[str, str] | None = None,
    health: str = "/health",
    timeout: float = 90.0,
) -> Process:
    """Start a server on 127.0.0.1:`port` and return once `health` answers 200."""
    url = f"http://127.0.0.1:{port}"
    return Process(procs.start_server(cmd, log, url + health, timeout, env, REPO), log, url)


@dataclass
class FakeCluster:
    """Fake `sbatch`/`srun`/`scontrol`/`singularity`/`apptainer` installed in `bin_dir`, recording to `log`."""

    bin_dir: Path
    log: Path
    programs: tuple[str, ...] = field(default=FAKE_PROGRAMS)

    def install(self) -> FakeCluster:
        self.bin_dir.mkdir(parents=True, exist_ok=True)
        for prog in self.programs:
            wrapper = self.bin_dir / prog
            wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{FAKES / "fake_cluster.py"}" {prog} "$@"\n')
            wrapper.chmod(0o755)
        return self

    def calls(self, prog: str | None = None) -> list[dict]:
        """Every recorded call, oldest first, optionally of one program only."""
        if not self.log.exists():
            return []
        entries = [json.loads(line) for line in self.log.read_text(encoding="utf-8").splitlines()]
        return [e for e in entries if prog is None or e["prog"] == prog]
