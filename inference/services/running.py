"""The requests running now, in every web process: their tokens so far, and a cancel from the
admin's running-now page (inference/admin/running.py) that reaches the process running them.

A request runs in the web process that took it, and that process alone holds its stream and
its tokens so far; the page may be served by any process. They meet in the request's usage row,
open (in progress) from admission. Each process keeps its running executions here (`track`)
and, while it has any, one task (`_watch`) does every TICK_S:
- writes each one's tokens so far to its row (only those that changed), so that the page, and
  the usage list, show what it generated rather than 0 / 0;
- reads which of its rows were asked to stop: `running_request_cancel` marks the row (its error
  code, while in progress, is CANCEL_REQUESTED; finishing the row writes the real one), and the
  process running it aborts its engine requests (local or on a remote worker, through its
  engine client), so its client's stream ends at once with an error saying an administrator
  cancelled it and its row is finished as cancelled (its error code FAILURE_CODES[CANCELLED],
  inference/services/output.py).
A process that runs nothing reads and writes nothing. A cancel takes effect within TICK_S. A row
a crashed process left open keeps the tokens it last wrote, which the start-up sweep bills.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Mapping
from typing import Protocol

from asgiref.sync import sync_to_async
from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import QuerySet

from accounts.selectors import teams_owned_by
from common.request_threads import detach
from inference.models import UsageRecord
from inference.services.usage import usage_records_visible_to

logger = logging.getLogger(__name__)

TICK_S = 1.0
CANCEL_REQUESTED = "cancel_requested"  # a row's error code while its cancel is pending
# Requests with no engine stream to abort (their rows are open only for the moment they run).
UNCANCELLABLE_ENDPOINTS = frozenset({"embeddings"})

Counts = tuple[int, int, int]  # prompt, cached, completion tokens


class Running(Protocol):
    """What a running execution (inference/services/execution.py) shows this module."""

    @property
    def usage_row_id(self) -> int | None: ...

    @property
    def request_id(self) -> str: ...

    def counts(self) -> Counts: ...

    async def cancel(self) -> None: ...


# Row id -> (execution, the event loop it runs on); one watcher per loop.
_running: dict[int, tuple[Running, asyncio.AbstractEventLoop]] = {}
_watchers: dict[asyncio.AbstractEventLoop, asyncio.Task] = {}
_wake: dict[asyncio.AbstractEventLoop, asyncio.Event] = {}


def track(execution: Running) -> None:
    """Count `execution` as running in this process (its usage row is open), until `untrack`."""
    row_id = execution.usage_row_id
    if row_id is None:
        return
    loop = asyncio.get_running_loop()
    _running[row_id] = (execution, loop)
    watcher = _watchers.get(loop)
    if watcher is None or watcher.done():
        _wake[loop] = asyncio.Event()
        _watchers[loop] = detach(_watch(loop))


def untrack(execution: Running) -> None:
    row_id = execution.usage_row_id
    entry = _running.get(row_id) if row_id is not None else None
    if entry is None or entry[0] is not execution:
        return
    del _running[row_id]
    loop = entry[1]
    if not any(other is loop for _, other in _running.values()) and loop in _wake:
        _wake[loop].set()  # the watcher ends now, not a tick later


async def running_cancel(*, request_ids: Collection[str]) -> int:
    """Stop the executions of `request_ids` running on this event loop, as an administrator's
    cancel does (their replies end as cancelled; a batch's runner stopping its lines). Returns
    how many it stopped."""
    loop = asyncio.get_running_loop()
    found = [
        ex for ex, lp in list(_running.values()) if lp is loop and ex.request_id in request_ids
    ]
    for execution in found:
        await execution.cancel()
    return len(found)


async def _watch(loop: asyncio.AbstractEventLoop) -> None:
    written: dict[int, Counts] = {}
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_wake[loop].wait(), TICK_S)
            _wake[loop].clear()
            mine = {row_id: ex for row_id, (ex, lp) in list(_running.items()) if lp is loop}
            if not mine:
                return
            counts = {row_id: execution.counts() for row_id, execution in mine.items()}
            changed = {row_id: c for row_id, c in counts.items() if written.get(row_id) != c}
            try:
                stop = await sync_to_async(running_rows_sync)(progress=changed, row_ids=mine)
            except Exception:
                logger.warning("running requests not updated; trying again", exc_info=True)
                continue
            written = {row_id: counts[row_id] for row_id in mine}
            for row_id in stop:
                await mine[row_id].cancel()
    finally:
        if _watchers.get(loop) is asyncio.current_task():
            del _watchers[loop]
            _wake.pop(loop, None)


def running_rows_sync(*, progress: Mapping[int, Counts], row_ids: Collection[int]) -> set[int]:
    """Write the tokens so far of rows still in progress; return those of `row_ids` whose cancel
    was asked for."""
    if progress:
        with transaction.atomic():
            for row_id, (prompt, cached, completion) in progress.items():
                UsageRecord.objects.filter(pk=row_id, status=UsageRecord.Status.IN_PROGRESS).update(
                    prompt_tokens=prompt, cached_tokens=cached, completion_tokens=completion
                )
    asked = UsageRecord.objects.filter(
        pk__in=list(row_ids), status=UsageRecord.Status.IN_PROGRESS, error_code=CANCEL_REQUESTED
    )
    return set(asked.values_list("pk", flat=True))


def running_requests_visible_to(*, user: AbstractBaseUser) -> QuerySet[UsageRecord]:
    """The requests in progress the user may see (usage_records_visible_to), oldest first."""
    rows = usage_records_visible_to(user=user).filter(status=UsageRecord.Status.IN_PROGRESS)
    return rows.select_related("api_key", "user", "team").order_by("started_at")


def running_requests_cancellable_by(*, user: AbstractBaseUser) -> Callable[[UsageRecord], bool]:
    """Whether the user may stop a running request: owners of its team (and superusers) stop
    its generation. One query, however many rows are asked about."""
    owned = set(teams_owned_by(user=user).values_list("pk", flat=True))
    return lambda record: record.team_id in owned and record.endpoint not in UNCANCELLABLE_ENDPOINTS


def running_request_cancel(*, user: AbstractBaseUser, record_id: int) -> bool:
    """Ask the process running the request to stop it (within TICK_S). False when it is no
    longer running, or is not the user's to stop."""
    rows = UsageRecord.objects.filter(
        pk=record_id, status=UsageRecord.Status.IN_PROGRESS, team__in=teams_owned_by(user=user)
    ).exclude(endpoint__in=UNCANCELLABLE_ENDPOINTS)
    return bool(rows.update(error_code=CANCEL_REQUESTED))
