"""Stored /v1/responses responses: kept once per item, read back down their chain, deleted
without breaking what continues them, purged, and counted against their team's quota.

A response stores only what it added: its new input items and its body (the response object,
output items included). One that continues another points to it, with the range truncation
dropped from what it continued (the `StoredResponse` docstring, inference/models.py, has the
whole design). What a response answered is read with one recursive query up its `continues`
links and rebuilt going down, in O(the chain's length).

Deleting (through the API or the purge) a response another one continues only hides it: its
items stay for the continuation, its body is trimmed to the output the continuation replays.
Once nothing continues a hidden response it goes, and so on up its chain. Each row's
`num_bytes` (its body and new items as compact JSON) is added to its team's
`TeamResponseStorage` when it is stored and taken off as it is trimmed or deleted, in the same
transaction, so the quota check (`response_storage_check`) reads one row.

Every lookup is scoped to the team of the key asking: another team's response id is as unknown
as one that never existed."""

from __future__ import annotations

import datetime
import json
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from django.conf import settings
from django.contrib.auth.base_user import AbstractBaseUser
from django.db import connection, transaction
from django.db.models import F, QuerySet
from django.db.models.expressions import RawSQL
from django.db.models.fields.json import KeyTransform
from django.utils import timezone

from accounts.models import ApiKey, Team
from accounts.selectors import teams_owned_by
from inference.errors import APIError
from inference.models import StoredResponse, TeamResponseStorage

CODE_STORAGE_QUOTA = "storage_quota_exceeded"
# The ids of a stored response's chain: it, what it continues, and so on to the first.
_CHAIN_SQL = (
    "WITH RECURSIVE chain (id, continues_id) AS ("
    " SELECT id, continues_id FROM {table} WHERE id = %s"
    " UNION ALL"
    " SELECT r.id, r.continues_id FROM {table} r JOIN chain ON r.id = chain.continues_id"
    ") SELECT id FROM chain"
)


@dataclass(frozen=True)
class Conversation:
    """What a response answers: the items of the stored response it continues (`previous_id`:
    what that one answered, then its output), then its own new input items, less the
    `num_dropped` items from `drop_start` that truncation dropped."""

    new_items: list[dict[str, Any]]
    previous_id: str | None = None
    previous_items: list[dict[str, Any]] = field(default_factory=list)
    drop_start: int = 0
    num_dropped: int = 0

    @property
    def items(self) -> list[dict[str, Any]]:
        whole = [*self.previous_items, *self.new_items]
        return whole[: self.drop_start] + whole[self.drop_start + self.num_dropped :]

    def without(self, start: int, end: int) -> Conversation:
        """This conversation less `items[start:end]`. Truncation always drops the oldest turn
        after the same leading system messages, so everything it dropped is one range."""
        assert not self.num_dropped or start == self.drop_start
        return replace(self, drop_start=start, num_dropped=self.num_dropped + end - start)

    def stored_parts(self) -> tuple[int, int, list[dict[str, Any]]]:
        """How a response answering this is stored after the one it continues: the range
        dropped from the continued items (start, length), and the new items it keeps."""
        num_previous = len(self.previous_items)
        start = min(self.drop_start, num_previous)
        end = min(self.drop_start + self.num_dropped, num_previous)
        kept = self.new_items[: max(0, self.drop_start - num_previous)]
        kept += self.new_items[max(0, self.drop_start + self.num_dropped - num_previous) :]
        return start, end - start, kept


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


def _json_num_bytes(value: Any) -> int:
    """The bytes `value` counts against a storage quota: its compact JSON in UTF-8."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def _is_response_id(response_id: str) -> bool:
    return 0 < len(response_id) <= 64 and "\x00" not in response_id


def _visible(team_id: int) -> QuerySet[StoredResponse]:
    return StoredResponse.objects.filter(team_id=team_id, deleted_at__isnull=True)


def _count(team_id: int, num_bytes: int) -> None:
    if not num_bytes:
        return
    counter = TeamResponseStorage.objects.filter(team_id=team_id)
    if not counter.update(num_bytes=F("num_bytes") + num_bytes):
        TeamResponseStorage.objects.get_or_create(team_id=team_id)
        counter.update(num_bytes=F("num_bytes") + num_bytes)


def response_storage_check(*, api_key: ApiKey, new_items: list[dict[str, Any]]) -> None:
    """Refuse, before it generates, a response to be stored that would take its team past its
    storage quota: the team's stored bytes plus its new input items must fit. (Its output is
    not known yet; the response that crosses the quota is stored, the next is refused.)"""
    team = (
        Team.objects.filter(pk=api_key.team_id)
        .values("response_storage_bytes", "response_storage__num_bytes")
        .get()
    )
    quota = team["response_storage_bytes"]
    if quota is None:
        quota = settings.ORCHARD_RESPONSE_STORAGE_BYTES_PER_TEAM
    used = team["response_storage__num_bytes"] or 0
    if used + _json_num_bytes(new_items) > quota:
        raise APIError(
            400,
            f"Your team's stored responses use {used:,} bytes of its storage quota of "
            f"{quota:,} bytes; storing this response would exceed it. Delete stored responses "
            '(DELETE /v1/responses/{id}) or send "store": false.',
            param="store",
            code=CODE_STORAGE_QUOTA,
        )


def response_store(
    *, api_key: ApiKey, body: dict[str, Any], conversation: Conversation
) -> StoredResponse:
    """Keep `body` (a finished response object) for the key's team, after the response it
    continues; if that one was deleted meanwhile, with the whole conversation it answered."""
    body = _storable(body)
    with transaction.atomic():
        continued = None
        if conversation.previous_id is not None:
            # Locked: a concurrent delete either sees this continuation or went first.
            continued = (
                StoredResponse.objects.select_for_update()
                .filter(pk=conversation.previous_id, team_id=api_key.team_id)
                .first()
            )
        if continued is None:
            conversation = Conversation(new_items=conversation.items)
        drop_start, num_dropped, new_items = conversation.stored_parts()
        new_items = _storable(new_items)
        stored = StoredResponse(
            id=body["id"],
            team_id=api_key.team_id,
            api_key=api_key,
            model=body["model"],
            status=body["status"],
            previous_response_id=body.get("previous_response_id") or "",
            continues=continued,
            drop_start=drop_start,
            num_dropped=num_dropped,
            body=body,
            new_input_items=new_items,
            num_bytes=_json_num_bytes(body) + _json_num_bytes(new_items),
            created_at=datetime.datetime.fromtimestamp(body["created_at"], tz=datetime.UTC),
        )
        stored.save(force_insert=True)
        _count(api_key.team_id, stored.num_bytes)
    return stored


def responses_visible_to(*, user: AbstractBaseUser) -> QuerySet[StoredResponse]:
    """Conversations are the team's own: staff see those of the teams they own."""
    shown = StoredResponse.objects.filter(deleted_at__isnull=True)
    if user.is_superuser:
        return shown
    return shown.filter(team__in=teams_owned_by(user=user))


