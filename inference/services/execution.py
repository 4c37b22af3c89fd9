"""One execution of engine requests for a /v1 call: admission, usage row, engine streams.

`Execution.start()` admits the request (limits), opens its usage row and starts the engine streams;
errors up to the first output become proper HTTP errors. `outputs()` yields engine outputs in
arrival order; a non-streamed response is just this stream aggregated. Whatever happens (finished,
client gone, engine error, a cancellation before the body was ever read), `finish()` runs exactly
once and never raises: it closes the engine streams (which aborts what is still running), finishes
the usage row with the tokens the client actually received (retried in the background if the
database refuses, never lost) and releases the limiter reservation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
import weakref
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.utils import timezone

from accounts import limits
from accounts.models import ApiKey
from common.request_threads import detach
from engine import (
    EngineError,
    EngineOverloadedError,
    GenerationOutput,
    GenerationRequest,
    InvalidRequestError,
    ModelNotLoadedError,
    ModelUnavailableError,
)
from inference.errors import APIError
from inference.models import UsageRecord
from inference.services import metrics
from inference.services.engines import after_engines_stop, get_engine_client
from inference.services.output import FAILURE_CODES
from inference.services.refusals import admission_refused
from inference.services.usage import usage_finish, usage_open

logger = logging.getLogger(__name__)

ERROR_RELOADING = "The model is being reloaded; please retry shortly."
# The response waits this long for its usage row; a slower write (a busy database) finishes in
# the background. A write the database refuses is retried after each of these delays, then
# every minute for as long as a request may live (PARALLEL_LEASE_SECONDS); after that the row
# stays in progress for the start-up sweep.
USAGE_WRITE_WAIT_S = 2.0
USAGE_RETRY_DELAYS_S = (0.5, 1, 2, 5, 10, 30)
USAGE_RETRY_FOR_S = limits.PARALLEL_LEASE_SECONDS
ERROR_SERVER_SHUTDOWN = "server_shutdown"

# Executions whose usage row is open, for `finish_open_executions` when the process exits.
_open_executions: weakref.WeakValueDictionary[int, Execution] = weakref.WeakValueDictionary()


def finish_open_executions() -> int:
    """At process exit (after the server has stopped its event loop): finish every usage row
    still open as failed (`server_shutdown`) with the tokens counted so far, synchronously.
    Their clients' connections were closed by the server's shutdown; no row stays open for the
    next start's sweep. Returns how many rows this finished."""
    finished = 0
    for execution in list(_open_executions.values()):
        if execution._usage_id is None:
            continue
        try:
            finished += usage_finish(
                record_id=execution._usage_id,
                status=UsageRecord.Status.FAILED,
                prompt_tokens=execution.num_prompt_tokens,
                cached_tokens=execution.num_cached_tokens,
                completion_tokens=execution.num_completion_tokens,
                time_to_first_token_ms=execution._first_token_ms,
                error_code=ERROR_SERVER_SHUTDOWN,
            )
        except Exception:
            logger.exception("usage row of %s left open at exit", execution.request_id)
    return finished


def _finish_open_rows() -> None:
    count = finish_open_executions()
    if count:
        logger.info("finished %d usage row(s) of requests cut off by the shutdown", count)


after_engines_stop(_finish_open_rows)


async def _outlast_cancellation(future: asyncio.Future):
    """`future`'s result, waiting for it even if this task is cancelled again meanwhile."""
    while True:
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.done():
                return future.result()


def _start_error(exc: BaseException, name: Callable[[str | None], str | None]) -> BaseException:
    """The HTTP error for an engine error raised before the first output (`name` turns the
    engine's parameter names into the body's)."""
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=name(exc.param), code=exc.code)
    if isinstance(exc, EngineOverloadedError):
        return APIError(
            503, "The model is overloaded with requests; please retry shortly.", code=exc.code
        )
    if isinstance(exc, ModelNotLoadedError):
        return APIError(503, ERROR_RELOADING, code=exc.code)
    if isinstance(exc, ModelUnavailableError):
        return APIError(503, str(exc), code=exc.code)
    if isinstance(exc, EngineError):
        return APIError(500, f"Engine error: {exc}", code=exc.code)
    return exc


@dataclass
class ChoiceOutput:
    """An engine output tagged with the response-level choice index."""

    choice: int
    output: GenerationOutput


