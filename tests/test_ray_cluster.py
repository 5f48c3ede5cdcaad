"""launch/job/ray_cluster.py keeps its deadline whatever Ray does: ray.init is bounded, watched processes are
checked."""

import socket
import subprocess
import sys
import time

import pytest

from tests.support import REPO


@pytest.fixture
def silent_address():
    """An address that accepts TCP and never answers: a listening socket that nobody reads (the kernel completes the
    handshake). Bound on every interface, since Ray rewrites 127.0.0.1 to the node's own address."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        s.listen(64)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def wait_command(address: str, timeout: float, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "launch.job.ray_cluster",
        "wait",
        "--address",
        address,
        "--nodes",
        "1",
        "--timeout",
        str(timeout),
        *extra,
    ]


def test_a_ray_address_that_never_answers_ends_the_wait_at_its_deadline(silent_address):
    start = time.monotonic()
    run = subprocess.run(wait_command(silent_address, 6), cwd=REPO, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert run.returncode == 1, run.stderr[-2000:]
    # Today's ray.init blocks for minutes on such an address; the wait must end at 6 s.
    assert 6 <= elapsed < 10, f"ended after {elapsed:.1f} s"
    assert "0/1 nodes, 0/0 GPUs after 6 s" in run.stderr
    assert f"(could not connect to {silent_address}: ray.init had not returned)" in run.stderr


def test_a_watched_process_that_dies_while_ray_init_hangs_ends_the_wait_at_once(silent_address):
    watched = subprocess.Popen(["sleep", "3"])
    start = time.monotonic()
    cmd = wait_command(silent_address, 60, "--watch-pid", str(watched.pid))
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    watched.wait()
    assert run.returncode == 1
    assert f"process {watched.pid} exited while waiting for the cluster" in run.stderr
    assert 3 <= elapsed < 6, f"ended after {elapsed:.1f} s, the watched process died at 3 s"


def test_an_address_with_nothing_listening_ends_the_wait_at_its_deadline_naming_the_address():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("0.0.0.0", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        start = time.monotonic()
        run = subprocess.run(
            wait_command(f"127.0.0.1:{port}", 5), cwd=REPO, capture_output=True, text=True, timeout=120
        )
    elapsed = time.monotonic() - start
    assert run.returncode == 1
    assert 5 <= elapsed < 9, f"ended after {elapsed:.1f} s"
    assert f"0/1 nodes, 0/0 GPUs after 5 s (could not connect to 127.0.0.1:{port}: " in run.stderr
