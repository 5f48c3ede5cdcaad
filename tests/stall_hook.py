"""A test-only Ray worker_process_setup_hook: demo.verl_cpu's shims, then STALL_TEST_PLAN's delays inside verl's own
worker methods, to stand for a slow phase or a hung one (a collective that never returns: alive and silent).

STALL_TEST_PLAN="METHOD:ACTION:N,...": at the N-th call of ActorRolloutRefWorker.METHOD in a process (counted per
process, so a requeued start counts again), ACTION `sleep=S` sleeps S seconds first, `block` never returns.
STALL_TEST_MARKER: a file each block appends `<method> <epoch s>` to as it begins (the test's time of the hang).
The job passes it instead of demo.verl_cpu.install (tests/test_slurm_jobs.py).
"""

from __future__ import annotations

import functools
import os
import threading
import time

from demo import verl_cpu

HOOK = "tests.stall_hook.install"
_installed = False


def stall_test_blocked_forever(method: str) -> None:
    """The frame the stall watchdog's stacks must name: waits for an event nobody sets, as a stuck collective."""
    marker = os.environ.get("STALL_TEST_MARKER")
    if marker:
        with open(marker, "a") as f:
            f.write(f"{method} {time.time():.3f}\n")
    threading.Event().wait()


def plan(text: str) -> dict[str, tuple[str, int]]:
    """{method: (action, call number)} of STALL_TEST_PLAN."""
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        method, action, nth = item.split(":")
        out[method] = (action, int(nth))
    return out


def _wrap(cls, method: str, action: str, nth: int) -> None:
    original = getattr(cls, method)
    calls = [0]

    @functools.wraps(original)  # keeps verl's @register attributes, which its dispatch reads
    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            if action == "block":
                stall_test_blocked_forever(method)
            else:
                time.sleep(float(action.split("=", 1)[1]))
        return original(*args, **kwargs)

    setattr(cls, method, wrapper)


def install() -> None:
    global _installed
    if _installed:
        return
    verl_cpu.install()
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    for method, (action, nth) in plan(os.environ.get("STALL_TEST_PLAN", "")).items():
        _wrap(ActorRolloutRefWorker, method, action, nth)
    _installed = True
