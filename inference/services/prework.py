"""A request's preparation before admission: off the event loop, bounded, and fair between teams.

What a request costs before its tokens are reserved grows with what it sends: reading and
checking its body (JSON, serializers), building and checking its grammar, rendering its prompts
through the chat template, tokenizing embedding inputs. None of it runs on the event loop, which
serves every team. Each is a job of the process's `FairGate`, which runs at most
ORCHARD_PREPARE_WORKERS jobs at once (on as many threads of its own, or the engine's tokenizer
processes), at most ORCHARD_PREPARE_PER_TEAM of one team, and queues at most
ORCHARD_PREPARE_QUEUE_PER_TEAM more of one team (`QueueFull` after that: a 429). A worker that
frees up goes to the next team in turn with a job waiting (round robin), so one team's 64
waiting renders do not delay another team's first.

A job keeps its place until its work has really ended: a caller that goes away (a client that
disconnected) frees nothing while a thread or a tokenizer process still works for it. Renders and
tokenizing are stopped at their deadline (engine/text/processes.py kills the process); grammar
checks are bounded by the grammar budget (inference/services/structured.py); reading a body by
its size limit.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import threading
from collections.abc import Awaitable, Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from django.conf import settings

T = TypeVar("T")

ERROR_QUEUE_FULL = (
    "Too many requests of this team are waiting to be prepared ({running} running, {waiting} "
    "waiting). Try again shortly."
)


class QueueFull(Exception):
    def __init__(self, running: int, waiting: int):
        super().__init__(ERROR_QUEUE_FULL.format(running=running, waiting=waiting))
        self.message = str(self)


@dataclass(eq=False)
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    granted: bool = False


@dataclass
class _Team:
    running: int = 0
    waiting: collections.deque[_Waiter] = field(default_factory=collections.deque)


def _wake(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


class FairGate:
    """Jobs of many teams on `workers` workers: at most `per_team` of a team's at once, at most
    `queue_per_team` more waiting, the next free worker to the next team in turn. Thread-safe:
    callers on several event loops share one gate."""

    def __init__(self, *, workers: int, per_team: int, queue_per_team: int) -> None:
        self.workers = workers
        self.per_team = per_team
        self.queue_per_team = queue_per_team
        self._threads = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="orchard-prep")
        self._lock = threading.Lock()
        self._running = 0
        # Teams with jobs running or waiting, in turn order: a team served goes last.
        self._teams: collections.OrderedDict[Hashable, _Team] = collections.OrderedDict()

    def running(self, team: Hashable | None = None) -> int:
        """Jobs running now (of `team`, or of every team): they count until their work ends."""
        with self._lock:
            if team is None:
                return self._running
            state = self._teams.get(team)
            return state.running if state is not None else 0

    def waiting(self, team: Hashable) -> int:
        with self._lock:
            state = self._teams.get(team)
            return len(state.waiting) if state is not None else 0

    async def run(
        self,
        team: Hashable,
        work: Callable[[], Awaitable[T]],
        *,
        started: Callable[[asyncio.Future], None] | None = None,
    ) -> T:
        """Await `work()` once the gate lets the team's job in (QueueFull if the team's queue
        is full). Cancelled while waiting, the job leaves the queue; cancelled while running,
        the work goes on to its end, holding its place (`started` gets its future, for callers
        that must know when it really ended)."""
        await self._acquire(team)
        try:
            running = asyncio.ensure_future(work())
        except BaseException:
            self._release(team)
            raise
        running.add_done_callback(lambda _: self._release(team))
        if started is not None:
            started(running)
        try:
            return await asyncio.shield(running)
        finally:
            # A failed job's error, raised here, holds this frame in its traceback, and the
            # frame holds the task that holds the error: a cycle (with the job's input) only
            # the cyclic garbage collector would free (common/request_threads.py).
            running = None

    async def in_thread(
        self,
        team: Hashable,
        fn: Callable[..., T],
        *args: Any,
        started: Callable[[asyncio.Future], None] | None = None,
    ) -> T:
        """`fn(*args)` on one of the gate's threads, as a job of `team`."""
        loop = asyncio.get_running_loop()
        job = functools.partial(fn, *args)
        return await self.run(
            team, lambda: loop.run_in_executor(self._threads, job), started=started
        )

    async def _acquire(self, team: Hashable) -> None:
        with self._lock:
            state = self._teams.get(team)
            if state is None:
                # A team with nothing running or waiting was not served lately: it goes first.
                state = self._teams[team] = _Team()
                self._teams.move_to_end(team, last=False)
            if not state.waiting and self._can_run(state):
                self._grant(team, state)
                return
            if len(state.waiting) >= self.queue_per_team:
                error = QueueFull(state.running, len(state.waiting))
                self._forget_if_idle(team, state)
                raise error
            waiter = _Waiter(asyncio.get_running_loop(), asyncio.get_running_loop().create_future())
            state.waiting.append(waiter)
        try:
            await waiter.future
        except asyncio.CancelledError:
            with self._lock:
                granted = waiter.granted
                if not granted:
                    state.waiting.remove(waiter)
                    self._forget_if_idle(team, state)
            if granted:
                self._release(team)
            raise

    def _can_run(self, state: _Team) -> bool:
        return self._running < self.workers and state.running < self.per_team

    def _grant(self, team: Hashable, state: _Team) -> None:
        state.running += 1
        self._running += 1
        self._teams.move_to_end(team)

    def _release(self, team: Hashable) -> None:
        with self._lock:
            state = self._teams[team]
            state.running -= 1
            self._running -= 1
            self._forget_if_idle(team, state)
            while self._running < self.workers:
                turn = next(
                    ((t, s) for t, s in self._teams.items() if s.waiting and self._can_run(s)),
                    None,
                )
                if turn is None:
                    break
                team_turn, state_turn = turn
                waiter = state_turn.waiting.popleft()
                try:
                    waiter.loop.call_soon_threadsafe(_wake, waiter.future)
                except RuntimeError:  # its event loop is closed: nobody waits any more
                    self._forget_if_idle(team_turn, state_turn)
                    continue
                waiter.granted = True
                self._grant(team_turn, state_turn)

    def _forget_if_idle(self, team: Hashable, state: _Team) -> None:
        # Memory follows the teams with work now, not every team ever seen.
        if not state.running and not state.waiting:
            self._teams.pop(team, None)


_gates: dict[tuple[int, int, int], FairGate] = {}
_gates_lock = threading.Lock()


def gate() -> FairGate:
    """The process's gate for the configured sizes."""
    sizes = (
        settings.ORCHARD_PREPARE_WORKERS,
        settings.ORCHARD_PREPARE_PER_TEAM,
        settings.ORCHARD_PREPARE_QUEUE_PER_TEAM,
    )
    with _gates_lock:
        if sizes not in _gates:
            workers, per_team, queue_per_team = sizes
            _gates[sizes] = FairGate(
                workers=workers, per_team=per_team, queue_per_team=queue_per_team
            )
        return _gates[sizes]
