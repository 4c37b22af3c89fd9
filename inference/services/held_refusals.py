"""Keys over their requests-per-minute limit, held for a moment (inference/refused_keys.py
answers their requests in front of Django while a refusal is held).

When the limiter refuses a key for its rpm, admission (inference/services/admission.py) calls
`remember`: the refusal is held for at most HOLD_S, never past the window's own retry time, and
only on the routes where the key was refused (each with its endpoint's name, for the metric).

A hold that ends before the window's retry time lets one request through (the probe: the
database and the limiter see the key again, its revocation or a raised limit included) and goes
on answering the key's other requests until the probe's verdict, for at most PROBE_S. Without
it, every hold's end let all of a flooding key's connections through Django at once, a burst
that other teams' requests queued behind once a second. The probe refused renews the hold; the
probe admitted, or no verdict within PROBE_S, ends it.
"""

from __future__ import annotations

import dataclasses
import threading
import time

from accounts import keys
from accounts.limits import RateLimitExceeded
from accounts.models import ApiKey

HOLD_S = 1.0
PROBE_S = 1.0
MAX_KEYS = 10_000  # keys held at once (each a few hundred bytes); past it, expired ones go


@dataclasses.dataclass
class Refusal:
    api_key: ApiKey
    message: str
    code: str
    headers: dict[str, str]
    until: float  # monotonic
    retry_at: float  # monotonic: when the rpm window lets the key in again
    endpoints: dict[str, str]  # path -> the endpoint's name, where the key was refused
    probe_until: float = 0.0  # monotonic: a probe is under way until then


class RefusedKeys:
    """The held refusals of this process, by the keys' digests."""

    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self._by_digest: dict[str, Refusal] = {}
        self._lock = threading.Lock()

    def remember(self, api_key: ApiKey, exc: RateLimitExceeded, *, path: str, endpoint: str):
        if exc.limit != "requests" or "retry-after-ms" not in exc.headers:
            return  # tokens and slots come back as requests end: not held
        now = time.monotonic()
        retry_at = now + int(exc.headers["retry-after-ms"]) / 1000
        with self._lock:
            held = self._by_digest.get(api_key.digest)
            endpoints = held.endpoints if held is not None and held.until > now else {}
            endpoints[path] = endpoint
            self._by_digest[api_key.digest] = Refusal(
                api_key=api_key,
                message=exc.message,
                code=exc.code,
                headers=dict(exc.headers),
                until=min(now + self.hold_s, retry_at),
                retry_at=retry_at,
                endpoints=endpoints,
            )
            if len(self._by_digest) > MAX_KEYS:
                for digest in [d for d, r in self._by_digest.items() if r.until <= now]:
                    del self._by_digest[digest]

    def held(self, raw_key: str, path: str) -> tuple[Refusal, str] | None:
        """The refusal held for `raw_key` on `path`, with the path's endpoint name."""
        if not keys.is_well_formed(raw_key):
            return None
        digest = keys.digest(raw_key)
        with self._lock:
            refusal = self._by_digest.get(digest)
            if refusal is None:
                return None
            endpoint = refusal.endpoints.get(path)
            if endpoint is None:
                return None
            now = time.monotonic()
            if refusal.until <= now:
                if refusal.probe_until > now:
                    return refusal, endpoint  # the probe's verdict is not in yet
                if refusal.probe_until or refusal.retry_at <= now:
                    del self._by_digest[digest]  # no verdict in time, or the window has room
                    return None
                refusal.probe_until = now + PROBE_S
                return None  # this request is the probe
        return refusal, endpoint

    def admitted(self, api_key: ApiKey) -> None:
        """A request of the key was let in (a probe, say): nothing of it is held now."""
        with self._lock:
            self._by_digest.pop(api_key.digest, None)

    def forget(self) -> None:
        with self._lock:
            self._by_digest.clear()


refused_keys = RefusedKeys()
