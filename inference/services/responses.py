"""/v1/responses responses: started (continuing a stored one, truncated to fit) and their
input items listed; storing them is inference/services/stored_responses.py's.

`response_start` reads the conversation a response answers (the stored one it continues, then
its own input items) and starts its generation through the generation service, dropping the
oldest turns while it does not fit when the caller asked for truncation "auto". A response to
be stored is first checked against its team's storage quota, so a refused one costs no tokens.
The endpoint formats the generation's output; `ResponseRun.finished` keeps the finished
response for the key's team (with `store`) before the endpoint sends its final event, so that a
client that continues as soon as it has the response always finds it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async

from accounts.models import ApiKey
from inference.errors import APIError
from inference.services.admission import Intake
from inference.services.generation import Generation, GenerationCall, generation_start
from inference.services.stored_responses import (
    Conversation,
    response_continued,
    response_storage_check,
    response_store,
)

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
    conversation: Conversation
    store: bool

    async def finished(self, body: dict[str, Any]) -> None:
        """The response ended (`body` is its final object): keep it, with `store`."""
        if self.store:
            await sync_to_async(response_store)(
                api_key=self.api_key, body=body, conversation=self.conversation
            )


def _conversation(
    *,
    api_key: ApiKey,
    input_items: list[dict[str, Any]],
    previous_response_id: str | None,
    store: bool,
) -> Conversation:
    previous: list[dict[str, Any]] = []
    if previous_response_id:
        continued = response_continued(api_key=api_key, response_id=previous_response_id)
        if continued is None:
            raise response_not_found(previous_response_id, param="previous_response_id")
        previous = continued
    conversation = Conversation(
        new_items=input_items, previous_id=previous_response_id or None, previous_items=previous
    )
    if not any(item["type"] != "reasoning" for item in conversation.items):
        raise APIError(400, "'input' must hold at least one message or item.", param="input")
    if store:
        response_storage_check(api_key=api_key, new_items=input_items)
    return conversation


async def response_start(
    *,
    intake: Intake,
    input_items: list[dict[str, Any]],
    call_for: Callable[[list[dict[str, Any]]], GenerationCall],
    previous_response_id: str | None = None,
    truncate: bool = False,
    store: bool = True,
) -> ResponseRun:
    """Start the response to `input_items` (after the stored response `previous_response_id`
    and what it answered); `call_for` makes the generation call for a conversation. With
    `truncate`, the oldest turns are dropped until the conversation fits the model's context.
    With `store`, a response that would take the team past its storage quota is refused. Each
    attempt's call (its grammar) is made, and its prompt rendered, as a preparation job of the
    request (`intake`), which holds its key's parallel slot throughout."""
    api_key = intake.api_key
    conversation = await sync_to_async(_conversation)(
        api_key=api_key,
        input_items=input_items,
        previous_response_id=previous_response_id,
        store=store,
    )
    for _ in range(MAX_TRUNCATIONS):
        try:
            call = await intake.in_thread(call_for, conversation.items)
            generation = await generation_start(intake=intake, call=call)
            return ResponseRun(api_key, generation, conversation, store)
        except APIError as exc:
            oldest = None
            if exc.code == "context_length_exceeded" and truncate:
                oldest = _oldest_turn(conversation.items)
            if oldest is None:
                raise
            conversation = conversation.without(*oldest)
    raise APIError(400, "The input does not fit the model's context.", param="input")


def _oldest_turn(conversation: list[dict[str, Any]]) -> tuple[int, int] | None:
    """Where the conversation's oldest turn is (a user message and what answered it, after the
    leading system and developer messages, which stay); None when only the last turn is left."""
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
    return start, users[1]


def input_items_page(
    items: list[dict[str, Any]],
    *,
    order: str = "desc",
    after: str | None = None,
    limit: int = 20,
) -> dict[str, Any]:
    """One page of a response's input `items` as OpenAI lists them (`desc`: newest first;
    `after`: the item id the previous page ended with). An unknown `after` is an empty page."""
    items = list(items)
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
