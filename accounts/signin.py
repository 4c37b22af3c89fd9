"""The sign-in throttle, for every password form (the members' sign-in and the admin's).

Two counters per attempt, each refusing on its own:
- the account's: ACCOUNT_ATTEMPTS failures within WINDOW_SECONDS, from any address, refuse
  that account. The username is NFKC-normalized and case-folded first, so "Alice", "ALICE" and
  a fullwidth "Ａｌｉｃｅ" (which the sign-in form itself normalizes to "Alice") share one counter;
- the client address's: ADDRESS_ATTEMPTS failures within the window, across accounts, refuse
  that address (IPv6 clients are counted per /64, the block one host usually holds).

An attempt is counted before its password is checked and taken back if it succeeds (the
account's counter then starts again), so concurrent attempts cannot slip past a check that has
not seen them yet. The client address is REMOTE_ADDR, or, when that is one of
ORCHARD_TRUSTED_PROXIES, the first hop in X-Forwarded-For, read from the right, that is not one
of them: only the entries our own proxies appended are believed, never what a client wrote.

The counters are shared by every process: in Redis when REDIS_URL is set (a Lua INCR and
PEXPIRE per counter), in the database otherwise (`SigninAttempts`, accounts/services.py). A
store that does not answer raises SigninUnavailable: sign-in then fails closed.
"""

from __future__ import annotations

import functools
import hashlib
import ipaddress
import logging
import threading
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import redis
from django.conf import settings
from django.db import DatabaseError

from accounts.services import (
    signin_attempts_count,
    signin_attempts_forgive,
    signin_attempts_purge,
)

ACCOUNT_ATTEMPTS = 5  # failed sign-ins an account may have within the window
ADDRESS_ATTEMPTS = 20  # failed sign-ins one client address may have, across accounts
WINDOW_SECONDS = 15 * 60
REDIS_TIMEOUT_S = 2.0

logger = logging.getLogger(__name__)
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class SigninUnavailable(Exception):
    """The counters' store did not answer; the attempt must be refused."""


@dataclass(frozen=True)
class Attempt:
    account_key: str | None  # None for an empty username: only the address is counted
    address_key: str
    allowed: bool


def account_key(username: str) -> str | None:
    """The account's counter: the username NFKC-normalized and case-folded (twice, as Unicode
    advises for caseless matching), hashed so the store holds neither it nor its length."""
    folded = unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", username).casefold())
    folded = folded.strip()
    return "account:" + hashlib.sha256(folded.encode()).hexdigest()[:40] if folded else None


def address_key(address: str) -> str:
    parsed = _parse_address(address)
    if parsed is None:
        return "address:" + (address.strip()[:60] or "unknown")
    if parsed.version == 6:
        return "address:" + str(ipaddress.ip_network(f"{parsed}/64", strict=False))
    return f"address:{parsed}"


@functools.lru_cache(maxsize=8)
def _networks(values: tuple[str, ...]) -> tuple[Network, ...]:
    return tuple(ipaddress.ip_network(value, strict=False) for value in values)


def client_address(
    *, remote_addr: str, forwarded_for: str | None, trusted_proxies: Sequence[str]
) -> str:
    """The address the request came from. Every X-Forwarded-For entry right of the first
    untrusted hop was appended by a proxy we trust; anything left of it, the client may have
    written, so the walk stops there. An entry that is not an address ends the walk at the last
    hop that is one."""
    trusted = _networks(tuple(trusted_proxies))
    hop = _parse_address(remote_addr)
    if hop is None or not trusted:
        return remote_addr
    for entry in reversed((forwarded_for or "").split(",")):
        if not any(hop in network for network in trusted):
            break
        previous = _parse_address(entry)
        if previous is None:
            break
        hop = previous
    return str(hop)


