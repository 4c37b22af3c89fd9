"""Stored /v1/responses responses: kept per team, read back, continued, deleted and purged.

Every lookup is scoped to the team of the key asking: another team's response id is as unknown
as one that never existed."""

from __future__ import annotations

import datetime
from typing import Any

from django.contrib.auth.base_user import AbstractBaseUser
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from accounts.models import ApiKey
from accounts.selectors import teams_owned_by
from inference.models import StoredResponse


def _storable(value: Any) -> Any:
    """`value` with NUL characters replaced (U+FFFD): PostgreSQL's jsonb refuses them, and a
    prompt or a reply may hold one."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, list):
        return [_storable(item) for item in value]
    if isinstance(value, dict):
        return {_storable(key): _storable(item) for key, item in value.items()}
    return value


def _is_response_id(response_id: str) -> bool:
    return 0 < len(response_id) <= 64 and "\x00" not in response_id


def response_store(
    *, api_key: ApiKey, body: dict[str, Any], input_items: list[dict[str, Any]]
) -> StoredResponse:
    """Keep `body` (a finished response object) and the input it answered for the key's team."""
    body, input_items = _storable(body), _storable(input_items)
    return StoredResponse.objects.create(
        id=body["id"],
        team_id=api_key.team_id,
        api_key=api_key,
        model=body["model"],
        status=body["status"],
        previous_response_id=body.get("previous_response_id") or "",
        body=body,
        input_items=input_items,
        created_at=datetime.datetime.fromtimestamp(body["created_at"], tz=datetime.UTC),
    )


def responses_visible_to(*, user: AbstractBaseUser) -> QuerySet[StoredResponse]:
    """Conversations are the team's own: staff see those of the teams they own."""
    if user.is_superuser:
        return StoredResponse.objects.all()
    return StoredResponse.objects.filter(team__in=teams_owned_by(user=user))


def response_get(*, api_key: ApiKey, response_id: str) -> StoredResponse | None:
    if not _is_response_id(response_id):
        return None
    return StoredResponse.objects.filter(id=response_id, team_id=api_key.team_id).first()


def response_delete(*, api_key: ApiKey, response_id: str) -> bool:
    if not _is_response_id(response_id):
        return False
    deleted, _ = StoredResponse.objects.filter(id=response_id, team_id=api_key.team_id).delete()
    return bool(deleted)


def conversation_items(stored: StoredResponse) -> list[dict[str, Any]]:
    """What a response continuing `stored` replays before its own input: everything `stored`
    answered, then what it answered with."""
    return [*stored.input_items, *stored.body.get("output", [])]


def input_items_page(
    stored: StoredResponse, *, order: str = "desc", after: str | None = None, limit: int = 20
) -> dict[str, Any]:
    """One page of `stored`'s input items as OpenAI lists them (`desc`: newest first; `after`:
    the item id the previous page ended with). An unknown `after` is an empty page."""
    items = list(stored.input_items)
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [item.get("id") for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    page = items[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(items) > limit,
    }


def responses_purge(*, older_than: datetime.timedelta, batch_size: int = 1000) -> int:
    """Delete stored responses created more than `older_than` ago, in batches (a large purge
    never holds one long transaction). Returns how many were deleted."""
    cutoff = timezone.now() - older_than
    deleted = 0
    while True:
        with transaction.atomic():
            ids = list(
                StoredResponse.objects.filter(created_at__lt=cutoff).values_list("id", flat=True)[
                    :batch_size
                ]
            )
            if not ids:
                return deleted
            count, _ = StoredResponse.objects.filter(id__in=ids).delete()
        deleted += count
