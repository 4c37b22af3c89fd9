"""Admission control for API keys: requests per minute, tokens per minute, parallel requests and
the monthly token budget, checked and reserved in one atomic step and corrected on release.

Two backends with one semantics:
- in-process (REDIS_URL unset): counters behind one `threading.Lock`, because the web process may
  run several event-loop threads; nothing is awaited while it is held.
- Redis (REDIS_URL set): one Lua script per admission and per release, so every process shares
  the counters and no read-modify-write race is possible. Keys carry TTLs.

Counting rules:
- rpm and tpm are sliding 60 s logs, not fixed buckets (which admit twice the limit across a
  bucket edge). A running request counts its reservation in tpm; once released, what it used.
- The budget is the month's finished tokens (seeded from `ApiKeyMonthlyUsage`, which the usage
  roll-up keeps in the same transaction as the usage row, and advanced by each release) plus the
  reservations in flight. Callers finish the usage row before releasing, so a re-seed never
  misses a request (it may count one twice, which errs on the safe side).
- Parallel slots are leases: a crashed process's slots come back after PARALLEL_LEASE_SECONDS.
- A check that fails reserves nothing.

State is keyed by the key's prefix (unique, random, not secret), never by its raw value.
"""

import asyncio
import datetime
import threading
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import IntEnum

import redis
from asgiref.sync import sync_to_async
from django.conf import settings
from django.utils import timezone

from accounts.models import ApiKey
from accounts.selectors import api_key_month_tokens, month_start

CODE_RATE_LIMIT = "rate_limit_exceeded"
CODE_QUOTA = "insufficient_quota"

ERROR_REQUESTS = "Rate limit reached for requests per minute (limit {limit}). Try again in {reset}."
ERROR_TOKENS = (
    "Rate limit reached for tokens per minute (limit {limit}, in use {used}, requested "
    "{requested}). Try again in {reset}."
)
ERROR_TOO_LARGE = (
    "Request too large for tokens per minute (limit {limit}, requested {requested}). Lower "
    "max_tokens or shorten the prompt."
)
ERROR_PARALLEL = "Too many parallel requests for this key (limit {limit}). Try again shortly."
ERROR_BUDGET = (
    "This key's monthly token budget is exhausted (budget {limit}, used or reserved {used}, "
    "requested {requested})."
)

WINDOW_SECONDS = 60
# A request that outlives its lease stops holding a parallel slot; long enough for any real
# generation, short enough that a crashed process's slots come back.
PARALLEL_LEASE_SECONDS = 3600
# An idle key's budget counter is dropped after this and re-seeded from the database, which
# washes out any drift (e.g. a release lost with a crashed process).
BUDGET_IDLE_SECONDS = 86400
REDIS_NAMESPACE = "orchard:limits:"


class RateLimitExceeded(Exception):
    def __init__(self, message: str, *, code: str, limit: str, headers: dict[str, str]):
        super().__init__(message)
        self.message = message
        self.code = code
        self.limit = limit  # which limit refused: "requests", "tokens", "parallel", "budget"
        self.headers = headers


@dataclass
class Admission:
    """A granted admission. `release` must run exactly when the request ends (views call it in
    `finally`); it is idempotent and cannot be interrupted half-way by cancellation."""

    headers: dict[str, str]
    _release: Callable[[int], Awaitable[None]] | None = field(default=None, repr=False)
    _released: bool = field(default=False, repr=False)

    async def release(self, *, used_tokens: int) -> None:
        if self._released or self._release is None:
            self._released = True
            return
        self._released = True
        await self._release(max(0, used_tokens))


class _Status(IntEnum):
    ADMITTED = 0
    REJECTED = 1
    NEED_SEED = 2


