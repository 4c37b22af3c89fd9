"""The Redis backend (REDIS_URL set): one Lua script per admission and per release, so every
process shares the counters and no read-modify-write race is possible. Keys carry TTLs."""

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import redis

from accounts.limits.base import (
    BUDGET_IDLE_SECONDS,
    PARALLEL_LEASE_SECONDS,
    WINDOW_SECONDS,
    Limiter,
    LimiterUnavailable,
    Limits,
    Status,
    Verdict,
)
from accounts.limits.budgets import TOKENS

REDIS_NAMESPACE = "orchard:limits:"

# KEYS: 1 rpm log (zset id->time), 2 tpm log (zset id->time), 3 tpm tokens (hash id->tokens),
#       4 in-flight leases (zset id->lease end); then three per budget counter: its period's
#       finished usage (string), its reservations (hash id->amount), their leases (zset id->end)
# ARGV: 1 id, 2 reserved, 3 rpm, 4 tpm, 5 max parallel (-1: no limit), 6 window ms, 7 lease ms,
#       8 budget idle ms, 9 mode ("admit" | "enter" | "reserve" | "peek"; base.Limiter._check
#       says what each does), 10 least (the fewest tokens to reserve: `reserved` unless the
#       request is flexible), 11 the number of budget counters; then three per counter: its
#       limit, its seed (-1: none), its rate (what one token takes from it)
# Returns {status, reason, requests, tokens, requests reset ms, tokens reset ms, retry ms, budget
#          used, granted, budget index (0-based, -1: none)}; a peek the requests in flight after
#          those, a NEED_SEED the indexes of the counters to seed.
_ADMIT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local id, reserved = ARGV[1], tonumber(ARGV[2])
local rpm, tpm, par = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local window, lease, idle = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local mode, least, nb = ARGV[9], tonumber(ARGV[10]), tonumber(ARGV[11])
local enters = mode == 'admit' or mode == 'enter'
local reserves = mode == 'admit' or mode == 'reserve'
local grant = reserved

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
purge(KEYS[4], nil, now)
local requests = redis.call('ZCARD', KEYS[1])
local tokens = hsum(KEYS[3])
local rreset, treset = reset_ms(KEYS[1]), reset_ms(KEYS[2])
if mode == 'peek' then
  return {0, '', requests, tokens, rreset, treset, -1, 0, 0, -1, redis.call('ZCARD', KEYS[4])}
end

local finished, missing = {}, {}
for i = 1, nb do
  local k, a = 4 + 3 * (i - 1), 11 + 3 * (i - 1)
  purge(KEYS[k + 3], KEYS[k + 2], now)
  local done = redis.call('GET', KEYS[k + 1])
  if not done then
    local seed = tonumber(ARGV[a + 2])
    if seed < 0 then
      table.insert(missing, i - 1)
    else
      redis.call('SET', KEYS[k + 1], seed, 'PX', idle)
      done = seed
    end
  end
  finished[i] = tonumber(done or 0)
end
if #missing > 0 then return {2, '', 0, 0, 0, 0, -1, 0, 0, -1, missing} end
for i = 1, nb do
  local k, a = 4 + 3 * (i - 1), 11 + 3 * (i - 1)
  local limit, rate = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 3])
  local used = finished[i] + hsum(KEYS[k + 2])
  if used + least * rate > limit then
    return {1, 'budget', requests, tokens, rreset, treset, -1, used, 0, i - 1}
  end
  if rate > 0 then
    local room = math.floor((limit - used) / rate)
    while room * rate > limit - used do room = room - 1 end
    grant = math.min(grant, room)
  end
end
if tpm >= 0 and least > tpm then
  return {1, 'too_large', requests, tokens, rreset, treset, -1, 0, 0, -1}
end
if enters and rpm >= 0 and requests + 1 > rpm then
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  return {1, 'requests', requests, tokens, rreset, treset,
          tonumber(oldest[2]) + window - now, 0, 0, -1}
