"""Who runs a pull: a runner claims a queued row, or takes over one whose runner stopped (its
heartbeat older than the lease), with one conditional UPDATE, so two processes never run the
same pull. A pull taken over MAX_ATTEMPTS times is not tried again: a pull that kills its
process each time (out of memory while converting, say) would otherwise do so at every start."""

from __future__ import annotations

import os
import socket
import uuid
from datetime import timedelta

from django.db.models import F, Q
from django.db.models.functions import Coalesce
from django.utils import timezone

from inference.models import ModelPull

# A runner renews its pull's heartbeat every HEARTBEAT_S; a pull not heard from for LEASE_S
# is taken for one whose process stopped, and another runner may take it over.
HEARTBEAT_S = 1.0
LEASE_S = 10.0
MAX_ATTEMPTS = 3
MESSAGE_CANCELLED = "Cancelled."
ERROR_GAVE_UP = (
    "The process running this pull stopped {attempts} times before it finished; it is not "
    "resumed again. Start the pull again to retry."
)


def runner_id() -> str:
    """This process's name as a runner: host, pid and a random part (pids are reused)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def pull_claim(pull: ModelPull, *, runner: str) -> ModelPull | None:
    """Claim `pull` (as read: queued, or stale) for `runner`; None when another runner changed
    it first. A stale pull over its attempts is failed instead, a stale one whose cancel was
    asked for is cancelled (its runner is gone: nobody else will)."""
    now = timezone.now()
    same = ModelPull.objects.filter(
        pk=pull.pk, runner=pull.runner, heartbeat_at=pull.heartbeat_at, state=pull.state
    )
    if pull.cancel_requested:
        same.update(state=ModelPull.State.CANCELLED, error=MESSAGE_CANCELLED, finished_at=now)
        return None
    if pull.runner and pull.attempts >= MAX_ATTEMPTS:
        same.update(
            state=ModelPull.State.FAILED,
            error=ERROR_GAVE_UP.format(attempts=pull.attempts),
            error_code="gave_up",
            finished_at=now,
        )
        return None
    claimed = same.update(
        runner=runner,
        heartbeat_at=now,
        attempts=F("attempts") + 1,
        started_at=Coalesce("started_at", now),
        rate_bytes_per_s=None,
    )
    return ModelPull.objects.get(pk=pull.pk) if claimed else None


def pull_claim_next(*, runner: str) -> ModelPull | None:
    """The oldest pull waiting for a runner (queued, or stale), claimed for `runner`."""
    cutoff = timezone.now() - timedelta(seconds=LEASE_S)
    waiting = ModelPull.objects.filter(state__in=ModelPull.ACTIVE_STATES).filter(
        Q(runner="") | Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=cutoff)
    )
    for pull in waiting.order_by("created_at")[:20]:
        claimed = pull_claim(pull, runner=runner)
        if claimed is not None:
            return claimed
    return None


def pull_is_stale(pull: ModelPull, now=None) -> bool:
    """Whether an active pull's runner has not been heard from for LEASE_S."""
    now = now or timezone.now()
    return (
        pull.active
        and bool(pull.runner)
        and (pull.heartbeat_at is None or now - pull.heartbeat_at > timedelta(seconds=LEASE_S))
    )
