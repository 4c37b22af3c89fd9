"""The admin's usage totals ("Totals per team and key") and the index's "Today" panel under the
lists' own permissions, for staff who are not superusers: no usage permission, no totals; the
team table only with the team list's permission and only its teams; the key table only with the
key list's permission and only its keys (a member sees their own, an owner their team's); lines
of batches apart from interactive requests in the totals and the usage lists."""

import datetime
from decimal import Decimal

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.models import Membership
from inference.models import ModelEntry, ModelPrice, UsageRecord
from inference.services.usage import usage_finish, usage_open
from tests.factories import (
    ApiKeyFactory,
    MembershipFactory,
    StaffUserFactory,
    TeamFactory,
    UsageRecordFactory,
    UserFactory,
)

pytestmark = pytest.mark.django_db
TOTALS = reverse("admin:inference_usagerecord_totals")


def staff(username: str, team, role, permissions: list[str]):
    user = UserFactory(username=username, is_staff=True)
    user.user_permissions.set(Permission.objects.filter(codename__in=permissions))
    MembershipFactory(team=team, user=user, role=role)
    return user


def used(api_key, prompt_tokens: int) -> None:
    record = UsageRecordFactory(api_key=api_key)
    usage_finish(
        record_id=record.pk, status=UsageRecord.Status.COMPLETED, prompt_tokens=prompt_tokens
    )


@pytest.fixture
def world():
    alpha, beta = TeamFactory(name="alpha-team"), TeamFactory(name="beta-team")
    owner = staff(
        "olga", alpha, Membership.Role.OWNER, ["view_usagerecord", "view_apikey", "view_team"]
    )
    member = staff("mike", alpha, Membership.Role.MEMBER, ["view_usagerecord", "view_apikey"])
    keys = {
        "owner": ApiKeyFactory(team=alpha, user=owner, name="olga-key"),
        "member": ApiKeyFactory(team=alpha, user=member, name="mike-key"),
        "stranger": ApiKeyFactory(team=beta, name="beta-key"),
    }
    for tokens, api_key in enumerate(keys.values(), start=1):
        used(api_key, tokens * 10)
    return {"owner": owner, "member": member, "keys": keys}


def totals_for(user):
    client = Client()
    client.force_login(user)
    return client.get(TOTALS)


def test_an_owner_sees_their_teams_totals_and_its_keys(world):
    page = totals_for(world["owner"])
    assert page.status_code == 200
    assert [row["team__name"] for row in page.context["teams"]] == ["alpha-team"]
    assert page.context["teams"][0]["prompt_tokens"] == 30
    shown = {row["api_key__name"] for row in page.context["keys"]}
    assert shown == {"olga-key", "mike-key"}
    assert b"beta" not in page.content


def test_a_member_sees_only_their_own_key_and_no_team_table_without_its_permission(world):
    page = totals_for(world["member"])
    assert page.status_code == 200
    assert page.context["teams"] is None and b'id="team-totals"' not in page.content
    assert [row["api_key__name"] for row in page.context["keys"]] == ["mike-key"]
    content = page.content.decode()
    assert world["keys"]["owner"].prefix not in content and "olga-key" not in content


def test_without_the_key_lists_permission_there_is_no_key_table(world):
    world["owner"].user_permissions.remove(Permission.objects.get(codename="view_apikey"))
    page = totals_for(world["owner"])
    assert page.context["keys"] is None and b'id="key-totals"' not in page.content
    assert page.context["teams"][0]["team__name"] == "alpha-team"


def test_staff_without_the_usage_permission_see_no_totals(world):
    outsider = staff("nora", TeamFactory(name="gamma-team"), Membership.Role.OWNER, ["view_team"])
    assert totals_for(outsider).status_code == 403
    client = Client()
    client.force_login(outsider)
    index = client.get(reverse("admin:index")).content.decode()
    assert 'id="orchard-today"' in index and "prompt tokens" not in index
    # Those with it see the day's numbers on the index.
    client.force_login(world["owner"])
    assert "prompt tokens" in client.get(reverse("admin:index")).content.decode()


def test_superusers_see_every_team_and_key(world):
    page = totals_for(StaffUserFactory())
    assert {row["team__name"] for row in page.context["teams"]} == {"alpha-team", "beta-team"}
    assert len(page.context["keys"]) == 3


def test_batch_lines_are_shown_apart_in_the_totals_and_the_lists(world):
    ModelPrice.objects.create(
        model=ModelEntry.objects.create(name="m-batch", path="/m"),
        effective_from=timezone.now() - datetime.timedelta(days=1),
        input_per_million=Decimal("1"),
        output_per_million=Decimal("1"),
    )
    record = usage_open(
        request_id="batch-line-1",
        api_key=world["keys"]["owner"],
        model="m-batch",
        endpoint="/v1/chat/completions",
        batch_id="batch_xyz",
        images=3,
    )
    usage_finish(record_id=record.pk, status="completed", prompt_tokens=10**6)
    page = totals_for(world["owner"])
    [team] = page.context["teams"]
    assert (team["num_requests"], team["batch_requests"], team["batch_cost"]) == (3, 1, 10**9)
    assert team["images"] == 3  # images have their own column
    keys = {row["api_key__name"]: row for row in page.context["keys"]}
    assert (keys["olga-key"]["num_requests"], keys["olga-key"]["batch_requests"]) == (2, 1)
    assert (keys["mike-key"]["batch_requests"], keys["mike-key"]["batch_cost"]) == (0, 0)
    team_table = page.content.decode().split('id="team-totals"')[1].split("</table>")[0]
    assert "<th>Batch requests</th><th>Batch cost</th>" in team_table
    assert "<th>Images</th><th>Cost</th>" in team_table
    assert "<td>3</td><td>1.00 USD</td><td>1</td><td>1.00 USD</td></tr>" in team_table

    admin = Client()
    admin.force_login(StaffUserFactory())
    usage_list = reverse("admin:inference_usagerecord_changelist")
    interactive = sorted(
        set(UsageRecord.objects.values_list("request_id", flat=True)) - {"batch-line-1"}
    )
    assert len(interactive) == 3  # the world's
    for query, expected in [
        ({"kind": "batch"}, ["batch-line-1"]),
        ({"q": "batch_xyz"}, ["batch-line-1"]),
        ({"kind": "interactive"}, interactive),
    ]:
        listed = admin.get(usage_list, query).context["cl"].result_list
        assert sorted(r.request_id for r in listed) == expected, query
    daily = admin.get(reverse("admin:inference_dailyusage_changelist"), {"batch__exact": "1"})
    assert [(r.model, r.batch) for r in daily.context["cl"].result_list] == [("m-batch", True)]