def response_get(*, api_key: ApiKey, response_id: str) -> StoredResponse | None:
    if not _is_response_id(response_id):
        return None
    return _visible(api_key.team_id).filter(id=response_id).first()


def stored_input_items(stored: StoredResponse) -> list[dict[str, Any]] | None:
    """What `stored` answered, rebuilt down its chain; None if a response of the chain went
    meanwhile (`stored` itself was deleted)."""
    if stored.continues_id is None:
        return list(stored.new_input_items)
    table = connection.ops.quote_name(StoredResponse._meta.db_table)
    chain = RawSQL(_CHAIN_SQL.format(table=table), [stored.continues_id])
    rows = {
        row["id"]: row
        for row in StoredResponse.objects.filter(pk__in=chain).values(
            "id",
            "continues_id",
            "drop_start",
            "num_dropped",
            "new_input_items",
            output=KeyTransform("output", "body"),
        )
    }
    path, pk = [], stored.continues_id
    while pk is not None:
        if pk not in rows:
            return None
        path.append(rows[pk])
        pk = rows[pk]["continues_id"]
    items: list[dict[str, Any]] = []
    for row in reversed(path):
        items = _continued(items, row["drop_start"], row["num_dropped"])
        items += [*row["new_input_items"], *(row["output"] or [])]
    return _continued(items, stored.drop_start, stored.num_dropped) + stored.new_input_items


def _continued(items: list[dict[str, Any]], drop_start: int, num_dropped: int) -> list:
    if not num_dropped:
        return items
    return items[:drop_start] + items[drop_start + num_dropped :]


def response_input_items_get(*, api_key: ApiKey, response_id: str) -> list[dict[str, Any]] | None:
    """The input items the team's response `response_id` answered; None if it is unknown."""
    stored = response_get(api_key=api_key, response_id=response_id)
    return None if stored is None else stored_input_items(stored)


def response_continued(*, api_key: ApiKey, response_id: str) -> list[dict[str, Any]] | None:
    """What a response continuing the team's response `response_id` replays before its own
    input: everything that one answered, then its output. None if it is unknown."""
    stored = response_get(api_key=api_key, response_id=response_id)
    answered = None if stored is None else stored_input_items(stored)
    if answered is None:
        return None
    return [*answered, *stored.body.get("output", [])]


def _forget(stored: StoredResponse) -> int:
    """Delete `stored` (locked), or only hide it while another response continues it; then the
    hidden responses above it that nothing continues any more. Returns the bytes freed."""
    if stored.continuations.exists():
        body = {"output": stored.body.get("output", [])}
        num_bytes = _json_num_bytes(body) + _json_num_bytes(stored.new_input_items)
        StoredResponse.objects.filter(pk=stored.pk).update(
            deleted_at=timezone.now(), body=body, num_bytes=num_bytes
        )
        return stored.num_bytes - num_bytes
    freed = 0
    while True:
        StoredResponse.objects.filter(pk=stored.pk).delete()
        freed += stored.num_bytes
        if stored.continues_id is None:
            return freed
        above = (
            StoredResponse.objects.select_for_update()
            .filter(pk=stored.continues_id, deleted_at__isnull=False)
            .first()
        )
        if above is None or above.continuations.exists():
            return freed
        stored = above


def response_delete(*, api_key: ApiKey, response_id: str) -> bool:
    if not _is_response_id(response_id):
        return False
    with transaction.atomic():
        stored = _visible(api_key.team_id).select_for_update().filter(id=response_id).first()
        if stored is None:
            return False
        _count(api_key.team_id, -_forget(stored))
    return True


def responses_purge(*, older_than: datetime.timedelta, batch_size: int = 1000) -> int:
    """Delete stored responses created more than `older_than` ago, in batches (a large purge
    never holds one long transaction), newest first (a continuation before what it continues,
    which then goes at once instead of being hidden). Returns how many were deleted."""
    cutoff = timezone.now() - older_than
    deleted = 0
    while True:
        with transaction.atomic():
            batch = list(
                StoredResponse.objects.select_for_update()
                .filter(created_at__lt=cutoff, deleted_at__isnull=True)
                .order_by("-created_at")[:batch_size]
            )
            if not batch:
                return deleted
            freed: dict[int, int] = defaultdict(int)
            for stored in batch:
                freed[stored.team_id] += _forget(stored)
            for team_id, num_bytes in freed.items():
                _count(team_id, -num_bytes)
        deleted += len(batch)
