"""Processes the preflight, the demo, the benchmarks and the tests start: a free loopback port, a server started
with its output in a log file, and the one poll of its health URL against a deadline that fails as soon as it dies."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path


def free_port() -> int:
    """A port on 127.0.0.1 that nothing listens on right now (the OS picks it from its ephemeral range)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path | str, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return f"(no log at {path})"


# Our own servers are reached directly: urllib's default opener sends even 127.0.0.1 to the proxy that http_proxy or
# all_proxy names (clusters set them; only no_proxy is an exception).
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """GET without raising on 4xx/5xx, never through a proxy; (status, body). Connection errors propagate."""
    try:
        with _DIRECT.open(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start_process(
    cmd: Sequence[str], log: Path, env: Mapping[str, str] | None = None, cwd: Path | str | None = None
) -> subprocess.Popen:
    """`cmd` in the background, stdout and stderr to `log` (never an undrained pipe), in a process group of its own
    so that `stop_process` also ends its children."""
    log = Path(log)
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        return subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )


def wait_for_http(
    proc: subprocess.Popen,
    url: str,
    log: Path | str,
    timeout: float,
    expect: int = 200,
    name: str = "the process",
    interval: float = 0.2,
    since: float | None = None,
) -> None:
    """Poll `url` until it answers `expect`, each GET with its own short timeout. RuntimeError as soon as `proc`
    exits, TimeoutError at the deadline (`timeout` seconds from `since`, a time.monotonic() such as the process's
    start; from now where None); both name `name`, say what was last seen and end with the tail of `log`."""
    deadline = (time.monotonic() if since is None else since) + timeout
    last = "no answer yet"
    while True:  # polled once at least: a process started long before the wait may be healthy by now
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before {url} was ready; log {log}:\n{tail(log)}")
        try:
            status, body = http_get(url, timeout=2.0)
            if status == expect:
                return
            last = f"HTTP {status}: {body[:200]!r}"
        except OSError as e:
            last = repr(e)
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    raise TimeoutError(
        f"{name} was not healthy after {timeout:.0f} s (GET {url}, last: {last}); log {log}:\n{tail(log)}"
    )


def stop_process(proc: subprocess.Popen, timeout: float = 15.0) -> int:
    """SIGTERM the process group, SIGKILL after `timeout`; the exit code."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def start_server(
    cmd: Sequence[str],
    log: Path,
    url: str,
    timeout: float,
    env: Mapping[str, str] | None = None,
    cwd: Path | str | None = None,
    name: str = "the server",
) -> subprocess.Popen:
    """Start a server and return once `url` (its health URL) answers 200; stopped again if it never does."""
    proc = start_process(cmd, log, env, cwd)
    try:
        wait_for_http(proc, url, log, timeout, name=name)
    except BaseException:
        stop_process(proc)
        raise
    return proc
