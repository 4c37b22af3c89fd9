"""The queries every request makes, compiled once (common/precompiled.py), give what their
querysets give: the same rows, fields, select_related objects and annotations, on SQLite and
(in make test's second pass) PostgreSQL."""

import datetime
import threading

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from accounts import keys
from accounts.authentication import _key_by_prefix, _with_membership
from accounts.limits.budgets import _budget_rows_query, budget_rows_for
from accounts.models import Budget, Membership
from accounts.services import api_key_revoke
from tests.factories import TeamFactory, UserFactory, api_key_with_raw

pytestmark = pytest.mark.django_db


def fields_of(obj) -> dict:
    return {field.attname: getattr(obj, field.attname) for field in obj._meta.concrete_fields}


def assert_same_key(found, expected) -> None:
    assert fields_of(found) == fields_of(expected)
    assert found.user_is_member == expected.user_is_member
    for relation in ("team", "user", "parent"):
        got, want = getattr(found, relation), getattr(expected, relation)
        assert (got is None) == (want is None)
        if want is not None:
            assert fields_of(got) == fields_of(want)


def test_a_key_by_its_prefix_is_what_the_queryset_gives_in_every_state():
    team = TeamFactory()
    active, _ = api_key_with_raw(team=team)
    revoked, _ = api_key_with_raw(team=team)
    api_key_revoke(api_key=revoked)
    expired, _ = api_key_with_raw(team=team, expires_at=timezone.now() - datetime.timedelta(1))
    gone = UserFactory()
    left, _ = api_key_with_raw(team=team, user=gone)
    Membership.objects.filter(team=team, user=gone).delete()
    child, _ = api_key_with_raw(team=team, user=active.user)
    child.parent = active
    child.save()
    for api_key in (active, revoked, expired, left, child):
        found = _key_by_prefix(api_key.prefix)
        expected = _with_membership().filter(prefix=api_key.prefix).first()
        assert len(found) == 1
        assert_same_key(found[0], expected)
    assert _key_by_prefix(child.prefix)[0].parent.pk == active.pk
    assert _key_by_prefix(left.prefix)[0].user_is_member is False
    assert _key_by_prefix(keys.lookup_prefix("sk-orch-" + "0" * 40)) == []


def test_the_key_is_read_in_one_query_with_its_relations_loaded():
    api_key, _ = api_key_with_raw()
    _key_by_prefix(api_key.prefix)  # compiled
    with CaptureQueriesContext(connection) as queries:
        found = _key_by_prefix(api_key.prefix)[0]
        assert (found.team.name, found.user.username) == (api_key.team.name, api_key.user.username)
    assert len(queries) == 1


def test_a_budget_row_query_gives_the_querysets_rows_for_every_scope_and_period():
    team = TeamFactory()
    api_key, _ = api_key_with_raw(team=team)
    other_key, _ = api_key_with_raw(team=team)
    day = datetime.date(2026, 12, 6)
    common = {"unit": "tokens", "amount": 1000}
    Budget.objects.create(team=team, scope="team", **common)
    Budget.objects.create(team=team, scope="member", user=api_key.user, **common)
    Budget.objects.create(team=team, scope="member", user=other_key.user, **common)
    Budget.objects.create(team=team, scope="key", api_key=api_key, **common)
    Budget.objects.create(team=team, scope="key", api_key=other_key, **common)
    for starts, ends in ((day, day), (day - datetime.timedelta(3), day - datetime.timedelta(1))):
        Budget.objects.create(
            team=team, scope="team", period="custom", starts_on=starts, ends_on=ends, **common
        )
    Budget.objects.create(team=TeamFactory(), scope="team", **common)
    for on in (day, day - datetime.timedelta(2)):
        found = budget_rows_for(api_key, on)
        expected = list(_budget_rows_query(team.pk, api_key.user_id, api_key.pk, on))
        assert [fields_of(b) for b in found] == [fields_of(b) for b in expected]
    assert len(budget_rows_for(api_key, day)) == 4  # team, member, key, the custom one on `day`
    with CaptureQueriesContext(connection) as queries:
        rows = budget_rows_for(api_key, day)
        [(row.team.name, row.user, row.api_key) for row in rows]
    assert len(queries) == 1


def test_threads_share_one_compile_and_read_on_their_own_connections(transactional_db):
    api_key, _ = api_key_with_raw()
    found = []

    def look() -> None:
        try:
            found.append(_key_by_prefix(api_key.prefix)[0].pk)
        finally:
            connection.close()

    threads = [threading.Thread(target=look) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert found == [api_key.pk] * 3


def test_a_keys_models_are_what_their_querysets_give():
    from inference.models import ModelEntry
    from inference.services.registry import model_for_key, models_for_key
    from tests.factories import ModelEntryFactory

    draft = ModelEntryFactory(name="draft")
    main = ModelEntryFactory(name="main", draft_model=draft)
    ModelEntryFactory(name="off", enabled=False)
    api_key, _ = api_key_with_raw()
    expected = list(ModelEntry.objects.filter(enabled=True).select_related("draft_model"))
    assert [fields_of(m) for m in models_for_key(api_key)] == [fields_of(m) for m in expected]
    with CaptureQueriesContext(connection) as queries:
        found = model_for_key(api_key, "main")
        assert found.draft_model.name == "draft"
    assert len(queries) == 1
    assert fields_of(found) == fields_of(main)
    assert model_for_key(api_key, "off") is None
    assert model_for_key(api_key, "nothing-called-this") is None
