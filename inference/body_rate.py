"""Whose bucket a request body's bytes are spent from while daphne reads them (common/body_rate.py,
common/daphne_requests.py): its team's, once the request's key has authenticated in this process,
else its client address's.

The key is known only from what the view saw: `authenticate` (inference/api/common.py) remembers a
key's team when it authenticates (for KNOWN_FOR_S after the last time) and forgets the key when it
does not (revoked, expired, its member gone). A key never seen, or made up, spends from its client
address's bucket (an IPv6 address's /64), so inventing keys buys no bucket of one's own; behind
the reverse proxies in ORCHARD_TRUSTED_PROXIES the address is the client's as X-Forwarded-For
gives it (accounts/signin.py's rule). Nothing here decides
access: a bucket only paces how fast bytes are read.
"""

from __future__ import annotations

import ipaddress
import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from django.conf import settings

from accounts import keys
from accounts.signin import client_address
from common.body_rate import ByteBuckets
from common.daphne_requests import BodyRate

MAX_KEYS = 10_000  # keys remembered at once (least recently seen go first)
# A key is its team's for this long after it last authenticated: a key revoked meanwhile whose
# requests never reach authentication again (413s, held 429s) goes back to its address's bucket.
KNOWN_FOR_S = 60.0


class KnownKeys:
    """The teams of keys that authenticated in this process in the last `known_for_s` seconds
    (by a digest of the key)."""

    def __init__(
        self,
        max_keys: int = MAX_KEYS,
        known_for_s: float = KNOWN_FOR_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_keys = max_keys
        self.known_for_s = known_for_s
        self.clock = clock
        self._teams: OrderedDict[str, tuple[int, float]] = OrderedDict()  # (team, until)
        self._lock = threading.Lock()

    def remember(self, raw_key: str, team_id: int) -> None:
        digest = keys.digest(raw_key)
        with self._lock:
            self._teams[digest] = (team_id, self.clock() + self.known_for_s)
            self._teams.move_to_end(digest)
            while len(self._teams) > self.max_keys:
                self._teams.popitem(last=False)

    def forget(self, raw_key: str) -> None:
        with self._lock:
            self._teams.pop(keys.digest(raw_key), None)

    def team_of(self, raw_key: str) -> int | None:
        digest = keys.digest(raw_key)
        with self._lock:
            entry = self._teams.get(digest)
            if entry is None:
                return None
            if entry[1] <= self.clock():
                del self._teams[digest]
                return None
            return entry[0]


known_keys = KnownKeys()


def bucket_for(header: Callable[[bytes], bytes | None], peer: str | None) -> str:
    """The bucket of a request with these headers from `peer` (see the module docstring)."""

    def text(name: bytes) -> str | None:
        value = header(name)
        return value.decode("latin-1") if value is not None else None

    raw_key = keys.presented_key(text(b"authorization"), text(b"x-api-key"))
    team_id = known_keys.team_of(raw_key) if raw_key else None
    if team_id is not None:
        return f"team:{team_id}"
    if peer is None:
        return "address:local"  # a Unix socket: the proxy in front, which sends no address
    address = client_address(
        remote_addr=peer,
        forwarded_for=text(b"x-forwarded-for"),
        trusted_proxies=settings.ORCHARD_TRUSTED_PROXIES,
    )
    return f"address:{_network(address)}"


def _network(address: str) -> str:
    """An IPv6 address's /64 (one host's or site's usual share: its addresses are one bucket),
    an IPv4 address itself."""
    try:
        parsed = ipaddress.ip_address(address)
    except ValueError:
        return address
    if parsed.version == 6:
        return str(ipaddress.ip_network(f"{parsed}/64", strict=False))
    return str(parsed)


def body_rate() -> BodyRate | None:
    """The buckets as the settings make them (None: no pacing, ORCHARD_BODY_RATE_BYTES = 0)."""
    if not settings.ORCHARD_BODY_RATE_BYTES:
        return None
    buckets = ByteBuckets(
        rate=settings.ORCHARD_BODY_RATE_BYTES, burst=settings.ORCHARD_BODY_BURST_BYTES
    )
    return BodyRate(buckets=buckets, bucket_for=bucket_for)
