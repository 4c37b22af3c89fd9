"""Admission control for API keys: requests per minute, tokens per minute, parallel requests and
budgets (the key's monthly token budget, and the key's, its member's and its team's budgets in
tokens or money: accounts/limits/budgets.py), checked and reserved in one atomic step and
corrected on release.

Two backends with one semantics:
- in-process (REDIS_URL unset, `memory`): counters behind one lock, in this process only.
- Redis (REDIS_URL set, `redis`): Lua scripts, so every process shares the counters.

Counting rules:
- rpm and tpm are sliding 60 s logs, not fixed buckets (which admit twice the limit across a
  bucket edge). A running request counts its reservation in tpm; once released, what it used.
- A budget is its period's finished usage (seeded from the database: `ApiKeyMonthlyUsage` or the
  daily roll-ups, which the usage roll-up keeps in the same transaction as the usage row, and
  advanced by each release) plus the reservations in flight: tokens, or for money the reserved
  tokens at the model's dearest token price (an upper bound of what they can cost). Callers
  finish the usage row before releasing, so a re-seed never misses a request (it may count one
  twice, which errs on the safe side). A request is admitted only if every budget it spends has
  room for its reservation, so what finishes never passes a budget.
- Parallel slots are leases: a crashed process's slots come back after PARALLEL_LEASE_SECONDS.
- A check that fails reserves nothing.
- A flexible admission (`min_tokens`: a request that did not fix its max_tokens) reserves what
  the tpm window and the budget still allow, between `min_tokens` and `reserved_tokens`.
- Two-step admission: `enter` lets a request in before any work is spent on it (it counts in
  the rpm window and holds a parallel slot, but no tokens, refused when no token count could be
  admitted), `Admission.reserve` reserves its tokens once its size is known. An entered request
  counts in the rpm window whatever becomes of it.
- A Redis that does not answer raises LimiterUnavailable (the API answers 503), never a hang.
- A key idle for BUDGET_IDLE_SECONDS loses its counters; its budget is re-seeded from the
  database on its next admission, so memory follows the active keys, not every key ever seen.

State is keyed by the key's prefix (unique, random, not secret), never by its raw value.
"""

import threading
from dataclasses import dataclass

from asgiref.sync import async_to_sync
from django.conf import settings
from django.utils import timezone

from accounts.limits.base import (
    BUDGET_IDLE_SECONDS,
    ERROR_UNAVAILABLE,
    PARALLEL_LEASE_SECONDS,
    WINDOW_SECONDS,
    Admission,
    Limiter,
    LimiterUnavailable,
)
from accounts.limits.budgets import (
    BudgetLimit,
    BudgetUse,
    budget_usage_source,
    budget_used,
    key_budget_uses,
)
from accounts.limits.memory import InProcessLimiter
from accounts.limits.redis import RedisLimiter
from accounts.limits.refusals import (
    CODE_QUOTA,
    CODE_RATE_LIMIT,
    ERROR_BUDGET,
    ERROR_PARALLEL,
    ERROR_REQUESTS,
    ERROR_TOKENS,
    ERROR_TOO_LARGE,
    RateLimitExceeded,
    format_duration,
)
from accounts.models import ApiKey
from accounts.selectors import api_key_month_tokens, month_start

__all__ = [
    "BUDGET_IDLE_SECONDS",
    "CODE_QUOTA",
    "CODE_RATE_LIMIT",
    "ERROR_BUDGET",
    "ERROR_PARALLEL",
    "ERROR_REQUESTS",
    "ERROR_TOKENS",
    "ERROR_TOO_LARGE",
    "ERROR_UNAVAILABLE",
    "PARALLEL_LEASE_SECONDS",
    "WINDOW_SECONDS",
    "Admission",
    "BudgetLimit",
    "BudgetUse",
    "InProcessLimiter",
    "KeyUse",
    "Limiter",
    "LimiterUnavailable",
    "RateLimitExceeded",
    "RedisLimiter",
    "admit",
    "budget_usage_source",
    "budget_used",
    "current_headers",
    "enter",
    "format_duration",
    "get_limiter",
    "key_use",
]

_limiters: dict[str | None, Limiter] = {}
_limiters_lock = threading.Lock()


