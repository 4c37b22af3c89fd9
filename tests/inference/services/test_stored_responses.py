"""Stored responses keep each item once: a continuation stores what it added and points to what
it continues (truncation as a dropped range), reads back exactly what it answered, survives the
deletion and the purge of what it continues, and every byte is counted against its team's
quota. The migration converts rows stored the old way (a whole copy each) and back."""

import datetime
import importlib
import json

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor
from django.utils import timezone

from inference.errors import APIError
from inference.models import StoredResponse, TeamResponseStorage
from inference.services.stored_responses import (
    CODE_STORAGE_QUOTA,
    Conversation,
    response_continued,
    response_delete,
    response_get,
    response_storage_check,
    response_store,
    responses_purge,
    stored_input_items,
)
from tests.factories import ApiKeyFactory, TeamFactory

MIGRATION = importlib.import_module("inference.migrations.0009_stored_response_chains")
BEFORE = [("inference", "0008_prefix_cache_shared")]


def item(role: str, text: str) -> dict:
    return {"id": f"msg_{text}", "type": "message", "role": role, "content": text}


def store(key, response_id: str, conversation: Conversation, *, answer: str, days_old=0):
    created = timezone.now() - datetime.timedelta(days=days_old)
    body = {
        "id": response_id,
        "object": "response",
        "created_at": int(created.timestamp()),
        "model": "m",
        "status": "completed",
        "previous_response_id": conversation.previous_id,
        "tools": [{"type": "function", "name": "big", "description": "x" * 500}],
        "output": [item("assistant", answer)],
    }
    return response_store(api_key=key, body=body, conversation=conversation)


def then(key, previous_id: str, *new_items: dict) -> Conversation:
    return Conversation(
        new_items=list(new_items),
        previous_id=previous_id,
        previous_items=response_continued(api_key=key, response_id=previous_id),
    )


def size(value) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def assert_counted(team) -> int:
    """The team's counter equals the bytes of its rows, measured here from what they hold."""
    rows = StoredResponse.objects.filter(team=team)
    measured = sum(size(row.body) + size(row.new_input_items) for row in rows)
    assert measured == sum(row.num_bytes for row in rows)
    counter = TeamResponseStorage.objects.filter(team=team).first()
    assert (counter.num_bytes if counter else 0) == measured
    return measured


@pytest.mark.django_db
def test_a_truncated_continuation_stores_its_new_items_and_reads_back_exactly():
    key = ApiKeyFactory()
    store(key, "resp_1", Conversation([item("system", "s"), item("user", "u1")]), answer="a1")
    store(key, "resp_2", then(key, "resp_1", item("user", "u2")), answer="a2")
    # Truncation drops turns after the system message: in the continued items only, and
    # reaching into the new ones.
    new = [item("user", "u3"), item("assistant", "x3"), item("user", "u4")]
    for end in (3, 5, 6, 7):
        conversation = then(key, "resp_2", *new).without(1, end)
        stored = store(key, f"resp_cut{end}", conversation, answer="a")
        assert stored.continues_id == "resp_2"
        assert stored_input_items(stored) == conversation.items
        kept = [i for i in new if i in conversation.items]
        assert stored.new_input_items == kept  # nothing continued is copied
    twice = then(key, "resp_2", *new).without(1, 3).without(1, 3)
    assert [i["content"] for i in twice.items] == ["s", "u3", "x3", "u4"]
    stored = store(key, "resp_twice", twice, answer="a")
    assert stored_input_items(stored) == twice.items
    assert (stored.drop_start, stored.num_dropped) == (1, 4)
    assert_counted(key.team)


