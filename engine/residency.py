"""Which models stay loaded: the residency policy an EngineWorker applies under its lock.

Every model a worker serves holds a reservation in one HostMemory (engine/cache/host.py). A
load that does not fit unloads idle models that are not pinned, least recently used first
(`victims`); a model not pinned unloads after its idle time without requests (`idle`). Pinned
and idle times come from each spec (`ModelSpec.pinned`, `idle_unload_s`) and change without a
reload. No MLX and no locking here: the worker calls in under its own lock.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

from engine.cache.host import HostMemory
from engine.futures import follow
from engine.protocol import ModelCapacityError, ModelSpec

# A request holds its model from its lookup (`EngineWorker.serve`) until it reaches the engine
# (`submit`, `embed`): a held model is not unloaded to make room, so a request rendering its
# prompt finds its model still there. A hold not taken up within this many seconds (a request
# refused before it reached the engine) lapses.
HOLD_S = 10.0
# A load that finds no room tries again every ROOM_POLL_S for ROOM_WAIT_S before it is refused:
# the models holding the memory may be finishing their last requests.
ROOM_WAIT_S = 2.0
ROOM_POLL_S = 0.05
# How often a worker looks for models idle past their time.
IDLE_CHECK_S = 5.0

logger = logging.getLogger(__name__)


class Resident(Protocol):
    """What the policy reads of an engine."""

    spec: ModelSpec

    @property
    def is_serving(self) -> bool: ...

    def has_requests(self) -> bool: ...


class Residency:
    def __init__(self, memory: HostMemory, idle_unload_s: float = 0.0):
        self.memory = memory
        self.idle_unload_s = idle_unload_s  # the default idle time (0: never)
        self.last_used: dict[str, float] = {}  # name -> time.time() of its last request
        self.loaded_at: dict[str, float] = {}  # name -> time.time() its engine began serving
        self._settings: dict[str, tuple[bool, float | None]] = {}  # name -> (pinned, idle s)
        self._holds: dict[str, deque[float]] = {}  # name -> when each hold was taken
        self._idle_checks: threading.Thread | None = None

    def check_idle(self, unload_idle: Callable[[], object], *, stopped: Callable[[], bool]):
        """Call `unload_idle` every IDLE_CHECK_S on a thread of its own (started once) until
        `stopped`."""
        if self._idle_checks is not None:
            return

        def loop() -> None:
            while not stopped():
                time.sleep(self.check_interval())
                try:
                    unload_idle()
                except Exception:
                    logger.exception("could not unload idle models")

        self._idle_checks = threading.Thread(target=loop, name="orchard-idle-models", daemon=True)
        self._idle_checks.start()

    def check_interval(self) -> float:
        """How long until the next idle check: IDLE_CHECK_S, or a quarter of the shortest idle
        time when that is less (a model set to idle out after 2 s does so within 0.5 s)."""
        times = [self.idle_unload_s, *(idle for _, idle in self._settings.values() if idle)]
        shortest = min((t for t in times if t), default=IDLE_CHECK_S * 4)
        return max(0.1, min(IDLE_CHECK_S, shortest / 4))

    def hold(self, name: str) -> None:
        self._holds.setdefault(name, deque()).append(time.monotonic())

    def unhold(self, name: str) -> None:
        holds = self._holds.get(name)
        if holds:
            holds.popleft()

    def is_held(self, name: str) -> bool:
        holds = self._holds.get(name)
        now = time.monotonic()
        while holds and now - holds[0] >= HOLD_S:
            holds.popleft()  # lapsed
        return bool(holds)

    def remember(self, spec: ModelSpec, *, used: bool) -> None:
        self._settings[spec.name] = (spec.pinned, spec.idle_unload_s)
        if used:
            self.touch(spec.name)

    def touch(self, name: str, at: float | None = None) -> None:
        self.last_used[name] = time.time() if at is None else at

    def pinned(self, name: str) -> bool:
        return self._settings.get(name, (False, None))[0]

    def idle_s(self, name: str) -> float:
        own = self._settings.get(name, (False, None))[1]
        return self.idle_unload_s if own is None else own

    def free(self) -> int:
        if self.memory.max_bytes is None:
            return 1 << 62
        return self.memory.max_bytes - self.memory.used()

    def fits_now(self, spec: ModelSpec) -> bool:
        """Whether `spec` can load beside what is loaded, unloading nothing."""
        return self.memory.shortfall(spec) == 0 or self.memory.least(spec) <= self.free()

    def victims(self, spec: ModelSpec, engines: Mapping[str, Resident]) -> list[Resident]:
        """The serving engines to unload so that `spec` loads as it wants (or at least with its
        least): idle (no request running, waiting or on its way), not pinned, least recently
        used first."""
        if self.memory.shortfall(spec) == 0:
            return []
        candidates = [
            (engine, self.last_used.get(name, 0.0))
            for name, engine in engines.items()
            if name != spec.name
            and engine.is_serving
            and not self.pinned(name)
            and not self.is_held(name)
            and not engine.has_requests()
        ]
        return self.memory.victims(spec, candidates)

    def idle(self, engines: Mapping[str, Resident], now: float) -> list[str]:
        """The serving models past their idle time (a busy model's idle time starts again)."""
        names = []
        for name, engine in engines.items():
            idle_s = self.idle_s(name)
            if self.pinned(name) or not idle_s or not engine.is_serving:
                continue
            if engine.has_requests() or self.is_held(name):
                self.touch(name, now)  # idle counts from the end of its work
            elif now - max(self.last_used.get(name, 0.0), self.loaded_at.get(name, now)) >= idle_s:
                names.append(name)
        return names

    def no_room_message(self, spec: ModelSpec) -> str:
        held = self.memory.by_name()
        busy = ", ".join(sorted(n for n in held if n != spec.name)) or "none"
        return (
            f"The model {spec.name!r} is not loaded and the server's memory budget has no room "
            f"for it ({_gib(self.memory.least(spec))} needed, {_gib(max(0, self.free()))} "
            f"free): the models holding it are in use or pinned ({busy}). Retry later."
        )

    def stats(self) -> dict[str, int | None]:
        return {"max_bytes": self.memory.max_bytes, "used_bytes": self.memory.used()}


def wait_for_room(
    future: concurrent.futures.Future,
    again: Callable[[], concurrent.futures.Future],
    *,
    closed: Callable[[], bool],
) -> concurrent.futures.Future:
    """`future`, or where it failed for want of room, a future that tries the load (`again`)
    every ROOM_POLL_S for ROOM_WAIT_S before it fails the same way (on its own thread)."""
    if not (future.done() and isinstance(future.exception(), ModelCapacityError)):
        return future
    waited: concurrent.futures.Future = concurrent.futures.Future()

    def retry() -> None:
        deadline = time.monotonic() + ROOM_WAIT_S
        while True:
            time.sleep(ROOM_POLL_S)
            attempt = again()
            full = attempt.done() and isinstance(attempt.exception(), ModelCapacityError)
            if not full or time.monotonic() > deadline or closed():
                break
        attempt.add_done_callback(lambda done: follow(done, waited))

    threading.Thread(target=retry, name="orchard-room-wait", daemon=True).start()
    return waited


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / (1 << 30):.2f} GiB"
