"""Batches as their team's keys make, read and cancel them (the views, the pages), and as OpenAI's
API shows them.

A batch moves through OpenAI's lifecycle: `validating` (its input file is read into lines:
lines.py) → `in_progress` (its runner runs the lines) → `finalizing` (its output and error files
are written) → `completed`; or `failed` (a bad input file, or a budget that ran out part-way),
`expired` (its completion window ended first), `cancelling` → `cancelled`. What the runner
writes on the way is in lifecycle.py.
"""

from __future__ import annotations

import datetime
import re
import uuid
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from accounts.models import ApiKey
from inference.batch_models import Batch, StoredFile
from inference.batches.files import FILE_ID
from inference.batches.lines import ENDPOINTS
from inference.errors import APIError

COMPLETION_WINDOWS = {"24h": datetime.timedelta(hours=24)}
MAX_METADATA_PAIRS = 16
BATCH_ID = re.compile(r"batch_[0-9a-f]{32}")


def batch_not_found(batch_id: str) -> APIError:
    return APIError(404, f"No batch found with id '{batch_id}'.", param="batch_id")


def _timestamp(value: datetime.datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


def batch_object(batch: Batch) -> dict[str, Any]:
    """The batch as OpenAI's API shows it."""
    total_tokens = batch.input_tokens + batch.output_tokens
    return {
        "id": batch.id,
        "object": "batch",
        "endpoint": batch.endpoint,
        "model": batch.model or None,
        "errors": {"object": "list", "data": batch.errors} if batch.errors else None,
        "input_file_id": batch.input_file_name,
        "completion_window": batch.completion_window,
        "status": batch.status,
        "output_file_id": batch.output_file_id,
        "error_file_id": batch.error_file_id,
        "created_at": _timestamp(batch.created_at),
        "in_progress_at": _timestamp(batch.in_progress_at),
        "expires_at": _timestamp(batch.expires_at),
        "finalizing_at": _timestamp(batch.finalizing_at),
        "completed_at": _timestamp(batch.completed_at),
        "failed_at": _timestamp(batch.failed_at),
        "expired_at": _timestamp(batch.expired_at),
        "cancelling_at": _timestamp(batch.cancelling_at),
        "cancelled_at": _timestamp(batch.cancelled_at),
        "request_counts": {
            "total": batch.num_total,
            "completed": batch.num_completed,
            "failed": batch.num_failed,
        },
        "usage": {
            "input_tokens": batch.input_tokens,
            "input_tokens_details": {"cached_tokens": batch.cached_tokens},
            "output_tokens": batch.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": total_tokens,
        },
        "metadata": batch.metadata,
    }


def _metadata(value: Any) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict) or len(value) > MAX_METADATA_PAIRS:
        raise APIError(
            400,
            f"metadata must be an object of at most {MAX_METADATA_PAIRS} key-value pairs.",
            param="metadata",
        )
    for key, item in value.items():
        if not isinstance(item, str) or len(key) > 64 or len(item) > 512:
            raise APIError(
                400,
                "metadata keys are strings of at most 64 characters and values strings of at "
                "most 512.",
                param="metadata",
            )
    return dict(value)


def batch_create(
    *,
    api_key: ApiKey,
    input_file_id: Any,
    endpoint: Any,
    completion_window: Any,
    metadata: Any = None,
) -> Batch:
    """A batch of the key's team over one of its uploaded files, waiting for a runner."""
    if endpoint not in ENDPOINTS:
        raise APIError(
            400,
            "endpoint must be one of " + ", ".join(ENDPOINTS) + ".",
            param="endpoint",
        )
    if completion_window not in COMPLETION_WINDOWS:
        raise APIError(
            400,
            "completion_window must be " + " or ".join(f"'{w}'" for w in COMPLETION_WINDOWS) + ".",
            param="completion_window",
        )
    metadata = _metadata(metadata)
    if not isinstance(input_file_id, str) or not input_file_id:
        raise APIError(400, "input_file_id must be a file id.", param="input_file_id")
    if not FILE_ID.fullmatch(input_file_id):  # no query for what cannot be an id (a NUL byte)
        raise APIError(404, f"No such File object: {input_file_id}", param="input_file_id")
    with transaction.atomic():
        # Locked as file_delete locks it: the file is either gone here or kept for the batch.
        stored = (
            StoredFile.objects.select_for_update()
            .filter(team_id=api_key.team_id, pk=input_file_id)
            .first()
        )
        if stored is None:
            raise APIError(404, f"No such File object: {input_file_id}", param="input_file_id")
        if stored.purpose != StoredFile.Purpose.BATCH:
            raise APIError(
                400,
                f"The file '{input_file_id}' was uploaded for '{stored.purpose}'; a batch reads "
                "a file uploaded with purpose 'batch'.",
                param="input_file_id",
            )
        return _batch_new(api_key, stored, endpoint, completion_window, metadata)


def _batch_new(api_key, stored, endpoint, completion_window, metadata) -> Batch:
    now = timezone.now()
    return Batch.objects.create(
        id=f"batch_{uuid.uuid4().hex}",
        team_id=api_key.team_id,
        api_key=api_key,
        endpoint=endpoint,
        completion_window=completion_window,
        input_file=stored,
        input_file_name=stored.id,
        metadata=metadata,
        created_at=now,
        expires_at=now + COMPLETION_WINDOWS[completion_window],
    )


def batch_get(*, team_id: int, batch_id: str) -> Batch | None:
    if not BATCH_ID.fullmatch(batch_id):
        return None
    return Batch.objects.filter(team_id=team_id, id=batch_id).first()


def batch_list(*, team_id: int, after: str | None, limit: int) -> tuple[list[Batch], bool]:
    """The team's batches, newest first, after the batch `after` (a cursor)."""
    batches = Batch.objects.filter(team_id=team_id).order_by("-created_at", "-id")
    if after:
        cursor = batch_get(team_id=team_id, batch_id=after)
        if cursor is None:
            raise APIError(400, f"No batch found with id '{after}'.", param="after")
        batches = batches.filter(
            Q(created_at__lt=cursor.created_at) | Q(created_at=cursor.created_at, id__lt=cursor.id)
        )
    page = list(batches[: limit + 1])
    return page[:limit], len(page) > limit


def batch_cancel(*, team_id: int | None, batch_id: str) -> Batch | None:
    """Ask the batch to stop: `cancelling` until its runner has stopped its lines and written
    what finished, then `cancelled`. None when there is no such batch (of the team, unless
    `team_id` is None: the admin)."""
    if not BATCH_ID.fullmatch(batch_id):
        return None
    with transaction.atomic():
        batches = Batch.objects.select_for_update().filter(id=batch_id)
        if team_id is not None:
            batches = batches.filter(team_id=team_id)
        batch = batches.first()
        if batch is None:
            return None
        if batch.status in (Batch.Status.CANCELLING, Batch.Status.CANCELLED):
            return batch
        if batch.status not in (Batch.Status.VALIDATING, Batch.Status.IN_PROGRESS):
            raise APIError(
                409,
                f"Cannot cancel a batch with status '{batch.status}'.",
                param="batch_id",
                code="batch_not_cancellable",
            )
        batch.status = Batch.Status.CANCELLING
        batch.cancelling_at = timezone.now()
        batch.save(update_fields=["status", "cancelling_at"])
    return batch