end
if tpm >= 0 and tokens + least > tpm then
  local excess, freed, retry = tokens + least - tpm, 0, -1
  local log = redis.call('ZRANGE', KEYS[2], 0, -1, 'WITHSCORES')
  for i = 1, #log, 2 do
    freed = freed + tonumber(redis.call('HGET', KEYS[3], log[i]) or 0)
    if freed >= excess then retry = tonumber(log[i + 1]) + window - now break end
  end
  return {1, 'tokens', requests, tokens, rreset, treset, retry, 0, 0, -1}
end
if tpm >= 0 then grant = math.min(grant, tpm - tokens) end
if enters and par >= 0 and redis.call('ZCARD', KEYS[4]) >= par then
  return {1, 'parallel', requests, tokens, rreset, treset, -1, 0, 0, -1}
end
if not reserves then grant = 0 end

if enters and rpm >= 0 then
  redis.call('ZADD', KEYS[1], now, id)
  redis.call('PEXPIRE', KEYS[1], window)
  requests, rreset = requests + 1, window
end
if reserves and tpm >= 0 then
  redis.call('ZADD', KEYS[2], now, id)
  redis.call('HSET', KEYS[3], id, grant)
  redis.call('PEXPIRE', KEYS[2], window)
  redis.call('PEXPIRE', KEYS[3], window)
  tokens, treset = tokens + grant, window
end
if enters and par >= 0 then
  redis.call('ZADD', KEYS[4], now + lease, id)
  redis.call('PEXPIRE', KEYS[4], lease)
end
for i = 1, nb do
  local k, a = 4 + 3 * (i - 1), 11 + 3 * (i - 1)
  local amount = grant * tonumber(ARGV[a + 3])
  if enters then
    redis.call('ZADD', KEYS[k + 3], now + lease, id)
    redis.call('PEXPIRE', KEYS[k + 3], lease)
  end
  if enters or redis.call('ZSCORE', KEYS[k + 3], id) then
    redis.call('HSET', KEYS[k + 2], id, amount)
    redis.call('PEXPIRE', KEYS[k + 2], lease)
  end
  redis.call('PEXPIRE', KEYS[k + 1], idle)
