"""Refused requests, counted cheaply.

A request a limit refuses (429, or 503 when the limits cannot be checked) used nothing, and a
key over its limits may send thousands a second: writing a usage row and a roll-up for each
would turn a flood into database load. So a refusal costs no write of its own: it is counted in
memory per day, key and model, and the counts are added to the day's roll-ups (`DailyUsage`'s
`num_requests` and `num_rejected`, all that the reports and the usage API show of refusals) in
one transaction: at once for the first refusal after a quiet spell, then at most once per
FLUSH_SECONDS for the ones that follow. The metric counts each refusal with its reason.

A process that dies loses at most the last interval's counts (never tokens: a refusal has
none); one that stops normally writes what it holds.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter

from asgiref.sync import sync_to_async
from django.utils import timezone

from accounts.models import ApiKey
from common.request_threads import detach
from inference.services.engines import after_engines_stop
from inference.services.usage import RefusalBucket, usage_refusals_add

logger = logging.getLogger(__name__)

FLUSH_SECONDS = 1.0


class RefusalCounts:
    def __init__(self, flush_seconds: float = FLUSH_SECONDS) -> None:
        self.flush_seconds = flush_seconds
        self._pending: Counter[RefusalBucket] = Counter()
        self._lock = threading.Lock()
        self._scheduled = False
        self._quiet_at = 0.0  # no flush before this (monotonic)

    def count(self, api_key: ApiKey, model: str) -> None:
        """One refusal of `api_key` for `model` ("" when it was refused before its body was
        read); from a running event loop."""
        bucket = (timezone.now().date(), api_key.team_id, api_key.pk, model)
        with self._lock:
            self._pending[bucket] += 1
            if self._scheduled:
                return
            self._scheduled = True
            delay = max(0.0, self._quiet_at - time.monotonic())
        detach(self._flush_after(delay))

    async def _flush_after(self, delay: float) -> None:
        while True:
            await asyncio.sleep(delay)
            with self._lock:
                pending, self._pending = self._pending, Counter()
                self._scheduled = False
                self._quiet_at = time.monotonic() + self.flush_seconds
            try:
                await sync_to_async(usage_refusals_add)(counts=pending)
                return
            except Exception:
                logger.exception("refusal counts not written; retrying")
                with self._lock:
                    self._pending.update(pending)
                    if self._scheduled:
                        return  # a newer refusal's flush takes them
                    self._scheduled = True
                delay = self.flush_seconds

    def flush(self) -> None:
        """Write what is pending now, synchronously (at process exit)."""
        with self._lock:
            pending, self._pending = self._pending, Counter()
        if pending:
            usage_refusals_add(counts=pending)


refusals = RefusalCounts()


def _flush_at_exit() -> None:
    try:
        refusals.flush()
    except Exception:
        logger.exception("refusal counts lost at exit")


after_engines_stop(_flush_at_exit)
