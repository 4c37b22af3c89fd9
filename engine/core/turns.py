"""Compute turns: the engines of one worker compute one at a time, each step in turn.

Two engines stepping at once on the same device do not each get half of it. On a CPU, MLX's
kernels split each operation over every core and wait for all of their threads, so an engine
whose threads share the cores with another's stalls at every operation: measured here on 2
cores, a flood of one team's embeddings made another team's chat steps four to five times
slower, while each alone takes a fraction of the machine's time. With turns, a step waits at
most for the other engines' one step each (an embedding forward is bounded:
engine/core/embedding.py), then runs with the device to itself. Turns are first come, first
served, so engines with work alternate step by step; an engine alone never waits.

A step that is long and can stop between parts (a sentence encoder's forward, layer by layer:
engine/core/embedding.py) calls `pause` between them: once it has held its turn PAUSE_AFTER_S,
an engine waiting goes first, one step, then the step goes on. What a chat step waits for is
then about PAUSE_AFTER_S and a layer, however long the other engine's inputs are.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterator

# An engine that took a turn this recently counts as working (between its steps it holds none).
ACTIVE_WINDOW_S = 0.5
# A step that can pause lets waiting engines go first once it has held its turn this long.
PAUSE_AFTER_S = 0.02


class ComputeTurns:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._busy = False
        self._waiting: collections.deque[object] = collections.deque()
        self._last: dict[int, float] = {}  # id of an engine -> when its last turn ended
        self._since = 0.0  # when the turn being held began (or resumed after a pause)
        self.num_pauses = 0

    def contended(self) -> bool:
        """Another engine waits for its turn: a step should not run ahead into the next one."""
        return bool(self._waiting)

    def others_active(self, owner: object) -> bool:
        """Whether an engine other than `owner` waits for a turn or took one just now."""
        if self._waiting:
            return True
        since = time.monotonic() - ACTIVE_WINDOW_S
        with self._lock:
            return any(at > since for key, at in self._last.items() if key != id(owner))

    @contextlib.contextmanager
    def turn(self, owner: object) -> Iterator[None]:
        """Hold the device for one step of `owner` (blocks its thread until its turn)."""
        with self._lock:
            if self._busy or self._waiting:
                self._wait_in_line()
            self._busy = True
            self._since = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._release(owner)

    def pause(self, owner: object) -> None:
        """Inside `owner`'s turn, between two parts of its step: if another engine waits and the
        turn is PAUSE_AFTER_S old, let the engines waiting go first, then take the device back."""
        if not self._waiting or time.monotonic() - self._since < PAUSE_AFTER_S:
            return
        with self._lock:
            if not self._waiting:
                return
            self._release(owner)
            self._wait_in_line()
            self._busy = True
            self._since = time.monotonic()
            self.num_pauses += 1

    def _wait_in_line(self) -> None:
        """Queue behind the engines waiting and wait for the device (holding the lock)."""
        ticket = object()
        self._waiting.append(ticket)
        while self._busy or self._waiting[0] is not ticket:
            self._changed.wait()
        self._waiting.popleft()

    def _release(self, owner: object) -> None:
        self._busy = False
        self._last[id(owner)] = time.monotonic()
        self._changed.notify_all()
