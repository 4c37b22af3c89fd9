"""One tokenizer process of a pool (processes.py): the process's side (`serve`: tokenizers in,
jobs run, results or the error out) and the parent's handle on it (`TokenizerWorker`: its start
at a low priority, a job's reply under its deadline, the tokenizers it holds, its kill)."""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import time
from collections.abc import Callable
from typing import Any

from engine.protocol import EngineError, InvalidRequestError

NICENESS = 10
# A process's start (imports) and a tokenizer's arrival; neither counts against a job.
SETUP_TIMEOUT_S = 120.0
# An idle-class job's deadline is CPU time, and this many times as long in wall time.
LOW_WALL_FACTOR = 6
LOW_WALL_MIN_S = 5.0
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class WorkerFailed(EngineError):
    """A tokenizer process failed in a way that is not the request's fault."""


def trim_heap() -> None:
    """Give the C heap's free pages back to the system (glibc keeps what a dropped
    tokenizer's Rust and Python objects freed; elsewhere this does nothing)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).malloc_trim(0)


def serve(conn) -> None:
    """A worker process: tokenizers in, jobs run, results (or the error) out."""
    tokenizers: collections.OrderedDict[int, Any] = collections.OrderedDict()
    with contextlib.suppress(OSError):
        # Below the engine and the web threads (SCHED_IDLE where there is one: lower): a flood
        # of long renders takes the CPU the decode steps leave, not theirs.
        os.nice(NICENESS)
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if message[0] == "tokenizer":
                _, key, blob, evict = message
                for old in evict:
                    tokenizers.pop(old, None)
                if evict:
                    trim_heap()
                tokenizers[key] = pickle.loads(blob)
                conn.send(("ok", None))
            else:
                _, key, fn, args = message
                conn.send(("ok", fn(tokenizers[key], *args)))
        except InvalidRequestError as exc:
            conn.send(("invalid", str(exc), exc.param, exc.code))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def cpu_seconds(pid: int | None) -> float | None:
    """The CPU time a process has used (Linux's /proc), or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime


def lower(pid: int) -> None:
    """Linux's idle scheduling class for a process of long jobs, from its start (its imports
    included). Measured here on 2 cores: two busy processes at nice 19 made a chat's first token
    3.3x slower (MLX's CPU kernels wait for their every thread, so a kernel thread delayed by
    a nice process stalls the step), two at SCHED_IDLE 1.3x: a task of that class never
    delays one that wakes."""
    with contextlib.suppress(OSError, AttributeError):  # no SCHED_IDLE (macOS): nice alone
        os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0))


class TokenizerWorker:
    def __init__(self, context, low: bool = False) -> None:
        self.low = low
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=serve, args=(child,), daemon=True, name="orchard-tokenizer"
        )
        self.process.start()
        if low:
            lower(self.process.pid)
        child.close()
        self.tokenizers: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.idle_since = time.monotonic()
        if self.reply(SETUP_TIMEOUT_S) is None:
            self.kill()
            raise WorkerFailed("A tokenizer process did not start in time.")

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def reply(self, timeout_s: float | None) -> tuple | None:
        """The next message from the process; None if none came within `timeout_s`."""
        if not self.conn.poll(timeout_s):
            return None
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            raise WorkerFailed("A tokenizer process ended unexpectedly.") from None

    def job_reply(self, timeout_s: float | None) -> tuple | None:
        """A job's answer; None once the job is past `timeout_s`. In the idle class that is
        `timeout_s` of the process's CPU time (a job a busy engine leaves no CPU is slow, not
        long), and at most LOW_WALL_FACTOR times as long in all (LOW_WALL_MIN_S at least)."""
        start = cpu_seconds(self.pid) if self.low and timeout_s is not None else None
        if start is None:
            return self.reply(timeout_s)
        deadline = time.monotonic() + max(timeout_s * LOW_WALL_FACTOR, LOW_WALL_MIN_S)
        while True:
            used = cpu_seconds(self.pid)
            left = min(timeout_s - (used - start if used is not None else 0.0), 0.25)
            if left <= 0 or time.monotonic() >= deadline:
                return None
            answer = self.reply(left)
            if answer is not None:
                return answer

    def ensure_tokenizer(self, key: int, pickled: Callable[[], bytes], keep: int) -> None:
        """Make sure the process holds tokenizer `key`, keeping at most `keep` in all."""
        if key in self.tokenizers:
            self.tokenizers.move_to_end(key)
            return
        evict = []
        while len(self.tokenizers) >= keep:
            evict.append(self.tokenizers.popitem(last=False)[0])
        self.conn.send(("tokenizer", key, pickled(), evict))
        answer = self.reply(SETUP_TIMEOUT_S)
        if answer is None or answer[0] != "ok":
            raise WorkerFailed(f"A tokenizer could not be sent to its process: {answer}")
        self.tokenizers[key] = None

    def kill(self) -> None:
        """Stop the process and wait until it is gone."""
        self.process.kill()
        self.process.join()
        self.conn.close()
