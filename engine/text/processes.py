"""Tokenizer work in worker processes that a deadline really stops.

Rendering a prompt (Jinja, then the tokenizer) and encoding texts take time that grows with the
input, and neither can be stopped on a thread: the tokenizers library encodes in one Rust call
(about a microsecond a character here, GIL released), so a thread past its deadline would run
on, holding a CPU, for as long as the text is long. So each job runs in a process of a small
pool: a job past its deadline has its process killed (its CPU is free at once) and the caller
gets InvalidRequestError; the call returns only once its job has really ended, so whoever
counts the job (a slot, a queue) counts it until then. `num_running` says how many jobs are
working now.

Processes are spawned (a forked copy of a process that runs MLX and tokenizer threads is not
safe), on first need: a process that never renders starts none. Once a job has used a
tokenizer, the pool warms in the background: every process of it starts (a killed one is
replaced) and is sent that tokenizer, so a job that arrives while other teams' jobs hold the
warm processes waits for neither a start (~1 s) nor a tokenizer (pickled: ~12 MB and ~0.4 s
for Qwen3's). The deadline covers the job only, not a process's start or a tokenizer's arrival.

Memory is bounded by `PoolSize`: each process keeps the last `tokenizers` it was sent (a
process of Qwen3's tokenizer is ~250 MB here, and each more tokenizer adds ~80 MB), and a
process that has run no job for `idle_s` stops, but for the last one of the short jobs' class:
a web process that serves a few models through a busy hour keeps its warm pool, one left alone
for the night gives its memory back to the models.

All processes run below the engine by nice. A job its caller marks `low` (one whose input is
large, so its work is long) runs in processes of their own in Linux's idle scheduling class
(process_worker.lower): a flood of one team's long renders then takes only the CPU the engine
leaves, and never waits for, or holds, a process that the short jobs of everyone else use.
Short jobs stay in the other class: an idle-class task gets almost no CPU while the engine keeps
the cores busy, and a short render must not wait for that. So an idle-class job's deadline
counts its process's CPU time (a job starved of CPU is slow, not runaway; LOW_WALL_FACTOR bounds
its wall time). Warm-up is for the short jobs' processes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import multiprocessing
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.protocol import InvalidRequestError
from engine.text.process_worker import TokenizerWorker, WorkerFailed

logger = logging.getLogger(__name__)

T = TypeVar("T")

PROCESSES = 4
TOKENIZERS_PER_PROCESS = 4
IDLE_S = 300.0
# Tokenizers the parent knows by key (a key is never reused for another tokenizer).
KNOWN_TOKENIZERS = 32
# Pickled tokenizers kept to send to the next process that needs one: pickling holds the GIL
# (~0.4 s for Qwen3's), so each tokenizer is pickled once, not once per process.
PICKLED_TOKENIZERS = 4


@dataclass(frozen=True)
class PoolSize:
    """How much of the machine a pool of tokenizer processes may hold: at most `processes`
    jobs (and processes) of each class at once, `tokenizers` kept in each process, and a
    process idle for `idle_s` stops (the last of the short jobs' class stays)."""

    processes: int = PROCESSES
    tokenizers: int = TOKENIZERS_PER_PROCESS
    idle_s: float = IDLE_S

    def __post_init__(self) -> None:
        if self.processes < 1 or self.tokenizers < 1 or not self.idle_s > 0:
            raise ValueError(f"a pool needs a process, a tokenizer and an idle time: {self}")


class TokenizerProcesses:
    """At most `size.processes` jobs at once, each in a process of its own; more wait their
    turn (first come, first served: callers that need fairness queue before this). A job that
    needs no tokenizer passes None for it."""

    def __init__(self, size: PoolSize | None = None) -> None:
        self.size = size = size or PoolSize()
        self._context = multiprocessing.get_context("spawn")
        self._threads = ThreadPoolExecutor(
            max_workers=size.processes, thread_name_prefix="orchard-tok"
        )
        self._idle: list[TokenizerWorker] = []
        self._keys: collections.OrderedDict[int, tuple[Any, int]] = collections.OrderedDict()
        self._pickled: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._next_key = itertools.count(1)
        self._lock = threading.Lock()
        self._num_workers = {False: 0, True: 0}  # by class (low): idle, working or warming
        self._warming = False
        self._running = 0
        self._closed = False
        self._reaper: threading.Thread | None = None
        self._closing = threading.Event()

    @property
    def num_running(self) -> int:
        """Jobs whose process is working on them now (a killed job counts until it is gone)."""
        with self._lock:
            return self._running

    @property
    def pids(self) -> list[int]:
        """The idle processes' ids (of both classes)."""
        with self._lock:
            return [worker.pid for worker in self._idle if worker.pid is not None]

    async def run(
        self,
        tokenizer: Any,
        fn: Callable[..., T],
        *args: Any,
        timeout_s: float | None,
        timeout_error: InvalidRequestError,
        low: bool = False,
    ) -> T:
        """`fn(tokenizer, *args)` in a process (`fn` a module-level function; in the idle
        class with `low`); raises `timeout_error` once a job past `timeout_s` has been
        stopped."""
        job = functools.partial(self._run, tokenizer, fn, args, timeout_s, timeout_error, low)
        return await asyncio.get_running_loop().run_in_executor(self._threads, job)

    def _run(self, tokenizer, fn, args, timeout_s, timeout_error, low):
        key = self._key(tokenizer)
        pickled = functools.partial(self._pickle, key, tokenizer)
        worker = self._take(key, low)
        try:
            worker.ensure_tokenizer(key, pickled, self.size.tokenizers)
            with self._counted():
                worker.conn.send(("run", key, fn, args))
                answer = worker.job_reply(timeout_s)
                if answer is None:
                    self._discard(worker)  # inside the count: it counts until its process is gone
                    raise timeout_error
        except BaseException:
            if worker.process.is_alive():
                self._discard(worker)
            raise
        self._put(worker)
        if not low:
            self._warm(key, pickled)
        if answer[0] == "ok":
            return answer[1]
        if answer[0] == "invalid":
            raise InvalidRequestError(answer[1], param=answer[2], code=answer[3])
        raise WorkerFailed(answer[1])

    @contextlib.contextmanager
    def _counted(self) -> Iterator[None]:
        with self._lock:
            self._running += 1
        try:
            yield
        finally:
            with self._lock:
                self._running -= 1

    def _key(self, tokenizer: Any) -> int:
        # By identity; the registry holds the tokenizer, so its id cannot be reused meanwhile.
        with self._lock:
            known = self._keys.get(id(tokenizer))
            if known is None:
                known = self._keys[id(tokenizer)] = (tokenizer, next(self._next_key))
                while len(self._keys) > KNOWN_TOKENIZERS:
                    self._keys.popitem(last=False)
            self._keys.move_to_end(id(tokenizer))
            return known[1]

    def _pickle(self, key: int, tokenizer: Any) -> bytes:
        with self._lock:
            blob = self._pickled.get(key)
            if blob is not None:
                self._pickled.move_to_end(key)
                return blob
        blob = pickle.dumps(tokenizer)
        with self._lock:
            self._pickled[key] = blob
            while len(self._pickled) > PICKLED_TOKENIZERS:
                self._pickled.popitem(last=False)
        return blob

    def _take(self, key: int, low: bool = False) -> TokenizerWorker:
        """An idle process of the class, one that has the tokenizer `key` if there is one;
        else a new one."""
        with self._lock:
            if self._closed:
                raise WorkerFailed("The tokenizer processes are closed.")
            idle = [index for index, worker in enumerate(self._idle) if worker.low == low]
            for index in reversed(idle):
                if key in self._idle[index].tokenizers:
                    return self._idle.pop(index)
            if idle:
                return self._idle.pop(idle[-1])
            self._num_workers[low] += 1
            self._start_reaper()
        try:
            return TokenizerWorker(self._context, low)
        except BaseException:
            with self._lock:
                self._num_workers[low] -= 1
            raise

    def _put(self, worker: TokenizerWorker) -> None:
        with self._lock:
            # One started beside the warm-up's may make one too many: it goes.
            if not self._closed and self._num_workers[worker.low] <= self.size.processes:
                worker.idle_since = time.monotonic()
                self._idle.append(worker)
                return
        self._discard(worker)

    def _start_reaper(self) -> None:
        """(Under the lock.) The thread that stops processes idle past `idle_s`."""
        if self._reaper is None:
            self._reaper = threading.Thread(
                target=self._reap_idle, name="orchard-tok-reaper", daemon=True
            )
            self._reaper.start()

    def _reap_idle(self) -> None:
        while not self._closing.wait(min(self.size.idle_s / 4, 15.0)):
            for worker in self._stale(time.monotonic() - self.size.idle_s):
                self._discard(worker)

    def _stale(self, before: float) -> list[TokenizerWorker]:
        """Take the idle processes whose last job ended `before`, but for the newest process
        of the short jobs' class when it is the last of its class (none while the pool warms)."""
        with self._lock:
            if self._warming:
                return []
            stale = [w for w in self._idle if w.idle_since < before]
            short = [w for w in stale if not w.low]
            if short and len(short) == self._num_workers[False]:
                stale.remove(max(short, key=lambda w: w.idle_since))
            for worker in stale:
                self._idle.remove(worker)
            return stale

    def _discard(self, worker: TokenizerWorker) -> None:
        worker.kill()
        with self._lock:
            self._num_workers[worker.low] -= 1

    def _warm(self, key: int, pickled: Callable[[], bytes]) -> None:
        """Once a tokenizer has been used, every process of the pool is started and holds it,
        in the background (at the processes' low priority): a team whose job arrives while
        other teams' jobs hold the warm processes then waits for neither a process's start
        (about a second) nor its tokenizer's arrival (about half a second for Qwen3's)."""
        with self._lock:
            if self._warming or self._closed:
                return
            cold = any(key not in w.tokenizers for w in self._idle if not w.low)
            if self._num_workers[False] >= self.size.processes and not cold:
                return
            self._warming = True
        threading.Thread(
            target=self._warm_up, args=(key, pickled), name="orchard-tok-warm", daemon=True
        ).start()

    def _warm_up(self, key: int, pickled: Callable[[], bytes]) -> None:
        try:
            while True:
                with self._lock:
                    if self._closed:
                        return
                    cold = next(
                        (w for w in self._idle if not w.low and key not in w.tokenizers), None
                    )
                    if cold is not None:
                        self._idle.remove(cold)
                    elif self._num_workers[False] < self.size.processes:
                        self._num_workers[False] += 1
                    else:
                        return
                worker = cold
                try:
                    if worker is None:
                        worker = TokenizerWorker(self._context)
                    worker.ensure_tokenizer(key, pickled, self.size.tokenizers)
                except Exception:
                    logger.warning("could not warm a tokenizer process", exc_info=True)
                    if worker is not None:
                        self._discard(worker)
                    else:
                        with self._lock:
                            self._num_workers[False] -= 1
                    return
                self._put(worker)
        finally:
            with self._lock:
                self._warming = False
                # The warm-up is the pool's use (a job began it): its processes' idle time
                # starts now, the job's own process's included.
                now = time.monotonic()
                for worker in self._idle:
                    if not worker.low:
                        worker.idle_since = max(worker.idle_since, now)

    def close(self) -> None:
        """Stop the idle processes; a job still running stops its own when it ends."""
        self._closing.set()
        with self._lock:
            self._closed, idle, self._idle = True, self._idle, []
        for worker in idle:
            self._discard(worker)
        self._threads.shutdown(wait=False, cancel_futures=True)