def get_limiter() -> Limiter:
    """The process-wide limiter for the configured backend."""
    url = settings.REDIS_URL
    with _limiters_lock:
        if url not in _limiters:
            _limiters[url] = RedisLimiter(url=url) if url else InProcessLimiter()
        return _limiters[url]


async def admit(
    api_key: ApiKey,
    *,
    reserved_tokens: int,
    min_tokens: int | None = None,
    token_cost: int | None = None,
) -> Admission:
    """Check and reserve, atomically: 1 request (rpm), `reserved_tokens` (tpm and budgets), 1
    parallel slot. Raises RateLimitExceeded (with headers) and reserves nothing when a limit
    refuses. `reserved_tokens` should be prompt tokens + max_tokens; with `min_tokens`, fewer
    may be granted (never fewer than `min_tokens`): `Admission.granted_tokens` says how many.
    `token_cost` is the most one token of the model costs (nano-units), for money budgets.
    Release with what was used (prompt + completion tokens and their cost, as recorded in the
    usage row), after finishing that row."""
    return await get_limiter().admit(
        api_key, reserved_tokens=reserved_tokens, min_tokens=min_tokens, token_cost=token_cost
    )


async def enter(api_key: ApiKey, *, budgets_only: bool = False) -> Admission:
    """Let a request in before its size is known: 1 request (rpm) and 1 parallel slot, no tokens
    (`Admission.reserve` reserves them later). Raises RateLimitExceeded, counting nothing, if
    the rpm window or the parallel slots are full, or the tpm window or a budget has nothing
    left. Release it like an admission, whatever becomes of the request. `budgets_only`: the
    key's budgets apply, not its rpm, tpm and parallel slots (a line of a batch)."""
    return await get_limiter().enter(api_key, budgets_only=budgets_only)


async def current_headers(api_key: ApiKey) -> dict[str, str]:
    """x-ratelimit-* headers for a response that reserves nothing (e.g. GET /v1/models)."""
    return await get_limiter().current_headers(api_key)


@dataclass(frozen=True)
class KeyUse:
    """What a key has used of its limits now, for the pages; a limit of None is no limit. The
    month's tokens are its finished requests' (its playground keys' included); the minute's and
    the requests running are the limiter's (None when it cannot be asked: Redis down)."""

    month_tokens: int
    budget_tokens: int | None
    requests: int | None
    rpm: int | None
    tokens: int | None
    tpm: int | None
    running: int | None
    max_parallel: int | None
    budgets: tuple[str, ...] = ()  # the key's Budget rows, in words ("2.25 of 3.00 USD ...")

    @property
    def budget_left(self) -> int | None:
        if self.budget_tokens is None:
            return None
        return max(0, self.budget_tokens - self.month_tokens)

    def phrases(self) -> list[str]:
        """In words, for the pages: "1,200 of 50,000 tokens this month (48,800 left)", "2 of
        60 requests this minute", ... (a limit the key has not: only the month's tokens)."""
        month = f"{self.month_tokens:,} tokens this month"
        if self.budget_tokens is not None:
            month = f"{self.month_tokens:,} of {self.budget_tokens:,} tokens this month "
            month += f"({self.budget_left:,} left)"
        out = [month]
        for used, limit, what in (
            (self.requests, self.rpm, "requests this minute"),
            (self.tokens, self.tpm, "tokens this minute"),
            (self.running, self.max_parallel, "running"),
        ):
            if limit is not None:
                out.append(f"{'?' if used is None else f'{used:,}'} of {limit:,} {what}")
        return out + list(self.budgets)


def key_use(api_key: ApiKey) -> KeyUse:
    """The key's use of its limits (a playground key's: those of the key it was made from).
    Synchronous, for views: call it off the event loop."""
    owner = api_key.parent if api_key.parent_id is not None else api_key
    today = timezone.now().date()
    month = api_key_month_tokens(api_key_id=owner.pk, month=month_start(today))
    try:
        now = async_to_sync(get_limiter().current_use)(owner)
    except LimiterUnavailable:
        now = None
    return KeyUse(
        month_tokens=month,
        budget_tokens=owner.budget_tokens,
        requests=None if now is None else now.requests,
        rpm=owner.rpm,
        tokens=None if now is None else now.tokens,
        tpm=owner.tpm,
        running=None if now is None else now.inflight,
        max_parallel=owner.max_parallel,
        budgets=tuple(use.phrase() for use in key_budget_uses(owner, today)),
    )