@pytest.mark.django_db
def test_continuing_a_response_deleted_meanwhile_stores_the_whole_conversation():
    key = ApiKeyFactory()
    store(key, "resp_1", Conversation([item("user", "u1")]), answer="a1")
    conversation = then(key, "resp_1", item("user", "u2"))
    assert response_delete(api_key=key, response_id="resp_1")  # while the next one generated
    stored = store(key, "resp_2", conversation, answer="a2")
    assert stored.continues_id is None and stored.previous_response_id == "resp_1"
    assert stored.new_input_items == conversation.items == stored_input_items(stored)
    assert_counted(key.team)


@pytest.mark.django_db
def test_deleting_hides_what_is_continued_until_its_last_continuation_goes():
    key = ApiKeyFactory()
    store(key, "resp_a", Conversation([item("user", "u1")]), answer="a1")
    store(key, "resp_b", then(key, "resp_a", item("user", "u2")), answer="a2")
    store(key, "resp_c", then(key, "resp_b", item("user", "u3")), answer="a3")
    store(key, "resp_d", then(key, "resp_a", item("user", "v2")), answer="b2")  # a branch
    whole = stored_input_items(StoredResponse.objects.get(pk="resp_c"))
    before = assert_counted(key.team)
    assert response_delete(api_key=key, response_id="resp_a")
    assert response_delete(api_key=key, response_id="resp_b")
    assert not response_delete(api_key=key, response_id="resp_b")  # already gone for the API
    assert response_get(api_key=key, response_id="resp_a") is None
    hidden = StoredResponse.objects.get(pk="resp_a")
    assert hidden.deleted_at is not None and hidden.body == {"output": [item("assistant", "a1")]}
    assert assert_counted(key.team) < before  # the hidden bodies were trimmed
    assert response_continued(api_key=key, response_id="resp_c")[:-1] == whole
    assert response_delete(api_key=key, response_id="resp_c")  # b goes with it, a stays for d
    assert set(StoredResponse.objects.values_list("id", flat=True)) == {"resp_a", "resp_d"}
    assert [i["content"] for i in response_continued(api_key=key, response_id="resp_d")] == [
        "u1",
        "a1",
        "v2",
        "b2",
    ]
    assert response_delete(api_key=key, response_id="resp_d")
    assert not StoredResponse.objects.exists()
    assert assert_counted(key.team) == 0


@pytest.mark.django_db
def test_the_purge_keeps_what_a_newer_response_continues():
    key = ApiKeyFactory()
    store(key, "resp_1", Conversation([item("user", "u1")]), answer="a1", days_old=40)
    store(key, "resp_2", then(key, "resp_1", item("user", "u2")), answer="a2", days_old=35)
    store(key, "resp_3", then(key, "resp_2", item("user", "u3")), answer="a3", days_old=1)
    assert responses_purge(older_than=datetime.timedelta(days=30), batch_size=1) == 2
    assert response_get(api_key=key, response_id="resp_2") is None
    texts = [i["content"] for i in response_continued(api_key=key, response_id="resp_3")]
    assert texts == ["u1", "a1", "u2", "a2", "u3", "a3"]
    assert responses_purge(older_than=datetime.timedelta(0)) == 1
    assert not StoredResponse.objects.exists() and assert_counted(key.team) == 0


@pytest.mark.django_db
def test_the_quota_is_the_setting_unless_the_team_has_its_own(settings):
    key, other = ApiKeyFactory(), ApiKeyFactory()
    store(key, "resp_1", Conversation([item("user", "u1")]), answer="a1")
    store(other, "resp_2", Conversation([item("user", "u1")]), answer="a1")
    used = assert_counted(key.team)
    new = [item("user", "u2")]
    settings.ORCHARD_RESPONSE_STORAGE_BYTES_PER_TEAM = used + size(new)
    response_storage_check(api_key=key, new_items=new)  # exactly fits
    settings.ORCHARD_RESPONSE_STORAGE_BYTES_PER_TEAM = used + size(new) - 1
    with pytest.raises(APIError) as caught:
        response_storage_check(api_key=key, new_items=new)
    assert (caught.value.status, caught.value.code) == (400, CODE_STORAGE_QUOTA)
    assert caught.value.param == "store"
    assert f"{used + size(new) - 1:,} bytes" in caught.value.message
    other.team.response_storage_bytes = 10**9
    other.team.save()
    response_storage_check(api_key=other, new_items=new)
    fresh = ApiKeyFactory()  # nothing stored yet: no counter row
    response_storage_check(api_key=fresh, new_items=new)


