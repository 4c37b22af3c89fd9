"""What the engine worker keeps of models that failed: the last failed load, and deaths in a row.

A spec whose load failed is not tried again by requests for LOAD_RETRY_AFTER_S (a broken path
must not cost every request a load attempt; an admin's reload retries at once). An engine whose
loop dies is started again after a delay that grows with the deaths in a row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from engine.protocol import ModelLoadError, ModelSpec

LOAD_RETRY_AFTER_S = 60.0
# An engine whose loop dies is started again after the first delay; one that dies again soon
# after (within RESTART_RESET_S of its restart) waits twice as long, up to the last.
RESTART_DELAYS_S = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)
RESTART_RESET_S = 60.0


@dataclass(frozen=True)
class LoadFailure:
    spec: ModelSpec
    error: str
    at: float  # time.time()
    retry_at: float  # time.monotonic()
    code: str = ModelLoadError.code

    @classmethod
    def now(cls, spec: ModelSpec, error: str, *, retry_after: float, code: str) -> LoadFailure:
        return cls(spec, error, time.time(), time.monotonic() + retry_after, code)

    def blocks(self, spec: ModelSpec) -> bool:
        """Whether a request for `spec` must not try its load again yet."""
        return self.spec == spec and time.monotonic() < self.retry_at


class Restarts:
    """Deaths in a row per model name."""

    def __init__(self) -> None:
        self._deaths: dict[str, tuple[int, float]] = {}  # name -> (deaths in a row, last at)

    def died(self, name: str) -> float:
        """Count a death of `name`'s engine; the seconds to wait before starting it again."""
        deaths, last = self._deaths.get(name, (0, 0.0))
        now = time.monotonic()
        deaths = deaths + 1 if now - last < RESTART_RESET_S else 1
        self._deaths[name] = (deaths, now)
        return RESTART_DELAYS_S[min(deaths, len(RESTART_DELAYS_S)) - 1]

    def count(self, name: str) -> int:
        return self._deaths.get(name, (0, 0.0))[0]

    def forget(self, name: str) -> None:
        self._deaths.pop(name, None)