end
return {0, '', requests, tokens, rreset, treset, -1, 0, grant, -1}
"""

# KEYS: 1 tpm tokens, 2 in-flight leases; then three per budget counter, as above
# ARGV: 1 id, 2 used tokens; then what each counter counts of the request (tokens or nano-units)
_RELEASE_LUA = """
local id, used = ARGV[1], tonumber(ARGV[2])
if redis.call('HEXISTS', KEYS[1], id) == 1 then redis.call('HSET', KEYS[1], id, used) end
redis.call('ZREM', KEYS[2], id)
local held = 0
for i = 1, (#KEYS - 2) / 3 do
  local k = 2 + 3 * (i - 1)
  redis.call('ZREM', KEYS[k + 3], id)
  -- Only the release that ended the reservation counts what it used: a retried release (after
  -- a timeout that hid its success) changes nothing.
  if redis.call('HDEL', KEYS[k + 2], id) == 1 then
    held = 1
    if redis.call('EXISTS', KEYS[k + 1]) == 1 then
      redis.call('INCRBY', KEYS[k + 1], ARGV[2 + i])
    end
  end
end
return held
"""


# A Redis that does not answer within this gives the caller a 503 instead of a hung admission;
# for FAIL_FAST_S after that, calls fail at once rather than each waiting out the timeout again.
SOCKET_TIMEOUT_S = 2.0
FAIL_FAST_S = 5.0


class RedisLimiter(Limiter):
    """Counters in Redis, shared by every process. The client is the synchronous one run on a
    small thread pool: its connection pool is thread-safe, whereas an asyncio client is bound to
    one event loop and the web process may run several. Every call has a connect and a socket
    timeout; a Redis error or timeout raises LimiterUnavailable."""

    def __init__(
        self,
        *,
        url: str,
        namespace: str = REDIS_NAMESPACE,
        window_seconds: float = WINDOW_SECONDS,
        lease_seconds: float = PARALLEL_LEASE_SECONDS,
        budget_idle_seconds: float = BUDGET_IDLE_SECONDS,
        timeout_seconds: float = SOCKET_TIMEOUT_S,
        fail_fast_seconds: float = FAIL_FAST_S,
    ):
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds
        )
        self._namespace = namespace
        self._window_ms = int(window_seconds * 1000)
        self._lease_ms = int(lease_seconds * 1000)
        self._budget_idle_ms = int(budget_idle_seconds * 1000)
        self._admit_script = self._client.register_script(_ADMIT_LUA)
        self._release_script = self._client.register_script(_RELEASE_LUA)
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="orchard-limits")
        self._fail_fast_s = fail_fast_seconds
        self._down_until = 0.0

    def _keys(self, limits: Limits) -> list[str]:
        # Every counter of a team in one Redis Cluster slot (its {hash tag}): one script
        # touches the key's and its team's together.
        base = f"{self._namespace}{{t{limits.team_id}}}:"
        names = [f"{base}{limits.ident}:{name}" for name in ("rpm", "tpm", "tpm-tokens")]
        names.append(f"{base}{limits.ident}:inflight")
        for budget in limits.counters:
            names += [f"{base}b:{budget.counter}:{part}" for part in ("used", "held", "leases")]
        return names

    async def _run(self, fn, *args):
        # Shielded: a cancelled caller must not drop a release that is queued but not yet running.
        if time.monotonic() < self._down_until:
            raise LimiterUnavailable("Redis did not answer a moment ago; not asking again yet.")
        loop = asyncio.get_running_loop()
        try:
            return await asyncio.shield(loop.run_in_executor(self._executor, fn, *args))
        except redis.RedisError as exc:
            self._down_until = time.monotonic() + self._fail_fast_s
            raise LimiterUnavailable(f"Redis did not answer: {exc}") from exc

    def _script(self, limits: Limits, admission_id, reserved, least, rates, seeds, mode):
        def arg(value):
            return -1 if value is None else int(value)

        budgets = []
        for budget, seed, rate in zip(limits.counters, seeds, rates, strict=True):
            budgets += [budget.limit, arg(seed), rate]
        result = self._admit_script(
            keys=self._keys(limits),
            args=[
                admission_id,
                reserved,
                arg(limits.rpm),
                arg(limits.tpm),
                arg(limits.max_parallel),
                self._window_ms,
                self._lease_ms,
                self._budget_idle_ms,
                mode,
                least,
                len(limits.counters),
                *budgets,
            ],
        )
        status, reason, requests, tokens, rreset, treset, retry, used, granted, index, *rest = (
            result
        )
        return Verdict(
            status=Status(status),
            reason=reason.decode() if isinstance(reason, bytes) else reason,
            requests=requests,
            tokens=tokens,
            requests_reset_ms=rreset,
            tokens_reset_ms=treset,
            retry_ms=retry,
            budget_used=used,
            budget_index=index,
            need_seeds=tuple(rest[0]) if status == Status.NEED_SEED else (),
            granted=granted,
            inflight=rest[0] if rest and mode == "peek" else 0,
        )

    async def _check(self, limits, admission_id, reserved, least, rates, seeds, mode) -> Verdict:
        return await self._run(
            self._script, limits, admission_id, reserved, least, rates, seeds, mode
        )

    async def _peek(self, limits) -> Verdict:
        return await self._run(self._script, limits, "", 0, 0, (), (), "peek")

    async def _release(self, limits, admission_id, used, cost) -> None:
        keys = self._keys(limits)[2:]
        amounts = [used if budget.unit == TOKENS else cost for budget in limits.counters]
        await self._run(
            lambda: self._release_script(keys=keys, args=[admission_id, used, *amounts])
        )

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._client.close()
