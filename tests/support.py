"""Helpers shared by the tests: free loopback ports, processes that are waited for, the fake cluster's log."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from launch.ports import free_port  # noqa: F401  (the tests import it from here)

REPO = Path(__file__).resolve().parent.parent
FAKES = Path(__file__).resolve().parent / "fakes"
FAKE_PROGRAMS = ("sbatch", "srun", "scontrol", "singularity", "apptainer")


def tail(path: Path | str, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"(no log at {path})"


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """GET without raising on 4xx/5xx; (status, body). Connection errors propagate."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@dataclass
class Process:
    """A background process whose output goes to a log file (never an undrained pipe)."""

    popen: subprocess.Popen
    log: Path
    url: str = ""

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 15.0) -> int:
        """SIGTERM the process group, SIGKILL after `timeout`; return the exit code."""
        if self.alive():
            os.killpg(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.popen.pid, signal.SIGKILL)
                self.popen.wait()
        return self.popen.returncode


def start_process(cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None, cwd: Path = REPO) -> Process:
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        popen = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,  # its own process group, so stop() also ends its children
        )
    return Process(popen, log)


def wait_for_http(proc: Process, url: str, timeout: float = 60.0, expect: int = 200) -> None:
    """Poll `url` until it answers `expect`; fail early if the process dies, with its log tail."""
    deadline = time.monotonic() + timeout
    last = "no answer yet"
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"process exited with {proc.popen.returncode} before {url} was ready:\n{tail(proc.log)}")
        try:
            status, body = http_get(url, timeout=2.0)
            if status == expect:
                return
            last = f"HTTP {status}: {body[:200]!r}"
        except OSError as e:
            last = repr(e)
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout:.0f} s (last: {last}):\n{tail(proc.log)}")


def start_http_server(
    cmd: Sequence[str],
    log: Path,
    port: int,
    env: Mapping[str, str] | None = None,
    health: str = "/health",
    timeout: float = 90.0,
) -> Process:
    """Start a server on 127.0.0.1:`port` and return once `health` answers 200."""
    proc = start_process(cmd, log, env)
    proc.url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(proc, proc.url + health, timeout)
    except BaseException:
        proc.stop()
        raise
    return proc


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
