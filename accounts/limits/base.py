"""What both limiter backends share: limits, verdicts, and the backend-independent half of
admission (the budgets a key spends, seeding, cancellation, the Admission). Refusals and the
x-ratelimit-* headers are in refusals.py."""

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from asgiref.sync import sync_to_async
from django.utils import timezone

from accounts.limits.budgets import BudgetLimit, budget_limits_for, budget_used
from accounts.limits.refusals import (
    ratelimit_headers,
    refusal,
)
from accounts.limits.verdicts import Limits, Status, Verdict
from accounts.models import ApiKey
from common.request_threads import detach

logger = logging.getLogger(__name__)

WINDOW_SECONDS = 60
# A request that outlives its lease stops holding a parallel slot; long enough for any real
# generation, short enough that a crashed process's slots come back.
PARALLEL_LEASE_SECONDS = 3600
# An idle key's budget counter is dropped after this and re-seeded from the database, which
# washes out any drift (e.g. a release lost with a crashed process).
BUDGET_IDLE_SECONDS = 86400


ERROR_UNAVAILABLE = "Rate limits cannot be checked right now; please retry shortly."


class LimiterUnavailable(Exception):
    """The shared counters (Redis) did not answer in time; the API answers 503."""

    code = "limits_unavailable"


@dataclass
class Admission:
    """A granted admission. `release` must run exactly once the request ends, after its usage row
    is finished (the caller's settlement does both); it is idempotent and cannot be interrupted
    half-way by cancellation. An admission from `Limiter.enter` holds a request of the rpm window
    and a parallel slot but no tokens until `reserve`. `budgets` are the budgets the request
    spends (for the alerts that follow it)."""

    headers: dict[str, str]
    granted_tokens: int = 0  # what was reserved: the request's tokens, or less when flexible
    id: str = ""  # the backend's name for this reservation
    budgets: tuple[BudgetLimit, ...] = ()
    _release: Callable[[int, int], Awaitable[None]] | None = field(default=None, repr=False)
    _reserve: Callable[[int, int, int | None], Awaitable[tuple[int, dict[str, str]]]] | None = (
        field(default=None, repr=False)
    )
    _released: bool = field(default=False, repr=False)

    async def reserve(
        self,
        *,
        reserved_tokens: int,
        min_tokens: int | None = None,
        token_cost: int | None = None,
    ) -> None:
        """Reserve the tokens of an entered request (tpm and budgets), as `admit` would: with
        `min_tokens`, what the window and the budgets still allow, but at least that.
        `token_cost` is the most one token of the request's model costs (nano-units): each
        money budget reserves that much per token. Raises RateLimitExceeded and reserves
        nothing when a limit refuses; the caller still releases."""
        reserved = max(0, int(reserved_tokens))
        least = reserved if min_tokens is None else max(0, min(int(min_tokens), reserved))
        if self._reserve is None:
            self.granted_tokens = reserved
            return
        self.granted_tokens, self.headers = await self._reserve(reserved, least, token_cost)

    async def release(self, *, used_tokens: int, used_cost: int = 0) -> None:
        """What the request used: tokens (prompt + completion) and their cost (nano-units,
        what its usage row records), which the budgets count from then on."""
        if self._released or self._release is None:
            self._released = True
            return
        self._released = True
        await self._release(max(0, used_tokens), max(0, used_cost))


async def limits_with_budgets(api_key: ApiKey) -> Limits:
    """The key's limits and the budgets a request of it spends today. Authentication reads the
    budget rows with the key (`api_key.budget_rows`); a key loaded otherwise has them read
    here, off the event loop."""
    day = timezone.now().date()
    if api_key.team_id is None:  # an unsaved key (in tests): only its own budget can apply
        return Limits.of(api_key, budget_limits_for(api_key, day, rows=()))
    rows = getattr(api_key, "budget_rows", None)
    if rows is None:
        budgets = await sync_to_async(budget_limits_for)(api_key, day)
    else:
        budgets = budget_limits_for(api_key, day, rows)
    return Limits.of(api_key, budgets)


