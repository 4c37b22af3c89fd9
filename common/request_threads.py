"""Sync threads for ASGI requests, pooled, and tasks that outlive their request.

Django's ASGIHandler enters an asgiref `ThreadSensitiveContext` per request, and asgiref then
starts a new OS thread for that request's thread-sensitive `sync_to_async` calls (and, since
database connections are per thread, a new database connection). On a small request that is
most of its cost. `PooledASGIHandler` hands each request an idle single-thread executor from a
pool instead; the thread and its connection serve request after request.

The price asgiref asks: a task started inside a request that makes a thread-sensitive call
after the request ended is refused ("ThreadSensitiveContext has exited"). Work that may outlive
its request (finishing a usage row after the client left, retries) is started with `detach`,
which runs it in a context of its own with its own thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from asgiref.sync import ThreadSensitiveContext
from django.core.exceptions import RequestAborted
from django.core.handlers.asgi import ASGIHandler
from django.db import close_old_connections

# Idle executors kept for the next requests; more are made when more requests run at once.
IDLE_EXECUTORS = 32


class _RequestExecutor(ThreadPoolExecutor):
    """One thread; knows whether a call is still running on it (a cancelled `sync_to_async`
    leaves its call running), so a busy executor is never handed to the next request."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="orchard-request")
        self._pending = 0
        self._lock = threading.Lock()

    def submit(self, fn, /, *args, **kwargs) -> Future:
        with self._lock:
            self._pending += 1
        future = super().submit(fn, *args, **kwargs)
        future.add_done_callback(self._done)
        return future

    def _done(self, _future: Future) -> None:
        with self._lock:
            self._pending -= 1

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._pending == 0


class ExecutorPool:
    def __init__(self, idle_limit: int = IDLE_EXECUTORS) -> None:
        self._idle: list[_RequestExecutor] = []
        self._idle_limit = idle_limit
        self._lock = threading.Lock()
        self.created = 0

    def get(self) -> _RequestExecutor:
        with self._lock:
            if self._idle:
                return self._idle.pop()  # the most recently used: its thread is warm
            self.created += 1
        return _RequestExecutor()

    def put(self, executor: _RequestExecutor) -> None:
        with self._lock:
            if executor.idle and len(self._idle) < self._idle_limit:
                self._idle.append(executor)
                return
        # Busy (a call outlived its request) or surplus: it ends once its queue is done.
        executor.shutdown(wait=False)


# Requests and detached tasks take their threads from here.
executors = ExecutorPool()


async def in_own_thread(coroutine: Coroutine[Any, Any, Any], *, close_connections: bool) -> Any:
    """Await `coroutine` with its thread-sensitive calls on a pooled thread of its own. With
    `close_connections`, that thread's expired database connections are closed after it (as
    Django's request_finished signal does for requests), without waiting for it: a call the
    coroutine left running (a slow write it stopped waiting for) may still hold that thread."""
    executor = executors.get()
    try:
        async with ThreadSensitiveContext(executor=executor):
            return await coroutine
    finally:
        if close_connections:
            closing = executor.submit(close_old_connections)
            closing.add_done_callback(lambda _: executors.put(executor))
        else:
            executors.put(executor)


class PooledASGIHandler(ASGIHandler):
    """Django's ASGIHandler with each request's sync thread taken from the pool, and without
    the reference cycle Django's leaves behind each request (`listen_for_disconnect`)."""

    async def listen_for_disconnect(self, receive):
        """Django's, ending without an error. Django's raises RequestAborted when the server
        says the client is gone (daphne says so once the response is sent) or is cancelled
        once the response is done; `handle` then takes that error from the task, and its
        traceback holds `handle`'s frame, which holds the task, which holds the error. That
        cycle, with the request and its body's file (some 150 objects a request), was left to
        the cyclic garbage collector, whose full collections walk the heap with the
        interpreter lock held: under one team's flood, every team's requests waited for them
        (bench/isolation.py). Ending quietly changes nothing else: `handle` cancels the view
        when this task ends first, whatever its outcome."""
        try:
            await super().listen_for_disconnect(receive)
        except (RequestAborted, asyncio.CancelledError):
            pass

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        await in_own_thread(self.handle(scope, receive, send), close_connections=False)


# Detached tasks still running (a task needs a reference to finish).
_detached: set[asyncio.Task] = set()


def detach(coroutine: Coroutine[Any, Any, Any]) -> asyncio.Task:
    """Run `coroutine` as a task that may outlive the request that starts it (its
    thread-sensitive calls run on a thread of its own, whatever became of the request)."""
    task = asyncio.get_running_loop().create_task(in_own_thread(coroutine, close_connections=True))
    _detached.add(task)
    task.add_done_callback(_detached.discard)
    # A task cancelled before its first step (its loop stopping) never awaits `coroutine`:
    # closed here, it ends without "was never awaited" (closing a finished one does nothing).
    task.add_done_callback(lambda _: coroutine.close())
    return task