@dataclass(frozen=True)
class _Limits:
    ident: str
    api_key_id: int
    rpm: int | None
    tpm: int | None
    max_parallel: int | None
    budget: int | None

    @classmethod
    def of(cls, api_key: ApiKey) -> "_Limits":
        return cls(
            ident=api_key.prefix,
            api_key_id=api_key.pk,
            rpm=api_key.rpm,
            tpm=api_key.tpm,
            max_parallel=api_key.max_parallel,
            budget=api_key.budget_tokens,
        )

    @property
    def unlimited(self) -> bool:
        return all(v is None for v in (self.rpm, self.tpm, self.max_parallel, self.budget))

    @property
    def tracks_inflight(self) -> bool:
        return self.max_parallel is not None or self.budget is not None


@dataclass
class _Verdict:
    status: _Status
    reason: str = ""  # "requests" | "tokens" | "too_large" | "parallel" | "budget"
    requests: int = 0  # in the rpm window (after this admission when admitted)
    tokens: int = 0  # in the tpm window
    requests_reset_ms: int = 0  # until the rpm window is empty
    tokens_reset_ms: int = 0
    retry_ms: int = -1  # until the refused limit has room; -1 unknown
    budget_used: int = 0  # finished + in flight, before this request


def format_duration(ms: int) -> str:
    """OpenAI's (Go's) duration format: "20ms", "1s", "1.5s", "6m0s", "1h0m0s"."""
    ms = max(0, int(ms))
    if ms == 0:
        return "0s"
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds = f"{rest / 1000:.3f}".rstrip("0").rstrip(".")
    if hours:
        return f"{hours}h{minutes}m{seconds}s"
    if minutes:
        return f"{minutes}m{seconds}s"
    return f"{seconds}s"


def _headers(limits: _Limits, verdict: _Verdict) -> dict[str, str]:
    headers = {}
    if limits.rpm is not None:
        headers["x-ratelimit-limit-requests"] = str(limits.rpm)
        headers["x-ratelimit-remaining-requests"] = str(max(0, limits.rpm - verdict.requests))
        headers["x-ratelimit-reset-requests"] = format_duration(verdict.requests_reset_ms)
    if limits.tpm is not None:
        headers["x-ratelimit-limit-tokens"] = str(limits.tpm)
        headers["x-ratelimit-remaining-tokens"] = str(max(0, limits.tpm - verdict.tokens))
        headers["x-ratelimit-reset-tokens"] = format_duration(verdict.tokens_reset_ms)
    return headers