@dataclass
class Execution:
    """`flexible`: the caller fixed no max_tokens, so admission may grant fewer tokens than
    `reserved_tokens` (what the tpm window and budget have left); the requests' max_tokens are
    then cut to fit, and those generations end with finish_reason "length" there."""

    api_key: ApiKey
    model: str
    endpoint: str
    request_id: str
    requests: list[GenerationRequest]
    flexible: bool = False
    param_name: Callable[[str | None], str | None] = lambda param: param
    headers: dict[str, str] = field(default_factory=dict)
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_completion_tokens: int = 0
    _admission: limits.Admission | None = None
    _usage_id: int | None = None
    _streams: list[AsyncIterator[GenerationOutput]] = field(default_factory=list)
    _pumps: list[asyncio.Task] = field(default_factory=list)  # reading several streams at once
    _primed: list[GenerationOutput | None] = field(default_factory=list)
    _open_choices: list[int] = field(default_factory=list)
    _started_at: float = field(default_factory=time.monotonic)
    _first_token_ms: int | None = None
    _last_token_at: dict[int, float] = field(default_factory=dict)  # per choice, for metrics
    _choice_tokens: dict[int, int] = field(default_factory=dict)
    _finished: bool = False
    _finish_task: asyncio.Task | None = None
    _failure: str | None = None  # set by `fail`: the response broke outside the engine

    def __post_init__(self) -> None:
        self.num_prompt_tokens = sum(len(r.prompt_token_ids) for r in self.requests)
        self._open_choices = [r.sampling.n for r in self.requests]

    @property
    def num_choices(self) -> int:
        return sum(r.sampling.n for r in self.requests)

    @property
    def reserved_tokens(self) -> int:
        return self.num_prompt_tokens + sum(
            (r.sampling.max_tokens or 0) * r.sampling.n for r in self.requests
        )

    @property
    def choices_per_request(self) -> int:
        return self.requests[0].sampling.n

    async def start(self) -> None:
        try:
            self._admission = await limits.admit(
                self.api_key,
                reserved_tokens=self.reserved_tokens,
                min_tokens=self.num_prompt_tokens + self.num_choices if self.flexible else None,
            )
        except (limits.RateLimitExceeded, limits.LimiterUnavailable) as exc:
            raise await admission_refused(
                exc,
                request_id=self.request_id,
                api_key=self.api_key,
                model=self.model,
                endpoint=self.endpoint,
            ) from None
        if self.flexible and self._admission.granted_tokens < self.reserved_tokens:
            self._fit_to(self._admission.granted_tokens)
        self.headers = dict(self._admission.headers)
        opening = asyncio.ensure_future(
            sync_to_async(usage_open)(
                request_id=self.request_id,
                api_key=self.api_key,
                model=self.model,
                endpoint=self.endpoint,
                reserved_tokens=self.reserved_tokens,
            )
        )
        # The engine starts on the prompt while the row is written: the first token does not
        # wait for the database.
        starting = asyncio.ensure_future(self._start_streams())
        try:
            record = await asyncio.shield(opening)
        except asyncio.CancelledError:
            # The client left while the row was being written: the write goes on in its thread,
            # so wait for it and finish the row as cancelled rather than leave it open.
            await self._abandon(starting)
            try:
                self._usage_id = (await _outlast_cancellation(opening)).pk
            finally:
                await self.finish(UsageRecord.Status.CANCELLED, error_code="client_disconnected")
            raise
        except BaseException:
            await self._abandon(starting)
            await asyncio.shield(self._release(used_tokens=0))
            raise
        self._usage_id = record.pk
        _open_executions[id(self)] = self
        # If the request task ends by any route that skips outputs() (a cancellation between
        # returning the response and reading its body, say), finish() still runs.
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(self._on_request_task_done)
        try:
            await starting
        except BaseException as exc:
            status = (
                UsageRecord.Status.CANCELLED
                if isinstance(exc, asyncio.CancelledError)
                else UsageRecord.Status.FAILED
            )
            await self.finish(status, error_code=getattr(exc, "code", "") or "")
            error = _start_error(exc, self.param_name)
            if error is exc:
                raise
            raise error from None

    async def _abandon(self, starting: asyncio.Future) -> None:
        """Stop the engine streams of a start that cannot go on (aborting their requests)."""
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        for stream in self._streams:
            with contextlib.suppress(Exception):
                await stream.aclose()

    def _fit_to(self, granted: int) -> None:
        """Share a smaller grant out as the completion tokens of every choice (each gets at
        least one: admission granted the prompt plus one per choice)."""
        per_choice = (granted - self.num_prompt_tokens) // self.num_choices
        self.requests = [
            dataclasses.replace(
                request,
                sampling=dataclasses.replace(
                    request.sampling,
                    max_tokens=min(request.sampling.max_tokens, per_choice),
                    min_tokens=min(request.sampling.min_tokens, per_choice),
                ),
            )
            for request in self.requests
        ]

    async def _start_streams(self) -> None:
        """Submit every request (several prompts are queued together, so they can prefill
        together), then wait for each one's first output: validation errors and overload surface
        there, before any header is sent."""
        client = get_engine_client()
        self._streams = [aiter(client.generate(request)) for request in self.requests]
        firsts = [asyncio.ensure_future(anext(stream)) for stream in self._streams]
        try:
            await asyncio.wait(firsts, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            # On an error (or our own cancellation) the others stop too; cancelling a pending
            # first output closes its stream, which aborts that request in the engine.
            pending = [task for task in firsts if not task.done()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        for task in firsts:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        self._primed = [task.result() for task in firsts]

    async def outputs(self) -> AsyncIterator[ChoiceOutput]:
        status, error_code = UsageRecord.Status.CANCELLED, "client_disconnected"
        try:
            async with contextlib.aclosing(self._merged()) as merged:
                async for index, output in merged:
                    choice = index * self.choices_per_request + output.index
                    self._account(choice, output)
                    # Set before yielding: a consumer that stops at a failure ends us right here.
                    if output.finish_reason in FAILURE_CODES:
                        status = UsageRecord.Status.FAILED
                        error_code = FAILURE_CODES[output.finish_reason]
                    yield ChoiceOutput(choice, output)
            if status != UsageRecord.Status.FAILED:
                status, error_code = UsageRecord.Status.COMPLETED, ""
        except EngineError as exc:
            status, error_code = UsageRecord.Status.FAILED, exc.code or "engine_error"
            raise
        except Exception:
            status, error_code = UsageRecord.Status.FAILED, "server_error"
            raise
        finally:
            if self._failure is not None:
                status, error_code = UsageRecord.Status.FAILED, self._failure
            await self.finish(status, error_code=error_code)

    def fail(self, error_code: str) -> None:
        """Record that the response failed on the server's side while its outputs were being
        read (a bug formatting them): the usage row says failed, not cancelled."""
        self._failure = error_code

    def _account(self, choice: int, output: GenerationOutput) -> None:
        now = time.monotonic()
        if output.token_ids and self._first_token_ms is None:
            self._first_token_ms = int((now - self._started_at) * 1000)
        if output.token_ids:
            last = self._last_token_at.get(choice)
            if last is not None:
                gap = (now - last) / len(output.token_ids)
                metrics.inter_token(self.model, gap, len(output.token_ids))
            self._last_token_at[choice] = now
        self.num_completion_tokens += len(output.token_ids)
        received = self._choice_tokens.get(choice, 0) + len(output.token_ids)
        self._choice_tokens[choice] = received
        if output.finish_reason is not None and output.num_generated_tokens > received:
            # Events lost on the way from a remote worker: bill what the engine generated.
            self.num_completion_tokens += output.num_generated_tokens - received

    async def _merged(self) -> AsyncIterator[tuple[int, GenerationOutput]]:
        counted: set[int] = set()

        def note_prompt(index: int, output: GenerationOutput) -> None:
            if output.finish_reason is not None:
                self._open_choices[index] -= 1
            # n choices share one prompt: its cached tokens count once, as OpenAI counts them.
            if index not in counted and output.num_prompt_tokens:
                counted.add(index)
                self.num_cached_tokens += output.num_cached_tokens

        if len(self._streams) == 1:
            first = self._primed[0]
            if first is not None:
                note_prompt(0, first)
                yield 0, first
            async for output in self._streams[0]:
                note_prompt(0, output)
                yield 0, output
            return
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(index: int) -> None:
            try:
                first = self._primed[index]
                if first is not None:
                    await queue.put((index, first))
                async for output in self._streams[index]:
                    await queue.put((index, output))
            except BaseException as exc:  # re-raised in the consumer below
                await queue.put((index, exc))
                return
            await queue.put((index, done))

        self._pumps = [asyncio.create_task(pump(i)) for i in range(len(self._streams))]
        remaining = len(self._pumps)
        try:
            while remaining:
                index, item = await queue.get()
                if item is done:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    note_prompt(index, item)
                    yield index, item
        finally:
            await self._stop_pumps()

    async def _stop_pumps(self) -> None:
        # A stream must not be closed while its pump is still inside it: that raises (and
        # logged, once per stream) "aclose(): asynchronous generator is already running".
        pumps, self._pumps = self._pumps, []
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)

    def _on_request_task_done(self, _task: asyncio.Task) -> None:
        if not self._finished:
            self._finish_task = detach(
                self.finish(UsageRecord.Status.CANCELLED, error_code="client_disconnected")
            )

    async def finish(self, status: str, *, error_code: str = "") -> None:
        """End the execution once: never raises (it runs at the end of every response)."""
        if self._finished:
            return
        self._finished = True
        # Detached and shielded: neither a cancellation of the request task nor the request
        # ending (its sync thread goes back to the pool) may skip the accounting.
        await asyncio.shield(detach(self._finish(status, error_code)))

    async def _finish(self, status: str, error_code: str) -> None:
        metrics.request_finished(
            endpoint=self.endpoint,
            model=self.model,
            status=status,
            prompt_tokens=self.num_prompt_tokens,
            cached_tokens=self.num_cached_tokens,
            completion_tokens=self.num_completion_tokens,
            time_to_first_token_ms=self._first_token_ms,
        )
        # The request task may end (a client gone while a chunk was being sent) with the
        # outputs still suspended mid-stream: stop their readers first. Then closing a stream
        # that is still open aborts its request in the engine (once).
        await self._stop_pumps()
        for stream in self._streams:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    logger.exception("closing an engine stream of %s failed", self.request_id)
        # The usage row first: a limiter re-seeding its budget from the database in between
        # then counts this request twice (safe) rather than not at all.
        if self._usage_id is not None:
            await self._finish_usage(
                functools.partial(
                    usage_finish,
                    record_id=self._usage_id,
                    status=status,
                    prompt_tokens=self.num_prompt_tokens,
                    cached_tokens=self.num_cached_tokens,
                    completion_tokens=self.num_completion_tokens,
                    time_to_first_token_ms=self._first_token_ms,
                    error_code=error_code,
                    finished_at=timezone.now(),
                )
            )
        await self._release(used_tokens=self.num_prompt_tokens + self.num_completion_tokens)
        _open_executions.pop(id(self), None)

    async def _finish_usage(self, write: Callable[[], bool]) -> None:
        """Finish the row (writing it twice is safe: a finished row is left alone)."""
        first = asyncio.ensure_future(sync_to_async(write)())
        try:
            await asyncio.wait_for(asyncio.shield(first), USAGE_WRITE_WAIT_S)
            return
        except TimeoutError:
            logger.warning("usage row of %s is slow to write; finishing it later", self.request_id)
        except Exception:
            logger.exception("usage row of %s not finished; retrying", self.request_id)
        detach(_retry_usage(first, write, self.request_id))

    async def _release(self, *, used_tokens: int) -> None:
        if self._admission is None:
            return
        try:
            await self._admission.release(used_tokens=used_tokens)
        except Exception:
            # The reservation lapses on its own (tpm window, parallel lease).
            logger.exception("limiter release of %s failed", self.request_id)

    def usage(self) -> dict:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens},
        }


async def _retry_usage(first: asyncio.Future, write: Callable[[], bool], request_id: str) -> None:
    try:
        await first  # a slow first write may still succeed
        return
    except Exception:
        pass
    deadline = time.monotonic() + USAGE_RETRY_FOR_S
    delays = iter(USAGE_RETRY_DELAYS_S)
    while time.monotonic() < deadline:
        await asyncio.sleep(next(delays, 60))
        try:
            await sync_to_async(write)()
            logger.info("usage row of %s finished on a retry", request_id)
            return
        except Exception as exc:
            logger.warning("usage row of %s still not finished: %s", request_id, exc)
    logger.error("usage row of %s left in progress for the start-up sweep", request_id)