def test_split_continued_finds_what_is_shared():
    split = MIGRATION.split_continued
    assert split([1, 2], [1, 2, 3, 4]) == (0, 0, 2)
    assert split([0, 1, 2, 3, 4], [0, 3, 4, 5]) == (1, 2, 1)  # truncated after the first
    assert split([0, 1, 2], [0, 5]) == (1, 2, 1)  # everything after the first dropped
    assert split([1, 2], [3, 4]) is None
    assert split([], [3]) == (0, 0, 1)


def _old_rows(apps, team_a, team_b):
    """Rows as 0008 stored them: each with the whole conversation it answered."""
    old = apps.get_model("inference", "StoredResponse")
    now = timezone.now()
    s, u1, u2, u3 = item("system", "s"), item("user", "u1"), item("user", "u2"), item("user", "u3")
    a1, a2 = item("assistant", "a1"), item("assistant", "a2")
    rows = [
        ("resp_1", team_a, "", [s, u1], a1),
        ("resp_2", team_a, "resp_1", [s, u1, a1, u2], a2),
        ("resp_3", team_a, "resp_2", [s, u2, a2, u3], item("assistant", "a3")),  # truncated
        ("resp_4", team_a, "resp_gone", [u1, a1, u2], item("assistant", "a4")),
        ("resp_5", team_b, "resp_1", [s, u1, a1, u2], item("assistant", "a5")),  # not theirs
    ]
    for index, (pk, team, previous, items, answer) in enumerate(rows):
        old.objects.create(
            id=pk,
            team_id=team.pk,
            model="m",
            status="completed",
            previous_response_id=previous,
            body={"id": pk, "output": [answer], "tools": ["x" * 300]},
            input_items=items,
            created_at=now + datetime.timedelta(seconds=index),
        )
    return {pk: items for pk, _, _, items, _ in rows}


@pytest.mark.django_db(transaction=True)
def test_the_migration_converts_old_rows_and_back():
    team_a, team_b = TeamFactory(), TeamFactory()
    executor = MigrationExecutor(connection)
    latest = executor.loader.graph.leaf_nodes()
    try:
        executor.migrate(BEFORE)
        whole = _old_rows(executor.loader.project_state(BEFORE).apps, team_a, team_b)
        executor.loader.build_graph()
        executor.migrate(latest)
        rows = {row.pk: row for row in StoredResponse.objects.all()}
        assert {pk: stored_input_items(row) for pk, row in rows.items()} == whole
        links = {
            pk: (row.continues_id, row.drop_start, row.num_dropped) for pk, row in rows.items()
        }
        assert links == {
            "resp_1": (None, 0, 0),
            "resp_2": ("resp_1", 0, 0),
            "resp_3": ("resp_2", 1, 2),
            "resp_4": (None, 0, 0),
            "resp_5": (None, 0, 0),
        }
        assert [i["content"] for i in rows["resp_3"].new_input_items] == ["u3"]
        assert assert_counted(team_a) > 0 and assert_counted(team_b) > 0
        # Back: every response with its whole conversation again, the hidden ones gone.
        StoredResponse.objects.filter(pk="resp_1").update(deleted_at=timezone.now())
        executor.loader.build_graph()
        executor.migrate(BEFORE)
        old = executor.loader.project_state(BEFORE).apps.get_model("inference", "StoredResponse")
        restored = dict(old.objects.values_list("id", "input_items"))
        assert restored == {pk: items for pk, items in whole.items() if pk != "resp_1"}
    finally:
        executor.loader.build_graph()
        executor.migrate(latest)
