"""A metered request's way out: its usage row and its limiter reservation, settled once.

Admission (inference/services/admission.py) hands every request it lets in a `Settlement`:
the reservation, and the tokens the request has used so far (`usage`, which the request keeps
up to date with what its client received). `open()` writes the usage row, in progress, so that
the accounting never depends on the request finishing. `settle()` runs exactly once, whatever
ends the request (finished, client gone, engine error, a cancellation before the body was
read), and never raises: it records the metrics, finishes the row with the tokens the client
received and their cost (retried in the background if the database refuses, never lost), then
releases the reservation with what was used, and hands the budgets it spent to the alerts'
background worker. Rows still open when the process exits are finished by
`settlements_finish_open`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.utils import timezone

from accounts import alerts as budget_alerts
from accounts import limits
from accounts.models import ApiKey
from common.request_threads import detach
from inference.models import UsageRecord
from inference.services import metrics
from inference.services.engines import after_engines_stop
from inference.services.prices import FREE, Price
from inference.services.usage import DEFAULT_TIER, usage_finish, usage_open

logger = logging.getLogger(__name__)

# The response waits this long for its usage row; a slower write (a busy database) finishes in
# the background. A write the database refuses is retried after each of these delays, then
# every minute for as long as a request may live (PARALLEL_LEASE_SECONDS); after that the row
# stays in progress for the start-up sweep.
USAGE_WRITE_WAIT_S = 2.0
USAGE_RETRY_DELAYS_S = (0.5, 1, 2, 5, 10, 30)
USAGE_RETRY_FOR_S = limits.PARALLEL_LEASE_SECONDS
ERROR_SERVER_SHUTDOWN = "server_shutdown"


@dataclass
class Usage:
    """The tokens a request has used so far, as its client received them (the names are those
    of the usage row and of the metrics)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    time_to_first_token_ms: int | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class Settlement:
    api_key: ApiKey
    request_id: str
    model: str
    endpoint: str
    admission: limits.Admission
    service_tier: str = DEFAULT_TIER  # the tier the request is served in, on its usage row
    price: Price = FREE  # what it is billed at: its model's price when it was admitted
    batch_id: str = ""  # a batch line's: its batch (usage rows of batches are reported apart)
    images: int = 0  # the prompts' input images (priced per image)
    usage: Usage = field(default_factory=Usage)
    _usage_id: int | None = None
    _settled: bool = False

    @property
    def headers(self) -> dict[str, str]:
        return dict(self.admission.headers)

    @property
    def granted_tokens(self) -> int:
        return self.admission.granted_tokens

    @property
    def settled(self) -> bool:
        return self._settled

    @property
    def usage_row_id(self) -> int | None:
        """The usage row's id, once `open()` has written it."""
        return self._usage_id

    async def open(self) -> None:
        """Write the usage row (in progress, with the tokens admission reserved). Cancelled
        meanwhile, it still waits for the write, which goes on in its thread: `settle` then
        finishes the row rather than leave it open."""
        opening = asyncio.ensure_future(
            sync_to_async(usage_open)(
                request_id=self.request_id,
                api_key=self.api_key,
                model=self.model,
                endpoint=self.endpoint,
                reserved_tokens=self.admission.granted_tokens,
                service_tier=self.service_tier,
                batch_id=self.batch_id,
                images=self.images,
            )
        )
        try:
            record = await asyncio.shield(opening)
        except asyncio.CancelledError:
            self._opened(await _outlast_cancellation(opening))
            raise
        self._opened(record)

    def _opened(self, record: UsageRecord) -> None:
        self._usage_id = record.pk
        _open_settlements[id(self)] = self

    async def settle(
        self,
        status: str,
        *,
        error_code: str = "",
        stop: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Settle the request once; never raises. `stop` (closing the engine streams, which
        aborts what still runs) goes first, so that the counts are final when they are written.
        Detached and shielded: neither a cancellation of the request task nor the request ending
        (its sync thread goes back to the pool) may skip the accounting."""
        if self._settled:
            return
        self._settled = True
        await asyncio.shield(detach(self._settle(status, error_code, stop)))

    async def _settle(
        self, status: str, error_code: str, stop: Callable[[], Awaitable[None]] | None
    ) -> None:
        if stop is not None:
            try:
                await stop()
            except Exception:
                logger.exception("stopping the engine streams of %s failed", self.request_id)
        usage = dataclasses.asdict(self.usage)
        metrics.request_finished(endpoint=self.endpoint, model=self.model, status=status, **usage)
        # The usage row first: a limiter re-seeding its budget from the database in between
        # then counts this request twice (safe) rather than not at all.
        used_tokens = used_cost = 0  # no row: nothing ran that anyone is billed for
        if self._usage_id is not None:
            used_tokens = self.usage.total_tokens
            # What the row records (usage_finish prices it the same way).
            used_cost = self.price.cost(
                prompt_tokens=self.usage.prompt_tokens,
                cached_tokens=self.usage.cached_tokens,
                completion_tokens=self.usage.completion_tokens,
                images=self.images if self.usage.prompt_tokens else 0,
            ).total
            await self._finish_row(
                functools.partial(
                    usage_finish,
                    record_id=self._usage_id,
                    status=status,
                    error_code=error_code,
                    finished_at=timezone.now(),
                    price=self.price,
                    **usage,
                )
            )
        try:
            await self.admission.release(used_tokens=used_tokens, used_cost=used_cost)
        except Exception:
            # The reservation lapses on its own (tpm window, parallel lease).
            logger.exception("limiter release of %s failed", self.request_id)
        _open_settlements.pop(id(self), None)
        if used_tokens and self.admission.budgets:
            # Alerts are checked and sent by a background worker: never this request's time.
            budget_alerts.spent(self.admission.budgets)

    async def _finish_row(self, write: Callable[[], bool]) -> None:
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


async def _outlast_cancellation(future: asyncio.Future):
    """`future`'s result, waiting for it even if this task is cancelled again meanwhile."""
    while True:
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            if future.done():
                return future.result()


# Settlements whose usage row is open, for `settlements_finish_open` when the process exits.
_open_settlements: weakref.WeakValueDictionary[int, Settlement] = weakref.WeakValueDictionary()


def settlements_finish_open() -> int:
    """At process exit (after the server has stopped its event loop): finish every usage row
    still open as failed (`server_shutdown`) with the tokens counted so far, synchronously.
    Their clients' connections were closed by the server's shutdown; no row stays open for the
    next start's sweep. Returns how many rows this finished."""
    finished = 0
    for settlement in list(_open_settlements.values()):
        if settlement._usage_id is None:
            continue
        try:
            finished += usage_finish(
                record_id=settlement._usage_id,
                status=UsageRecord.Status.FAILED,
                error_code=ERROR_SERVER_SHUTDOWN,
                price=settlement.price,
                **dataclasses.asdict(settlement.usage),
            )
        except Exception:
            logger.exception("usage row of %s left open at exit", settlement.request_id)
    return finished


def _finish_open_rows() -> None:
    count = settlements_finish_open()
    if count:
        logger.info("finished %d usage row(s) of requests cut off by the shutdown", count)


after_engines_stop(_finish_open_rows)
