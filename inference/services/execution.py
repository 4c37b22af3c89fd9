"""One execution of engine requests for an admitted /v1 call: its usage row and engine streams.

`Execution.start()` opens the call's usage row (through the `Settlement` admission handed it)
and starts the engine streams; errors up to the first output become proper HTTP errors.
`outputs()` yields engine outputs in arrival order and counts what the client receives into the
settlement's usage; a non-streamed response is just this stream aggregated. Whatever happens
(finished, client gone, engine error, a cancellation before the body was ever read), `finish()`
runs exactly once and never raises: it closes the engine streams (which aborts what is still
running), then settles the usage row and the limiter reservation.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

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
from inference.services import metrics, running
from inference.services.engines import get_engine_client
from inference.services.output import CANCELLED, FAILURE_CODES
from inference.services.settlement import Settlement

logger = logging.getLogger(__name__)

ERROR_RELOADING = "The model is being reloaded; please retry shortly."


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


def _ended_by(exc: BaseException) -> tuple[str, str]:
    """The usage status and error code of a start that `exc` ended."""
    if isinstance(exc, asyncio.CancelledError):
        return UsageRecord.Status.CANCELLED, "client_disconnected"
    return UsageRecord.Status.FAILED, getattr(exc, "code", "") or ""


@dataclass
class Execution:
    """The engine side of an admitted call: `requests` (sized to what admission granted)
    run under `settlement`, which counts the tokens the client receives."""

    settlement: Settlement
    requests: list[GenerationRequest]
    param_name: Callable[[str | None], str | None] = lambda param: param
    _streams: list[AsyncIterator[GenerationOutput]] = field(default_factory=list)
    _pumps: list[asyncio.Task] = field(default_factory=list)  # reading several streams at once
    _primed: list[GenerationOutput | None] = field(default_factory=list)
    _started_at: float = field(default_factory=time.monotonic)
    _last_token_at: dict[int, float] = field(default_factory=dict)  # per choice, for metrics
    _choice_tokens: dict[int, int] = field(default_factory=dict)
    _failure: str | None = None  # set by `fail`: the response broke outside the engine
    _cancelled: bool = False  # set by `cancel`: an administrator stopped it

    def __post_init__(self) -> None:
        self.settlement.usage.prompt_tokens = sum(len(r.prompt_token_ids) for r in self.requests)

    @property
    def model(self) -> str:
        return self.settlement.model

    @property
    def headers(self) -> dict[str, str]:
        return self.settlement.headers

    @property
    def num_choices(self) -> int:
        return sum(r.sampling.n for r in self.requests)

    @property
    def choices_per_request(self) -> int:
        return self.requests[0].sampling.n

    async def start(self) -> None:
        # The engine starts on the prompt while the row is written: the first token does not
        # wait for the database.
        starting = asyncio.ensure_future(self._start_streams())
        try:
            await self.settlement.open()
        except BaseException as exc:
            starting.cancel()  # finish() closes the streams it opened, aborting their requests
            await asyncio.gather(starting, return_exceptions=True)
            status, error_code = _ended_by(exc)
            await self.finish(status, error_code=error_code)
            raise
        running.track(self)  # shown on the running-now page, which may cancel it
        # If the request task ends by any route that skips outputs() (a cancellation between
        # returning the response and reading its body, say), finish() still runs.
        task = asyncio.current_task()
        if task is not None:
            task.add_done_callback(self._on_request_task_done)
        try:
            await starting
        except BaseException as exc:
            status, error_code = _ended_by(exc)
            await self.finish(status, error_code=error_code)
            error = _start_error(exc, self.param_name)
            if error is exc:
                raise
            raise error from None

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
        failed = False
        try:
            async with contextlib.aclosing(self._merged()) as merged:
                async for index, output in merged:
                    if output.finish_reason == "abort" and self._cancelled:
                        output = dataclasses.replace(output, finish_reason=CANCELLED)
                    choice = index * self.choices_per_request + output.index
                    self._account(choice, output)
                    # Set before yielding: a consumer that stops at a failure ends us right here.
                    if output.finish_reason in FAILURE_CODES:
                        failed = True
                        status = UsageRecord.Status.FAILED
                        if output.finish_reason == CANCELLED:
                            status = UsageRecord.Status.CANCELLED
                        error_code = FAILURE_CODES[output.finish_reason]
                    yield ChoiceOutput(choice, output)
            if not failed:
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

    @property
    def usage_row_id(self) -> int | None:
        return self.settlement.usage_row_id

    @property
    def request_id(self) -> str:
        return self.settlement.request_id

    def counts(self) -> tuple[int, int, int]:
        """The prompt, cached and completion tokens so far (for the running-now page)."""
        usage = self.settlement.usage
        return usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens

    async def cancel(self) -> None:
        """Stop the generation for an administrator (inference/services/running.py): its
        engine requests are aborted, its choices end as CANCELLED, its row cancelled."""
        if self._cancelled or self.settlement.settled:
            return
        self._cancelled = True
        client = get_engine_client()
        for request in self.requests:
            await client.abort(request.request_id)

    def fail(self, error_code: str) -> None:
        """Record that the response failed on the server's side while its outputs were being
        read (a bug formatting them): the usage row says failed, not cancelled."""
        self._failure = error_code

    def _account(self, choice: int, output: GenerationOutput) -> None:
        now, usage = time.monotonic(), self.settlement.usage
        if output.token_ids and usage.time_to_first_token_ms is None:
            usage.time_to_first_token_ms = int((now - self._started_at) * 1000)
        if output.token_ids:
            last = self._last_token_at.get(choice)
            if last is not None:
                gap = (now - last) / len(output.token_ids)
                metrics.inter_token(self.model, gap, len(output.token_ids))
            self._last_token_at[choice] = now
        usage.completion_tokens += len(output.token_ids)
        received = self._choice_tokens.get(choice, 0) + len(output.token_ids)
        self._choice_tokens[choice] = received
        if output.finish_reason is not None and output.num_generated_tokens > received:
            # Events lost on the way from a remote worker: bill what the engine generated.
            usage.completion_tokens += output.num_generated_tokens - received

    async def _merged(self) -> AsyncIterator[tuple[int, GenerationOutput]]:
        counted: set[int] = set()

        def note_prompt(index: int, output: GenerationOutput) -> None:
            # n choices share one prompt: its cached tokens count once, as OpenAI counts them.
            if index not in counted and output.num_prompt_tokens:
                counted.add(index)
                self.settlement.usage.cached_tokens += output.num_cached_tokens

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
        if not self.settlement.settled:
            detach(self.finish(UsageRecord.Status.CANCELLED, error_code="client_disconnected"))

    async def finish(self, status: str, *, error_code: str = "") -> None:
        """End the execution once: never raises (it runs at the end of every response)."""
        running.untrack(self)
        await self.settlement.settle(status, error_code=error_code, stop=self._close_streams)

    async def _close_streams(self) -> None:
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
                    logger.exception(
                        "closing an engine stream of %s failed", self.settlement.request_id
                    )

    def usage(self) -> dict:
        usage = self.settlement.usage
        return {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        }
