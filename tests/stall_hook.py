"""A test-only hook in every Ray worker of a CPU run, after cpu.verl_shims's shims: STALL_TEST_PLAN's delays inside
verl's own worker methods, to stand for a slow phase or a hung one (a collective that never returns: alive and silent).

STALL_TEST_PLAN="METHOD:ACTION:N[@H],...": at the N-th call of ActorRolloutRefWorker.METHOD in a process (counted per
process, so a requeued start counts again), ACTION `sleep=S` sleeps S seconds first, `block` never returns; with @H only
while STALL_TEST_MARKER holds H hangs (@0: the first start alone). A method may have several items (one per start).
STALL_TEST_MARKER: a file each block appends `<method> <epoch s>` to as it begins (the test's time of the hang).
The job names it in CPU_RUN_THEN_HOOK, which cpu.verl_shims.install calls after its shims (tests/test_slurm_jobs.py).
"""

from __future__ import annotations

import functools
import os
import threading
import time

from cpu import verl_shims

HOOK = "tests.stall_hook.install"
_installed = False


def stall_test_blocked_forever(method: str) -> None:
    """The frame the stall watchdog's stacks must name: waits for an event nobody sets, as a stuck collective."""
    marker = os.environ.get("STALL_TEST_MARKER")
    if marker:
        with open(marker, "a") as f:
            f.write(f"{method} {time.time():.3f}\n")
    threading.Event().wait()


def plan(text: str) -> dict[str, list[tuple[str, int, int | None]]]:
    """{method: [(action, call number, hangs or None), ...]} of STALL_TEST_PLAN."""
    out = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        method, action, nth = item.split(":")
        nth, _, hangs = nth.partition("@")
        out.setdefault(method, []).append((action, int(nth), int(hangs) if hangs else None))
    return out


def hangs_so_far() -> int:
    marker = os.environ.get("STALL_TEST_MARKER")
    try:
        return len(open(marker).read().splitlines()) if marker else 0
    except FileNotFoundError:
        return 0


def _wrap(cls, method: str, items: list[tuple[str, int, int | None]]) -> None:
    original = getattr(cls, method)
    calls = [0]

    @functools.wraps(original)  # keeps verl's @register attributes, which its dispatch reads
    def wrapper(*args, **kwargs):
        calls[0] += 1
        for action, nth, hangs in items:
            if calls[0] == nth and (hangs is None or hangs_so_far() == hangs):
                if action == "block":
                    stall_test_blocked_forever(method)
                time.sleep(float(action.split("=", 1)[1]))
        return original(*args, **kwargs)

    setattr(cls, method, wrapper)


def install() -> None:
    global _installed
    if _installed:
        return
    verl_shims.install()
    from verl.workers.fsdp_workers import ActorRolloutRefWorker

    for method, items in plan(os.environ.get("STALL_TEST_PLAN", "")).items():
        _wrap(ActorRolloutRefWorker, method, items)
    _installed = True
