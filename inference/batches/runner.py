"""The web process's batch runner: a thread with an event loop of its own that claims batches
(as pulls are claimed: one conditional UPDATE, a heartbeat, a lease another process takes over
when the heartbeat stops) and runs each one's lines through the engine in the flex tier.

Each batch keeps up to its concurrency of lines in flight (ORCHARD_BATCH_CONCURRENCY, else its
model's max_num_seqs): the engine fills its rows with them while interactive requests, served
in higher tiers, take rows back as they come (engine/core/scheduler.py); batches of several
teams share the flex tier by the teams' weights like any other requests. Between lines and
with each heartbeat the run checks its batch: cancelled, expired or taken over, it stops its
lines (the engine aborts them at its next step) and finalizes. A process that stops leaves its
batches to the next claim: lines it left running run again, their lost run unbilled
(lifecycle.lines_reset_running).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from datetime import timedelta

from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import close_old_connections, connection
from django.db.models import F, Q
from django.utils import timezone

from accounts.authentication import AuthenticationError, api_key_still_valid
from inference.batch_models import Batch, BatchLine
from inference.batches import lifecycle
from inference.batches.lines import line_run
from inference.errors import APIError
from inference.models import ModelEntry
from inference.services.engines import before_engines_stop
from inference.services.pulls.claims import runner_id
from inference.services.running import running_cancel
from inference.services.usage import usage_discard

logger = logging.getLogger(__name__)

POLL_S = 2.0
HEARTBEAT_S = 0.5
LEASE_S = 10.0
MAX_BATCHES = 8  # run at once by one runner, each of another team
MAX_ATTEMPTS = 10  # takeovers of a batch whose runner stopped, before it is failed
# A line refused for now (the engine's queue or the model's memory full, limits that cannot
# be checked) waits this long and runs again.
RETRY_S = 1.0
RETRY_STATUSES = (429, 503)
ERROR_GAVE_UP = (
    "The processes running this batch stopped {attempts} times before it finished; it is not "
    "resumed again."
)
STOP_EXIT_WAIT_S = 2.0
STOP_REPEAT_S = 0.1
ERROR_LINE_FAILED = "The server had an error while processing this request."


def batch_claim_next(*, runner: str, busy_teams: set[int]) -> Batch | None:
    """The oldest active batch no runner holds (or whose runner stopped), of a team this runner
    runs no batch of, claimed. One batch per team at a time: a batch already keeps the engine's
    rows busy, and a team with many batches must not hold every place of the runner while
    another team's batch waits (the team's next batch starts when this one ends)."""
    cutoff = timezone.now() - timedelta(seconds=LEASE_S)
    waiting = (
        Batch.objects.filter(status__in=Batch.ACTIVE_STATES)
        .filter(Q(runner="") | Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=cutoff))
        .exclude(team_id__in=busy_teams)
        .order_by("created_at")
    )
    for batch in waiting[:20]:
        same = Batch.objects.filter(
            pk=batch.pk, runner=batch.runner, heartbeat_at=batch.heartbeat_at
        )
        taken_over = bool(batch.runner)
        if taken_over and batch.attempts >= MAX_ATTEMPTS:
            errors = [
                {"code": "runner_stopped", "message": ERROR_GAVE_UP.format(attempts=batch.attempts)}
            ]
            same.update(
                status=Batch.Status.FAILED, errors=errors, failed_at=timezone.now(), runner=""
            )
            continue
        if same.update(
            runner=runner,
            heartbeat_at=timezone.now(),
            attempts=F("attempts") + int(taken_over),
        ):
            claimed = Batch.objects.select_related("api_key__team", "api_key__user").get(
                pk=batch.pk
            )
            lifecycle.lines_reset_running(batch=claimed)
            return claimed
    return None


class _Stop(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class BatchRun:
    """One claimed batch, run to its end (or until its runner gives it back)."""

    def __init__(self, batch: Batch, runner: str) -> None:
        self.batch = batch
        self.runner = runner
        self.lines: dict[asyncio.Task, BatchLine] = {}
        self.ending: tuple[str, str, str] | None = None  # how it ends: (status, code, message)
        self.lost = False  # another runner holds it now
        self.giving_back = False  # this process stops: the batch waits for the next claim
        self._changed = asyncio.Event()
        self._look = asyncio.Event()  # check the batch now, not at the next heartbeat
        self._over_budget = 0  # lines refused for a budget, waiting for the others to end

    @property
    def stopping(self) -> bool:
        return bool(self.ending) or self.lost or self.giving_back

    def look(self) -> None:
        self._look.set()

    def give_back(self) -> None:
        self.giving_back = True
        self._changed.set()

    async def run(self) -> None:
        heartbeat = asyncio.create_task(self._heartbeat())
        try:
            finalizing = self.batch.status == Batch.Status.FINALIZING
            if timezone.now() >= self.batch.expires_at and not finalizing:
                self.ending = (Batch.Status.EXPIRED, "", "")
            if self.batch.status == Batch.Status.VALIDATING and not self.stopping:
                self.batch = await _db(
                    lifecycle.batch_validate, batch=self.batch, runner=self.runner
                )
            if self.batch.status == Batch.Status.IN_PROGRESS and not self.stopping:
                await self._run_lines()
            await self._stop_lines()
            if self.batch.status == Batch.Status.CANCELLING and not self.ending:
                self.ending = (Batch.Status.CANCELLED, "", "")
            if self.ending and not (self.lost or self.giving_back):
                ending, code, message = self.ending
                self.lost = not await _db(
                    lifecycle.batch_stop,
                    batch=self.batch,
                    runner=self.runner,
                    ending=ending,
                    code=code,
                    message=message,
                )
            if not (self.lost or self.giving_back):
                self.batch = await _db(Batch.objects.get, pk=self.batch.pk)
                if self.batch.status == Batch.Status.FINALIZING:
                    self.batch = await _db(
                        lifecycle.batch_finalize, batch=self.batch, runner=self.runner
                    )
        finally:
            heartbeat.cancel()
            await self._stop_lines()
            await _db(self._release)

    async def _run_lines(self) -> None:
        limit = await _db(_concurrency, self.batch)
        while not self.stopping:
            room = limit - len(self.lines)
            if room > 0 and not self._over_budget:
                taken = await _db(
                    lifecycle.lines_take, batch=self.batch, runner=self.runner, limit=room
                )
                for line in taken:
                    task = asyncio.create_task(self._line(line))
                    self.lines[task] = line
                    task.add_done_callback(self._line_done)
                if not taken and not self.lines:
                    self.ending = (Batch.Status.COMPLETED, "", "")
                    return
            self._changed.clear()
            await self._changed.wait()

    def _line_done(self, task: asyncio.Task) -> None:
        self.lines.pop(task, None)
        if not task.cancelled() and task.exception() is not None and not self.giving_back:
            logger.error("batch %s: a line broke off", self.batch.id, exc_info=task.exception())
        self._changed.set()

    async def _line(self, line: BatchLine) -> None:
        while True:
            try:
                status, body = await self._answer(line)
            except _Stop as stop:
                self._end(Batch.Status.FAILED, stop.code, stop.message)
                await _db(lifecycle.line_return, line=line)
                return
            if self.stopping and status != 200:
                # Stopped part-way (_stop_lines), or refused while the batch stops: not run.
                await _db(lifecycle.line_return, line=line)
                return
            if status not in RETRY_STATUSES:
                break
            if error_code(body) != "insufficient_quota":  # (that one waited already)
                await asyncio.sleep(RETRY_S)
        if not await _db(
            lifecycle.line_finish, line=line, runner=self.runner, status_code=status, body=body
        ):
            self._lose()

    async def _answer(self, line: BatchLine) -> tuple[int, dict]:
        """The line's answer; _Stop when the batch cannot go on (its key is no longer valid,
        a budget of the key ran out)."""
        # A row of an earlier run of the line is of a run whose answer was lost (its runner
        # stopped, or it was refused for now): this run is the one counted and billed.
        await _db(usage_discard, request_id=line.request_id)
        try:
            api_key = await _db(api_key_still_valid, self.batch.api_key_id)
        except AuthenticationError as exc:
            raise _Stop(exc.code, f"Its API key is no longer valid: {exc.message}") from None
        try:
            status, body = await line_run(
                api_key=api_key,
                batch_id=self.batch.id,
                endpoint=self.batch.endpoint,
                request_id=line.request_id,
                body=line.body,
            )
        except Exception:
            logger.exception("batch %s: line %s failed", self.batch.id, line.index)
            return 500, APIError(500, ERROR_LINE_FAILED).body()
        if status == 429 and error_code(body) == "insufficient_quota":
            # Other lines running hold reservations of the budget larger than what they will
            # use: wait for them to end before taking the budget for spent.
            if len(self.lines) - self._over_budget > 1:
                self._over_budget += 1
                await asyncio.sleep(RETRY_S)  # a 429 is in RETRY_STATUSES: it runs again
                self._over_budget -= 1
                return status, body
            message = body["error"].get("message")
            raise _Stop("insufficient_quota", f"at line {line.index + 1}, {message}")
        return status, body

    def _end(self, status: str, code: str = "", message: str = "") -> None:
        if self.ending is None:
            self.ending = (status, code, message)
        self._changed.set()

    def _lose(self) -> None:
        self.lost = True
        self._changed.set()

    async def _stop_lines(self) -> None:
        """Stop the lines in flight as an administrator's cancel stops a request: the engine
        aborts them at its next step, each line's row bills what was computed, and a line
        that finished first keeps its answer. Lines still preparing are stopped as they
        start generating (the stop is repeated until none is left)."""
        while self.lines:
            request_ids = {line.request_id for line in self.lines.values()}
            await running_cancel(request_ids=request_ids)
            await asyncio.wait(list(self.lines), timeout=STOP_REPEAT_S)

    async def _heartbeat(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._look.wait(), HEARTBEAT_S)
            self._look.clear()
            now = timezone.now()
            if not await _db(self._beat, now):
                self._lose()
                return
            status, expires_at = await _db(
                lambda: Batch.objects.values_list("status", "expires_at").get(pk=self.batch.pk)
            )
            if status == Batch.Status.CANCELLING:
                self._end(Batch.Status.CANCELLED)
            elif now >= expires_at and status != Batch.Status.FINALIZING:
                self._end(Batch.Status.EXPIRED)

    def _release(self) -> None:
        """Give the batch back (its lines left running wait again)."""
        if self.lost:
            return
        BatchLine.objects.filter(batch=self.batch, state=BatchLine.State.RUNNING).update(
            state=BatchLine.State.PENDING
        )
        Batch.objects.filter(pk=self.batch.pk, runner=self.runner).update(
            runner="", heartbeat_at=None
        )

    def _beat(self, now) -> int:
        return Batch.objects.filter(pk=self.batch.pk, runner=self.runner).update(heartbeat_at=now)


def error_code(body: dict) -> str | None:
    return (body.get("error") or {}).get("code")


def _concurrency(batch: Batch) -> int:
    if settings.ORCHARD_BATCH_CONCURRENCY:
        return settings.ORCHARD_BATCH_CONCURRENCY
    entry = ModelEntry.objects.filter(name=batch.model).first()
    return max(1, entry.max_num_seqs if entry is not None else 8)


async def _db(fn, *args, **kwargs):
    return await sync_to_async(_closing(fn), thread_sensitive=False)(*args, **kwargs)


def _closing(fn):
    def call(*args, **kwargs):
        close_old_connections()
        try:
            return fn(*args, **kwargs)
        finally:
            close_old_connections()

    return call


class BatchRunner:
    """Claims batches and runs them (see the module docstring)."""

    def __init__(self, runner: str | None = None) -> None:
        self.runner = runner or runner_id()
        self.running: dict[str, tuple[BatchRun, asyncio.Task]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._main, args=(ready,), name="orchard-batches", daemon=True
        )
        self._thread.start()
        ready.wait()
        before_engines_stop(self.stop)

    def wake(self) -> None:
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def stop(self) -> None:
        """Give every batch back (the next claim resumes them). At process exit this runs after
        Python has shut down its thread pools, so the loop cannot reach the database any more:
        the claims are given back from here, synchronously, and the lines that were running
        run again (their rows, which the exit finishes, discarded then)."""
        self._stopping.set()
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._give_back_all)
        if self._thread is not None:
            self._thread.join(STOP_EXIT_WAIT_S)
        try:
            given = lifecycle.batches_give_back(runner=self.runner)
            logger.info("batch runner %s stopped; %d batch(es) given back", self.runner, given)
        except Exception:
            logger.exception("batches of %s not given back; they are taken over later", self.runner)

    def _give_back_all(self) -> None:
        for run, _ in list(self.running.values()):
            run.give_back()
        if self._wake is not None:
            self._wake.set()

    def _main(self, ready: threading.Event) -> None:
        try:
            asyncio.run(self._serve(ready))
        finally:
            connection.close()

    async def _serve(self, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        ready.set()
        while not self._stopping.is_set():
            try:
                await self._claim()
            except Exception:
                logger.exception("the batch runner failed to claim; trying again")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            for run, _ in list(self.running.values()):
                run.look()  # a batch cancelled here stops now
        self._give_back_all()
        if self.running:
            await asyncio.gather(*(t for _, t in self.running.values()), return_exceptions=True)

    async def _claim(self) -> None:
        while len(self.running) < MAX_BATCHES and not self._stopping.is_set():
            busy = {run.batch.team_id for run, _ in self.running.values()}
            batch = await _db(batch_claim_next, runner=self.runner, busy_teams=busy)
            if batch is None:
                return
            logger.info(
                "batch %s: %s, claimed (attempt %s)", batch.id, batch.status, batch.attempts
            )
            run = BatchRun(batch, self.runner)
            self.running[batch.id] = (run, asyncio.create_task(self._run(run)))

    async def _run(self, run: BatchRun) -> None:
        batch = run.batch
        try:
            await run.run()
        except Exception:
            logger.exception("batch %s: its run failed; it is given back", batch.id)
        finally:
            self.running.pop(batch.id, None)
            self.wake()


_runner: BatchRunner | None = None


def start_batch_runner() -> BatchRunner:
    """Start this process's runner (the web process, at start)."""
    global _runner
    if _runner is None:
        _runner = BatchRunner()
        _runner.start()
    return _runner


def wake_batch_runner() -> None:
    """A batch was made or cancelled here: the runner looks now rather than at its next poll."""
    if _runner is not None:
        _runner.wake()