def _parse_address(text: str) -> Address | None:
    text = text.strip()
    if text.startswith("["):  # [v6]:port
        text = text[1:].partition("]")[0]
    elif text.count(":") == 1:  # v4:port
        text = text.partition(":")[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if address.version == 6 and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


class Counters(Protocol):
    def count(self, keys: list[str]) -> dict[str, int]: ...

    def forgive(self, *, clear: list[str], discount: list[str]) -> None: ...


class DatabaseCounters:
    """Counters in the database every process shares (no REDIS_URL)."""

    def __init__(self, *, window_seconds: float = WINDOW_SECONDS):
        self._window_seconds = window_seconds

    def count(self, keys: list[str]) -> dict[str, int]:
        try:
            counts = signin_attempts_count(keys=keys, window_seconds=self._window_seconds)
        except DatabaseError as exc:
            raise SigninUnavailable(f"the database did not count the attempt: {exc}") from exc
        try:
            signin_attempts_purge()
        except DatabaseError as exc:  # the next attempt purges; this one is counted
            logger.warning("sign-in counters not purged: %s", exc)
        return counts

    def forgive(self, *, clear: list[str], discount: list[str]) -> None:
        signin_attempts_forgive(clear=clear, discount=discount)


# KEYS[1] the counter; ARGV[1] the window in ms. Returns the attempts in the window.
_COUNT_LUA = """
local n = redis.call('INCR', KEYS[1])
if redis.call('PTTL', KEYS[1]) < 0 then redis.call('PEXPIRE', KEYS[1], ARGV[1]) end
return n
"""
# KEYS[1] the counter. A counter whose window has passed is not brought back (DECR alone would
# make a key without expiry).
_DISCOUNT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 and tonumber(redis.call('GET', KEYS[1])) > 0 then
  return redis.call('DECR', KEYS[1])
end
return 0
"""


class RedisCounters:
    """Counters in Redis every process shares (REDIS_URL). One script call per counter (each
    atomic on its own, so the two counters may live in different Redis Cluster slots), both in
    one round trip."""

    def __init__(
        self,
        *,
        url: str,
        namespace: str,
        window_seconds: float = WINDOW_SECONDS,
        timeout_seconds: float = REDIS_TIMEOUT_S,
    ):
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_seconds, socket_connect_timeout=timeout_seconds
        )
        self._namespace = namespace
        self._window_ms = int(window_seconds * 1000)
        self._count_script = self._client.register_script(_COUNT_LUA)
        self._discount_script = self._client.register_script(_DISCOUNT_LUA)

    def count(self, keys: list[str]) -> dict[str, int]:
        keys = sorted(set(keys))
        try:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                name = self._namespace + key
                self._count_script(keys=[name], args=[self._window_ms], client=pipe)
            return dict(zip(keys, (int(n) for n in pipe.execute()), strict=True))
        except redis.RedisError as exc:
            raise SigninUnavailable(f"Redis did not count the attempt: {exc}") from exc

    def forgive(self, *, clear: list[str], discount: list[str]) -> None:
        pipe = self._client.pipeline(transaction=False)
        if clear:
            pipe.delete(*(self._namespace + key for key in clear))
        for key in discount:
            self._discount_script(keys=[self._namespace + key], client=pipe)
        pipe.execute()

    def close(self) -> None:
        self._client.close()


_counters: dict[str | None, Counters] = {}
_counters_lock = threading.Lock()


def get_counters() -> Counters:
    """The process-wide counters for the configured store."""
    url = settings.REDIS_URL
    with _counters_lock:
        if url not in _counters:
            namespace = f"{settings.ORCHARD_WORKER_NAMESPACE}:signin:"
            counters = RedisCounters(url=url, namespace=namespace) if url else DatabaseCounters()
            _counters[url] = counters
        return _counters[url]


def attempt_begin(
    *, username: str, remote_addr: str, forwarded_for: str | None, counters: Counters | None = None
) -> Attempt:
    """Count a sign-in attempt against its account and its client address; `allowed` says
    whether its password may be checked. Raises SigninUnavailable."""
    address = client_address(
        remote_addr=remote_addr,
        forwarded_for=forwarded_for,
        trusted_proxies=settings.ORCHARD_TRUSTED_PROXIES,
    )
    account, by_address = account_key(username), address_key(address)
    counted = [key for key in (account, by_address) if key]
    counters = counters or get_counters()
    counts = counters.count(counted)
    allowed = counts[by_address] <= ADDRESS_ATTEMPTS and (
        account is None or counts[account] <= ACCOUNT_ATTEMPTS
    )
    if not allowed:
        # Refused unheard, so not a guess: it must not push the address (or the account) further.
        _forgive(counters, clear=[], discount=counted)
    return Attempt(account_key=account, address_key=by_address, allowed=allowed)


def attempt_succeeded(attempt: Attempt, *, counters: Counters | None = None) -> None:
    """The password was right: the account's failures are forgotten and the address's counter
    takes this attempt back. A store that fails here is logged, not raised: the member is in."""
    _forgive(
        counters or get_counters(),
        clear=[attempt.account_key] if attempt.account_key else [],
        discount=[attempt.address_key],
    )


def _forgive(counters: Counters, *, clear: list[str], discount: list[str]) -> None:
    try:
        counters.forgive(clear=clear, discount=discount)
    except (redis.RedisError, DatabaseError) as exc:
        logger.warning("sign-in attempts not taken off the counters: %s", exc)
