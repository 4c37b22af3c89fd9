"""The admin's usage totals ("Totals per team and key") and the index's "Today" panel under the
lists' own permissions, for staff who are not superusers: no usage permission, no totals; the
team table only with the team list's permission and only its teams; the key table only with the
key list's permission and only its keys (a member sees their own, an owner their team's)."""

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse

from accounts.models import Membership
from inference.models import UsageRecord
from inference.services.usage import usage_finish
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