# A release the backend could not confirm is retried after each of these delays (releases are
# idempotent); after that the reservation lapses with its window and lease.
RELEASE_RETRY_DELAYS_S = (0.5, 2, 5, 15, 30, 60)


def _in_background(coroutine) -> None:
    """Releases started on behalf of cancelled admissions, and their retries."""
    detach(coroutine)


class Limiter:
    """The backend-independent half: budgets and their seeds, headers, errors, the Admission.

    A request is admitted in one step (`admit`), or in two: `enter` before any work is spent on
    it (it counts in the rpm window and holds a parallel slot, reserving no tokens), then
    `Admission.reserve` once its size is known. A refused entry counts nothing; an entered
    request counts in the rpm window whatever becomes of it (a 400 included). Each budget holds
    its finished usage and the reservations in flight (tokens × rate: 1, or for money the
    model's dearest token), each a lease like a parallel slot."""

    async def admit(
        self,
        api_key: ApiKey,
        *,
        reserved_tokens: int,
        min_tokens: int | None = None,
        token_cost: int | None = None,
    ) -> Admission:
        """Reserve `reserved_tokens`; with `min_tokens`, as many of them as the tpm window and
        the budgets still allow, but at least `min_tokens` (`Admission.granted_tokens` says how
        many). `token_cost`: the most one token costs (nano-units), for money budgets."""
        limits = await limits_with_budgets(api_key)
        reserved = max(0, int(reserved_tokens))
        if limits.unlimited:
            return Admission(headers={}, granted_tokens=reserved)
        least = reserved if min_tokens is None else max(0, min(int(min_tokens), reserved))
        rates = _rates(limits, token_cost)
        verdict, admission_id = await self._verdict(limits, reserved, least, rates, "admit")
        if verdict.status == Status.REJECTED:
            raise refusal(limits, verdict, least, rates)
        return self._admission(limits, verdict, admission_id)

    async def enter(self, api_key: ApiKey, *, budgets_only: bool = False) -> Admission:
        """Let a request in before its size is known, reserving no tokens: refused (counting
        nothing) when the rpm window or the parallel slots are full, or the tpm window or a
        budget has nothing left. `budgets_only`: only the budgets apply (a batch's line, which
        its batch paces instead of the key's windows and slots)."""
        limits = await limits_with_budgets(api_key)
        if budgets_only:
            limits = dataclasses.replace(limits, rpm=None, tpm=None, max_parallel=None)
        if limits.unlimited:
            return Admission(headers={}, budgets=limits.budgets)
        rates = _rates(limits, None)
        verdict, admission_id = await self._verdict(limits, 1, 1, rates, "enter")
        if verdict.status == Status.REJECTED:
            raise refusal(limits, verdict, 1, rates)
        return self._admission(limits, verdict, admission_id, entered=True)

    def _admission(self, limits, verdict, admission_id, *, entered=False) -> Admission:
        async def release(used_tokens: int, used_cost: int) -> None:
            await self._release_or_retry(limits, admission_id, used_tokens, used_cost)

        async def reserve(
            reserved: int, least: int, token_cost: int | None
        ) -> tuple[int, dict[str, str]]:
            rates = _rates(limits, token_cost)
            verdict, _ = await self._verdict(
                limits, reserved, least, rates, "reserve", admission_id=admission_id
            )
            if verdict.status == Status.REJECTED:
                raise refusal(limits, verdict, least, rates)
            return verdict.granted, ratelimit_headers(limits, verdict)

        return Admission(
            headers=ratelimit_headers(limits, verdict),
            granted_tokens=verdict.granted,
            id=admission_id,
            budgets=limits.budgets,
            _release=release,
            _reserve=reserve if entered else None,
        )

    async def _verdict(
        self,
        limits: Limits,
        reserved: int,
        least: int,
        rates: tuple[int, ...],
        mode: str,
        *,
        admission_id: str | None = None,
    ) -> tuple[Verdict, str]:
        admission_id = admission_id or uuid.uuid4().hex
        seeds: list[int | None] = [None] * len(limits.counters)
        while True:
            verdict = await self._check_or_undo(
                limits, admission_id, reserved, least, rates, tuple(seeds), mode
            )
            if verdict.status != Status.NEED_SEED:
                return verdict, admission_id
            for index in verdict.need_seeds:
                seeds[index] = await sync_to_async(budget_used)(limits.counters[index])

    async def _check_or_undo(
        self, limits, admission_id, reserved, least, rates, seeds, mode
    ) -> Verdict:
        """The check, run to its end even if the caller is cancelled meanwhile; a reservation it
        makes for a caller that is gone is released at once instead of leaking until expiry."""
        check = asyncio.ensure_future(
            self._check(limits, admission_id, reserved, least, rates, seeds, mode)
        )
        try:
            return await asyncio.shield(check)
        except asyncio.CancelledError:

            def undo(done: asyncio.Future) -> None:
                if done.cancelled() or done.exception() is not None:
                    return
                if done.result().status == Status.ADMITTED and mode in ("admit", "enter"):
                    _in_background(self._retry_release(limits, admission_id, 0, 0, first=0))

            check.add_done_callback(undo)
            raise
        except LimiterUnavailable:
            # The backend may have reserved before its answer was lost: undo, to be sure (a lost
            # "reserve" is undone by its entry's release).
            if mode in ("admit", "enter"):
                _in_background(self._retry_release(limits, admission_id, 0, 0, first=0))
            raise

    async def _release_or_retry(self, limits, admission_id, used, cost) -> None:
        """Release; if the backend does not answer, retry in the background and return."""
        try:
            await self._release(limits, admission_id, used, cost)
        except LimiterUnavailable:
            _in_background(self._retry_release(limits, admission_id, used, cost))
            raise

    async def _retry_release(self, limits, admission_id, used, cost, first=None) -> None:
        delays = RELEASE_RETRY_DELAYS_S if first is None else (first, *RELEASE_RETRY_DELAYS_S)
        for delay in delays:
            await asyncio.sleep(delay)
            try:
                await self._release(limits, admission_id, used, cost)
                return
            except LimiterUnavailable:
                continue
        logger.error("limiter release of %s abandoned; it lapses on its own", admission_id)

    async def current_use(self, api_key: ApiKey) -> Verdict:
        """The key's counters now, counting nothing (a key without limits has none: zeros)."""
        limits = Limits.of(api_key)
        if limits.unlimited:
            return Verdict(status=Status.ADMITTED)
        return await self._peek(limits)

    async def current_headers(self, api_key: ApiKey) -> dict[str, str]:
        limits = Limits.of(api_key)
        if limits.rpm is None and limits.tpm is None:
            return {}
        return ratelimit_headers(limits, await self._peek(limits))

    async def _check(
        self,
        limits: Limits,
        admission_id: str,
        reserved: int,
        least: int,
        rates: tuple[int, ...],
        seeds: tuple[int | None, ...],
        mode: str,
    ) -> Verdict:
        """Mode "admit": count the request, take a parallel slot and reserve between `least`
        and `reserved` tokens (× each budget's rate in `rates`); "enter": only count the request
        and take the slot (judged as a request of one token); "reserve": reserve the tokens of
        the entered `admission_id`. `seeds[i]` is counter i's finished usage when known;
        Status.NEED_SEED (with `need_seeds`) when a counter needs it."""
        raise NotImplementedError

    async def _peek(self, limits: Limits) -> Verdict:
        raise NotImplementedError

    async def _release(self, limits: Limits, admission_id: str, used: int, cost: int) -> None:
        """End the reservation `admission_id`: the tpm window and the token budgets count
        `used` tokens, the money budgets `cost` nano-units. A second release changes nothing."""
        raise NotImplementedError


def _rates(limits: Limits, token_cost: int | None) -> tuple[int, ...]:
    return tuple(budget.rate(token_cost) for budget in limits.counters)
