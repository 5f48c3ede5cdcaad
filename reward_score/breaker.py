"""The reward client's breaker (reward_score/safe_hack_reward_request.py loads it by path): standard library only."""

from __future__ import annotations

import threading
import time


class Breaker:
    """Per process and server list: once a request spends its whole retry budget, the next calls fail at once.

    verl's `compute_reward` calls the reward function a second time when it raises, and its naive manager scores one
    sample per call: without this, an outage would cost two budgets before the step fails (or one per sample under
    REWARD_ON_FAILURE=min_score). It closes on any success (a request already in flight) or after breaker_seconds.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: dict[tuple[str, ...], tuple[float, str]] = {}  # servers -> (monotonic time it opened, error)

    def check(self, config) -> None:
        """The refusal's words while the breaker for these servers is open, else None."""
        if config.breaker_seconds <= 0:
            return None
        with self._lock:
            opened, error = self._open.get(config.server_urls, (None, ""))
            if opened is None:
                return None
            age = time.monotonic() - opened
            if age >= config.breaker_seconds:
                del self._open[config.server_urls]
                return None
        return (
            f"{error} (this process gave up on them {age:.1f} s ago: failing at once instead of waiting the budget "
            f"again, for {config.breaker_seconds - age:.0f} s more, REWARD_BREAKER_SECONDS)"
        )

    def trip(self, config, error: str) -> None:
        if config.breaker_seconds > 0:
            with self._lock:
                self._open[config.server_urls] = (time.monotonic(), error)

    def reset(self, config) -> None:
        with self._lock:
            self._open.pop(config.server_urls, None)
