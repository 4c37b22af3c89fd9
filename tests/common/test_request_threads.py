"""Pooled sync threads for requests, and tasks that outlive their request."""

import asyncio
import gc
import sys
import threading
import time

import pytest
from asgiref.sync import sync_to_async

from common import request_threads
from common.request_threads import ExecutorPool, detach, in_own_thread


def current_thread_name() -> tuple[str, int]:
    return threading.current_thread().name, threading.get_ident()


async def request(*, hold_s: float = 0.0) -> str:
    """What a request does: thread-sensitive sync work, on its thread."""
    if hold_s:
        await sync_to_async(time.sleep)(hold_s)
    return await sync_to_async(current_thread_name)()


async def test_requests_one_after_another_run_on_the_same_pooled_thread():
    first = await in_own_thread(request(), close_connections=False)
    second = await in_own_thread(request(), close_connections=False)
    assert first == second
    assert first[0].startswith("orchard-request")


async def test_requests_at_once_get_threads_of_their_own():
    names = await asyncio.gather(
        *(in_own_thread(request(hold_s=0.05), close_connections=False) for _ in range(4))
    )
    assert len(set(names)) == 4


async def test_an_executor_still_running_a_call_is_not_handed_to_the_next_request():
    pool = ExecutorPool()
    busy = pool.get()
    release = threading.Event()
    busy.submit(release.wait)  # a cancelled sync_to_async call goes on running like this
    pool.put(busy)
    assert pool.get() is not busy
    release.set()
    idle = pool.get()
    pool.put(idle)
    assert pool.get() is idle


async def test_a_detached_task_calls_sync_code_after_its_request_ended():
    """asgiref refuses thread-sensitive calls from a task that outlived its request's pooled
    context; work started with `detach` (finishing a usage row after the client left) must
    not be refused."""
    started = asyncio.Event()
    results = []

    async def late_work():
        started.set()
        await asyncio.sleep(0.05)  # the request is over by now
        results.append(await sync_to_async(current_thread_name)())

    async def request_that_detaches():
        detach(late_work())
        await started.wait()

    await in_own_thread(request_that_detaches(), close_connections=False)
    for _ in range(100):
        if results:
            break
        await asyncio.sleep(0.01)
    assert results and results[0][0].startswith("orchard-request")


async def test_a_plain_task_outliving_its_request_is_refused():
    """Why `detach` exists: the same late call from a plain task raises."""
    outcome = asyncio.get_running_loop().create_future()

    async def late_work():
        await asyncio.sleep(0.05)
        try:
            await sync_to_async(current_thread_name)()
        except RuntimeError as exc:
            outcome.set_result(str(exc))
        else:
            outcome.set_result("ran")

    tasks = []

    async def request_that_leaves_a_task():
        tasks.append(asyncio.ensure_future(late_work()))

    await in_own_thread(request_that_leaves_a_task(), close_connections=False)
    assert "has exited" in await asyncio.wait_for(outcome, 5)


@pytest.mark.django_db(transaction=True)
async def test_detached_work_closes_its_threads_expired_connections(monkeypatch):
    from django.db import connections

    wrappers = []

    def touch_database():
        wrapper = connections["default"]  # this thread's own
        wrapper.cursor().execute("SELECT 1")
        wrappers.append(wrapper)

    monkeypatch.setitem(connections["default"].settings_dict, "CONN_MAX_AGE", 0)
    # A fresh pool: a pooled thread an earlier test used in this process may hold a connection
    # opened under the settings' CONN_MAX_AGE (600 on SQLite), which is not expired yet.
    monkeypatch.setattr(request_threads, "executors", ExecutorPool())
    await detach(sync_to_async(touch_database)())
    assert wrappers and wrappers[0] is not connections["default"]
    for _ in range(100):  # closed after the task, on its thread
        if wrappers[0].connection is None:
            break
        await asyncio.sleep(0.01)
    assert wrappers[0].connection is None


async def test_detached_work_cancelled_before_it_starts_is_closed_not_left_unawaited():
    """A task cancelled before its first step (its loop stopping right after the detach, at a
    server's shutdown or a test's end) never runs the work it wraps: that work is closed, not
    left for the garbage collector to warn that it "was never awaited"."""
    started = []

    async def late_work():
        started.append(True)

    unraisable = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        task = detach(late_work())
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert started == [] and unraisable == []
