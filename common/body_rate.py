"""Token buckets of request-body bytes: how fast each team (or, for a caller not known yet, each
client address) may have its request bodies read off the network, in one web process.

A bucket holds up to `burst` bytes and fills at `rate` bytes a second. Reading a body's bytes
spends them; a bucket may go into debt (a chunk already read is never refused), and while it is
in debt the connections that spend from it are not read from (common/daphne_requests.py pauses
them: TCP holds the client's bytes back) until the debt is repaid. So a team's sustained body
bytes a second are at most `rate`, however many connections it opens, and a single request within
`burst` is never slowed when its team has been quiet.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

MAX_BUCKETS = 10_000  # buckets kept at once; past it, full ones (and then the oldest) go


class ByteBuckets:
    def __init__(
        self,
        *,
        rate: float,
        burst: float,
        clock: Callable[[], float] = time.monotonic,
        max_buckets: int = MAX_BUCKETS,
    ):
        if rate <= 0 or burst <= 0:
            raise ValueError("a body rate and its burst must be positive")
        self.rate = float(rate)
        self.burst = float(burst)
        self.clock = clock
        self.max_buckets = max_buckets
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # (level, at)
        self._lock = threading.Lock()

    def spend(self, name: str, nbytes: int) -> float:
        """Spend `nbytes` from bucket `name`: the seconds until it is out of debt (0.0 if it
        is not in debt)."""
        now = self.clock()
        with self._lock:
            level = self._level(name, now) - nbytes
            self._buckets[name] = (level, now)
            self._buckets.move_to_end(name)
            if len(self._buckets) > self.max_buckets:
                self._shed(now)
        return 0.0 if level >= 0 else -level / self.rate

    def level(self, name: str) -> float:
        """Bucket `name`'s bytes now (negative: its debt)."""
        with self._lock:
            return self._level(name, self.clock())

    def _level(self, name: str, now: float) -> float:
        entry = self._buckets.get(name)
        if entry is None:
            return self.burst
        level, at = entry
        return min(self.burst, level + (now - at) * self.rate)

    def _shed(self, now: float) -> None:
        """Forget buckets that are full again (the same as never seen), then the least
        recently used, down to nine tenths of the room (so a flood of new names does not scan
        them all at every chunk)."""
        full = [name for name in self._buckets if self._level(name, now) >= self.burst]
        for name in full:
            del self._buckets[name]
        while len(self._buckets) > self.max_buckets * 9 // 10:
            self._buckets.popitem(last=False)
