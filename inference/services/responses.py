"""/v1/responses responses: started (continuing a stored one, truncated to fit), kept per team,
read back, deleted and purged.

`response_start` reads the conversation a response answers (the stored one it continues, then
its own input items) and starts its generation through the generation service, dropping the
oldest turns while it does not fit when the caller asked for truncation "auto". The endpoint
formats the generation's output; `ResponseRun.finished` keeps the finished response for the
key's team (with `store`) before the endpoint sends its final event, so that a client that
continues as soon as it has the response always finds it.

Every lookup is scoped to the team of the key asking: another team's response id is as unknown
as one that never existed."""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib.auth.base_user import AbstractBaseUser
from django.db import transaction
from django.db.models import QuerySet
from django.utils import timezone

from accounts.models import ApiKey
from accounts.selectors import teams_owned_by
from inference.errors import APIError
from inference.models import StoredResponse
from inference.services.generation import Generation, GenerationCall, generation_start

# With truncation "auto", how many times the oldest turn may be dropped to fit the context.
MAX_TRUNCATIONS = 64


def response_not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        404,
        f"Response with id '{response_id}' not found.",
        param=param,
        code="previous_response_not_found" if param else None,
    )


@dataclass
class ResponseRun:
    """A started response: its generation, and the conversation it answers (what is stored as
    its input items)."""

    api_key: ApiKey
    generation: Generation
    conversation: list[dict[str, Any]]
    store: bool

    async def finished(self, body: dict[str, Any]) -> None:
        """The response ended (`body` is its final object): keep it, with `store`."""
        if self.store:
            await sync_to_async(response_store)(
                api_key=self.api_key, body=body, input_items=self.conversation
            )


async def response_start(
    *,
    api_key: ApiKey,
    request_id: str,
    input_items: list[dict[str, Any]],
    call_for: Callable[[list[dict[str, Any]]], GenerationCall],
    previous_response_id: str | None = None,
    truncate: bool = False,
    store: bool = True,
) -> ResponseRun:
    """Start the response to `input_items` (after the stored response `previous_response_id`
    and what it answered); `call_for` makes the generation call for a conversation. With
    `truncate`, the oldest turns are dropped until the conversation fits the model's context."""
    conversation: list[dict[str, Any]] = []
    if previous_response_id:
        previous = await sync_to_async(response_get)(
            api_key=api_key, response_id=previous_response_id
        )
        if previous is None:
            raise response_not_found(previous_response_id, param="previous_response_id")
        conversation = conversation_items(previous)
    conversation = conversation + input_items
    if not any(item["type"] != "reasoning" for item in conversation):
        raise APIError(400, "'input' must hold at least one message or item.", param="input")
    for _ in range(MAX_TRUNCATIONS):
        try:
            generation = await generation_start(
                api_key=api_key, request_id=request_id, call=call_for(conversation)
            )
            return ResponseRun(api_key, generation, conversation, store)
        except APIError as exc:
            shorter = None
            if exc.code == "context_length_exceeded" and truncate:
                shorter = _without_oldest_turn(conversation)
            if shorter is None:
                raise
            conversation = shorter
    raise APIError(400, "The input does not fit the model's context.", param="input")


def _without_oldest_turn(conversation: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The conversation without its oldest turn (a user message and what answered it),
    leading system and developer messages kept; None when only the last turn is left."""
    start = 0
    while start < len(conversation) and conversation[start].get("role") in ("system", "developer"):
        start += 1
    users = [
        index
        for index in range(start, len(conversation))
        if conversation[index].get("role") == "user"
    ]
    if len(users) < 2:
        return None
    return conversation[:start] + conversation[users[1] :]


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