def _refusal(limits: _Limits, verdict: _Verdict, reserved: int) -> RateLimitExceeded:
    headers = _headers(limits, verdict)
    reset = format_duration(verdict.retry_ms)
    if verdict.reason == "budget":
        message = ERROR_BUDGET.format(
            limit=limits.budget, used=verdict.budget_used, requested=reserved
        )
        code, limit = CODE_QUOTA, "budget"
    elif verdict.reason == "too_large":
        message = ERROR_TOO_LARGE.format(limit=limits.tpm, requested=reserved)
        code, limit = CODE_RATE_LIMIT, "tokens"
    elif verdict.reason == "tokens":
        message = ERROR_TOKENS.format(
            limit=limits.tpm, used=verdict.tokens, requested=reserved, reset=reset
        )
        code, limit = CODE_RATE_LIMIT, "tokens"
    elif verdict.reason == "requests":
        message = ERROR_REQUESTS.format(limit=limits.rpm, reset=reset)
        code, limit = CODE_RATE_LIMIT, "requests"
    else:
        message = ERROR_PARALLEL.format(limit=limits.max_parallel)
        code, limit = CODE_RATE_LIMIT, "parallel"
    if verdict.reason in ("budget", "too_large"):
        # Waiting cannot help; the official clients honour this header and don't retry.
        headers["x-should-retry"] = "false"
    elif verdict.retry_ms >= 0:
        headers["retry-after-ms"] = str(verdict.retry_ms)
        headers["retry-after"] = str(max(1, -(-verdict.retry_ms // 1000)))
    return RateLimitExceeded(message, code=code, limit=limit, headers=headers)


# Releases started on behalf of cancelled admissions (a task needs a reference to finish).
_background: set[asyncio.Task] = set()


class Limiter:
    """The backend-independent half: seeding, headers, errors, the Admission."""

    async def admit(self, api_key: ApiKey, *, reserved_tokens: int) -> Admission:
        limits = _Limits.of(api_key)
        if limits.unlimited:
            return Admission(headers={})
        reserved = max(0, int(reserved_tokens))
        month = month_start(timezone.now().date())
        admission_id = uuid.uuid4().hex
        seed = None
        while True:
            verdict = await self._check_or_undo(limits, admission_id, reserved, month, seed)
            if verdict.status != _Status.NEED_SEED:
                break
            seed = await sync_to_async(api_key_month_tokens)(
                api_key_id=limits.api_key_id, month=month
            )
        if verdict.status == _Status.REJECTED:
            raise _refusal(limits, verdict, reserved)

        async def release(used_tokens: int) -> None:
            await self._release(limits, admission_id, used_tokens, month)

        return Admission(headers=_headers(limits, verdict), _release=release)

    async def _check_or_undo(self, limits, admission_id, reserved, month, seed) -> _Verdict:
        """The check, run to its end even if the caller is cancelled meanwhile; a reservation it
        makes for a caller that is gone is released at once instead of leaking until expiry."""
        check = asyncio.ensure_future(self._check(limits, admission_id, reserved, month, seed))
        try:
            return await asyncio.shield(check)
        except asyncio.CancelledError:

            def undo(done: asyncio.Future) -> None:
                if done.cancelled() or done.exception() is not None:
                    return
                if done.result().status == _Status.ADMITTED:
                    task = asyncio.ensure_future(self._release(limits, admission_id, 0, month))
                    _background.add(task)
                    task.add_done_callback(_background.discard)

            check.add_done_callback(undo)
            raise

    async def current_headers(self, api_key: ApiKey) -> dict[str, str]:
        limits = _Limits.of(api_key)
        if limits.rpm is None and limits.tpm is None:
            return {}
        return _headers(limits, await self._peek(limits))

    async def _check(
        self, limits: _Limits, admission_id: str, reserved: int, month: datetime.date, seed
    ) -> _Verdict:
        raise NotImplementedError

    async def _peek(self, limits: _Limits) -> _Verdict:
        raise NotImplementedError

    async def _release(
        self, limits: _Limits, admission_id: str, used: int, month: datetime.date
    ) -> None:
        raise NotImplementedError


@dataclass
class _KeyState:
    # Oldest first: admission times; id -> [time, tokens]; id -> (lease end, reserved tokens).
    requests: deque[float] = field(default_factory=deque)
    tokens: dict[str, list] = field(default_factory=dict)
    inflight: dict[str, tuple[float, int]] = field(default_factory=dict)


class InProcessLimiter(Limiter):
    def __init__(
        self,
        *,
        window_seconds: float = WINDOW_SECONDS,
        lease_seconds: float = PARALLEL_LEASE_SECONDS,
    ):
        self._window_ms = window_seconds * 1000
        self._lease_ms = lease_seconds * 1000
        self._lock = threading.Lock()
        self._keys: dict[str, _KeyState] = {}
        self._used: dict[tuple[str, datetime.date], int] = {}

    def _purge(self, state: _KeyState, now: float) -> None:
        horizon = now - self._window_ms
        while state.requests and state.requests[0] <= horizon:
            state.requests.popleft()
        while state.tokens:
            first = next(iter(state.tokens))
            if state.tokens[first][0] > horizon:
                break
            del state.tokens[first]
        while state.inflight:
            first = next(iter(state.inflight))
            if state.inflight[first][0] > now:
                break
            del state.inflight[first]

    def _counts(self, state: _KeyState, now: float) -> _Verdict:
        verdict = _Verdict(status=_Status.ADMITTED)
        verdict.requests = len(state.requests)
        if state.requests:
            verdict.requests_reset_ms = int(state.requests[-1] + self._window_ms - now)
        verdict.tokens = sum(tokens for _, tokens in state.tokens.values())
        if state.tokens:
            newest = state.tokens[next(reversed(state.tokens))][0]
            verdict.tokens_reset_ms = int(newest + self._window_ms - now)
        return verdict

    def _tokens_retry_ms(self, state: _KeyState, excess: int, now: float) -> int:
        freed = 0
        for at, tokens in state.tokens.values():
            freed += tokens
            if freed >= excess:
                return int(at + self._window_ms - now)
        return -1

    async def _check(self, limits, admission_id, reserved, month, seed) -> _Verdict:
        with self._lock:
            now = time.monotonic() * 1000
            state = self._keys.setdefault(limits.ident, _KeyState())
            self._purge(state, now)
            verdict = self._counts(state, now)
            if limits.budget is not None:
                used_key = (limits.ident, month)
                if used_key not in self._used:
                    if seed is None:
                        return _Verdict(status=_Status.NEED_SEED)
                    self._used[used_key] = seed
                in_flight = sum(tokens for _, tokens in state.inflight.values())
                verdict.budget_used = self._used[used_key] + in_flight
                if verdict.budget_used + reserved > limits.budget:
                    verdict.status, verdict.reason = _Status.REJECTED, "budget"
                    return verdict
            if limits.tpm is not None and reserved > limits.tpm:
                verdict.status, verdict.reason = _Status.REJECTED, "too_large"
                return verdict
            if limits.rpm is not None and verdict.requests + 1 > limits.rpm:
                verdict.status, verdict.reason = _Status.REJECTED, "requests"
                verdict.retry_ms = int(state.requests[0] + self._window_ms - now)
                return verdict
            if limits.tpm is not None and verdict.tokens + reserved > limits.tpm:
                verdict.status, verdict.reason = _Status.REJECTED, "tokens"
                excess = verdict.tokens + reserved - limits.tpm
                verdict.retry_ms = self._tokens_retry_ms(state, excess, now)
                return verdict
            if limits.max_parallel is not None and len(state.inflight) >= limits.max_parallel:
                verdict.status, verdict.reason = _Status.REJECTED, "parallel"
                return verdict
            if limits.rpm is not None:
                state.requests.append(now)
                verdict.requests += 1
                verdict.requests_reset_ms = int(self._window_ms)
            if limits.tpm is not None:
                state.tokens[admission_id] = [now, reserved]
                verdict.tokens += reserved
                verdict.tokens_reset_ms = int(self._window_ms)
            if limits.tracks_inflight:
                state.inflight[admission_id] = (now + self._lease_ms, reserved)
            return verdict

    async def _peek(self, limits) -> _Verdict:
        with self._lock:
            now = time.monotonic() * 1000
            state = self._keys.setdefault(limits.ident, _KeyState())
            self._purge(state, now)
            return self._counts(state, now)

    async def _release(self, limits, admission_id, used, month) -> None:
        with self._lock:
            state = self._keys.get(limits.ident)
            if state is not None:
                if admission_id in state.tokens:
                    state.tokens[admission_id][1] = used
                state.inflight.pop(admission_id, None)
            used_key = (limits.ident, month)
            if limits.budget is not None and used_key in self._used:
                self._used[used_key] += used


# KEYS: 1 rpm log (zset id->time), 2 tpm log (zset id->time), 3 tpm tokens (hash id->tokens),
#       4 in-flight leases (zset id->lease end), 5 in-flight reservations (hash id->tokens),
#       6 the month's finished tokens (string)
# ARGV: 1 id, 2 reserved, 3 rpm, 4 tpm, 5 max parallel, 6 budget (-1: no limit), 7 seed (-1: none),
#       8 window ms, 9 lease ms, 10 budget idle s, 11 mode ("admit" | "peek")
# Returns {status, reason, requests, tokens, requests reset ms, tokens reset ms, retry ms, budget}.
_ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, reserved = ARGV[1], tonumber(ARGV[2])
local rpm, tpm, par = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local budget, seed = tonumber(ARGV[6]), tonumber(ARGV[7])
local window, lease, idle = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10])

local function purge(zkey, hkey, upto)
  local old = redis.call('ZRANGEBYSCORE', zkey, '-inf', upto)
  for _, member in ipairs(old) do
    if hkey then redis.call('HDEL', hkey, member) end
  end
  if #old > 0 then redis.call('ZREMRANGEBYSCORE', zkey, '-inf', upto) end
end
local function hsum(hkey)
  local total = 0
  for _, v in ipairs(redis.call('HVALS', hkey)) do total = total + tonumber(v) end
  return total
end
local function reset_ms(zkey)
  local newest = redis.call('ZRANGE', zkey, -1, -1, 'WITHSCORES')
  if #newest == 0 then return 0 end
  return tonumber(newest[2]) + window - now
end

purge(KEYS[1], nil, now - window)
purge(KEYS[2], KEYS[3], now - window)
purge(KEYS[4], KEYS[5], now)
local requests = redis.call('ZCARD', KEYS[1])
local tokens = hsum(KEYS[3])
local rreset, treset = reset_ms(KEYS[1]), reset_ms(KEYS[2])
if ARGV[11] == 'peek' then return {0, '', requests, tokens, rreset, treset, -1, 0} end

local used = 0
if budget >= 0 then
  local finished = redis.call('GET', KEYS[6])
  if not finished then
    if seed < 0 then return {2, '', 0, 0, 0, 0, -1, 0} end
    redis.call('SET', KEYS[6], seed, 'EX', idle)
    finished = seed
  end
  used = tonumber(finished) + hsum(KEYS[5])
  if used + reserved > budget then
    return {1, 'budget', requests, tokens, rreset, treset, -1, used}
  end
end
if tpm >= 0 and reserved > tpm then
  return {1, 'too_large', requests, tokens, rreset, treset, -1, used}
end
if rpm >= 0 and requests + 1 > rpm then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {1, 'requests', requests, tokens, rreset, treset,
          tonumber(oldest[2]) + window - now, used}
end
if tpm >= 0 and tokens + reserved > tpm then
  local excess, freed, retry = tokens + reserved - tpm, 0, -1
  local log = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  for i = 1, #log, 2 do
    freed = freed + tonumber(redis.call('HGET', KEYS[3], log[i]) or 0)
    if freed >= excess then retry = tonumber(log[i + 1]) + window - now break end
  end
  return {1, 'tokens', requests, tokens, rreset, treset, retry, used}
end
if par >= 0 and redis.call('ZCARD', KEYS[4]) >= par then
  return {1, 'parallel', requests, tokens, rreset, treset, -1, used}
end

if rpm >= 0 then
  redis.call('ZADD', KEYS[1], now, id)
  redis.call('PEXPIRE', KEYS[1], window)
  requests, rreset = requests + 1, window
end
if tpm >= 0 then
  redis.call('ZADD', KEYS[2], now, id)
  redis.call('HSET', KEYS[3], id, reserved)
  redis.call('PEXPIRE', KEYS[2], window)
  redis.call('PEXPIRE', KEYS[3], window)
  tokens, treset = tokens + reserved, window
end
if par >= 0 or budget >= 0 then
  redis.call('ZADD', KEYS[4], now + lease, id)
  redis.call('HSET', KEYS[5], id, reserved)
  redis.call('PEXPIRE', KEYS[4], lease)
  redis.call('PEXPIRE', KEYS[5], lease)
end
if budget >= 0 then redis.call('EXPIRE', KEYS[6], idle) end
return {0, '', requests, tokens, rreset, treset, -1, used}
"""

# KEYS: 3 tpm tokens, 4 in-flight leases, 5 in-flight reservations, 6 month's finished tokens
# ARGV: 1 id, 2 used tokens
_RELEASE_LUA = """
local id, used = ARGV[1], tonumber(ARGV[2])
if redis.call('HEXISTS', KEYS[1], id) == 1 then redis.call('HSET', KEYS[1], id, used) end
redis.call('ZREM', KEYS[2], id)
local held = redis.call('HDEL', KEYS[3], id)
if redis.call('EXISTS', KEYS[4]) == 1 then redis.call('INCRBY', KEYS[4], used) end
return held
"""


class RedisLimiter(Limiter):
    """Counters in Redis, shared by every process. The client is the synchronous one run on a
    small thread pool: its connection pool is thread-safe, whereas an asyncio client is bound to
    one event loop and the web process may run several."""

    def __init__(
        self,
        *,
        url: str,
        namespace: str = REDIS_NAMESPACE,
        window_seconds: float = WINDOW_SECONDS,
        lease_seconds: float = PARALLEL_LEASE_SECONDS,
    ):
        self._client = redis.Redis.from_url(url)
        self._namespace = namespace
        self._window_ms = int(window_seconds * 1000)
        self._lease_ms = int(lease_seconds * 1000)
        self._admit_script = self._client.register_script(_ADMIT_LUA)
        self._release_script = self._client.register_script(_RELEASE_LUA)
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="orchard-limits")

    def _keys(self, ident: str, month: datetime.date) -> list[str]:
        # The {hash tag} keeps one key's counters in one Redis Cluster slot (Lua needs that).
        base = f"{self._namespace}{{{ident}}}:"
        return [
            base + "rpm",
            base + "tpm",
            base + "tpm-tokens",
            base + "inflight",
            base + "inflight-tokens",
            base + f"used:{month:%Y-%m}",
        ]

    async def _run(self, fn, *args):
        # Shielded: a cancelled caller must not drop a release that is queued but not yet running.
        loop = asyncio.get_running_loop()
        return await asyncio.shield(loop.run_in_executor(self._executor, fn, *args))

    def _script(self, limits: _Limits, admission_id, reserved, month, seed, mode) -> _Verdict:
        def arg(value):
            return -1 if value is None else int(value)

        result = self._admit_script(
            keys=self._keys(limits.ident, month),
            args=[
                admission_id,
                reserved,
                arg(limits.rpm),
                arg(limits.tpm),
                arg(limits.max_parallel),
                arg(limits.budget),
                arg(seed),
                self._window_ms,
                self._lease_ms,
                BUDGET_IDLE_SECONDS,
                mode,
            ],
        )
        status, reason, requests, tokens, rreset, treset, retry, used = result
        return _Verdict(
            status=_Status(status),
            reason=reason.decode() if isinstance(reason, bytes) else reason,
            requests=requests,
            tokens=tokens,
            requests_reset_ms=rreset,
            tokens_reset_ms=treset,
            retry_ms=retry,
            budget_used=used,
        )

    async def _check(self, limits, admission_id, reserved, month, seed) -> _Verdict:
        return await self._run(self._script, limits, admission_id, reserved, month, seed, "admit")

    async def _peek(self, limits) -> _Verdict:
        month = month_start(timezone.now().date())
        return await self._run(self._script, limits, "", 0, month, None, "peek")

    async def _release(self, limits, admission_id, used, month) -> None:
        keys = self._keys(limits.ident, month)[2:]
        await self._run(lambda: self._release_script(keys=keys, args=[admission_id, used]))

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._client.close()


_limiters: dict[str | None, Limiter] = {}
_limiters_lock = threading.Lock()


def get_limiter() -> Limiter:
    """The process-wide limiter for the configured backend."""
    url = settings.REDIS_URL
    with _limiters_lock:
        if url not in _limiters:
            _limiters[url] = RedisLimiter(url=url) if url else InProcessLimiter()
        return _limiters[url]


async def admit(api_key: ApiKey, *, reserved_tokens: int) -> Admission:
    """Check and reserve, atomically: 1 request (rpm), `reserved_tokens` (tpm and budget), 1
    parallel slot. Raises RateLimitExceeded (with headers) and reserves nothing when a limit
    refuses. `reserved_tokens` should be prompt tokens + max_tokens; release with what was used
    (prompt + completion tokens, as recorded in the usage row), after finishing that row."""
    return await get_limiter().admit(api_key, reserved_tokens=reserved_tokens)


async def current_headers(api_key: ApiKey) -> dict[str, str]:
    """x-ratelimit-* headers for a response that reserves nothing (e.g. GET /v1/models)."""
    return await get_limiter().current_headers(api_key)
