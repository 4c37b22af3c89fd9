"""The members' pages through Django's test client: who sees what (members their own keys and
usage, owners their teams' reports, nobody another team's), key creation shown once and
revocation where the team allows it, reports and CSV equal to the roll-ups, sign-in rate
limiting, a CSP without inline scripts."""

import csv
import datetime
import io
import re

import pytest
from django.core.cache import cache
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.models import ApiKey, Membership
from inference.models import ModelEntry
from inference.services.usage import usage_finish, usage_open, usage_record_finished
from tests.factories import ApiKeyFactory, MembershipFactory, TeamFactory, UserFactory

pytestmark = pytest.mark.django_db
PASSWORD = "a-long-password-123"
TOKEN = "0123456789abcdef0123456789abcdef"  # a form's creation token


def user_in(team, username, role=Membership.Role.MEMBER):
    user = UserFactory(username=username)
    user.set_password(PASSWORD)
    user.save()
    MembershipFactory(team=team, user=user, role=role)
    return user


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def used(api_key, model="m1", prompt=10, days_ago=0, tier="default"):
    record = usage_record_finished(
        request_id=f"req-{api_key.pk}-{model}-{prompt}-{days_ago}",
        api_key=api_key,
        model=model,
        endpoint="chat.completions",
        status="completed",
        started_at=timezone.now() - datetime.timedelta(days=days_ago),
        prompt_tokens=prompt,
        service_tier=tier,
    )
    return record


def batch_used(api_key, model="m1", prompt=10, batch_id="batch_1"):
    """A line of a batch, opened and finished as the batch runner does (rolled up as batch)."""
    record = usage_open(
        request_id=f"{batch_id}-{api_key.pk}-{model}-{prompt}",
        api_key=api_key,
        model=model,
        endpoint="chat.completions",
        batch_id=batch_id,
    )
    usage_finish(record_id=record.pk, status="completed", prompt_tokens=prompt)
    return record


@pytest.fixture(autouse=True)
def clear_cache():
    cache.clear()


@pytest.fixture
def world():
    team, other = TeamFactory(name="alpha"), TeamFactory(name="beta")
    team.members_manage_keys = True
    team.save()
    owner = user_in(team, "olive", Membership.Role.OWNER)
    member = user_in(team, "mia")
    colleague = user_in(team, "carl")
    stranger = user_in(other, "sam", Membership.Role.OWNER)
    keys = {
        "member": ApiKeyFactory(team=team, user=member, name="mia's"),
        "colleague": ApiKeyFactory(team=team, user=colleague, name="carl's"),
        "stranger": ApiKeyFactory(team=other, user=stranger, name="sam's"),
    }
    return {
        "team": team,
        "other": other,
        "owner": owner,
        "member": member,
        "colleague": colleague,
        "stranger": stranger,
        "keys": keys,
    }


def test_the_landing_page_and_sign_in(world):
    anonymous = Client()
    page = anonymous.get("/")
    assert page.status_code == 200 and b"Sign in" in page.content
    assert anonymous.get(reverse("web-keys")).status_code == 302
    signed = anonymous.post(reverse("web-login"), {"username": "mia", "password": PASSWORD})
    assert signed.status_code == 302 and signed["Location"] == reverse("web-keys")
    assert b"Your API keys" in anonymous.get("/").content


def test_sign_in_attempts_are_rate_limited(world):
    client = Client()
    for _ in range(5):
        assert (
            client.post(reverse("web-login"), {"username": "mia", "password": "x"}).status_code
            == 200
        )
    locked = client.post(reverse("web-login"), {"username": "mia", "password": PASSWORD})
    assert locked.status_code == 429  # even the right password, until the window passes
    assert (
        Client().post(reverse("web-login"), {"username": "carl", "password": PASSWORD}).status_code
        == 302
    )


def test_members_see_their_own_keys_and_create_one_shown_once(world):
    client = signed_in(world["member"])
    page = client.get(reverse("web-keys")).content.decode()
    assert "mia&#x27;s" in page and "carl&#x27;s" not in page and "sam&#x27;s" not in page
    world["team"].member_key_rpm = 7
    world["team"].member_key_models = ["m1"]
    world["team"].save()
    created = client.post(
        reverse("web-keys"),
        {"action": "create", "name": "laptop", "team": world["team"].pk, "creation_token": TOKEN},
    ).content.decode()
    raw = re.search(r'id="raw-key">(sk-orch-[^<]+)<', created).group(1)
    key = ApiKey.objects.get(name="laptop")
    assert key.user == world["member"] and key.rpm == 7  # the team's limits for member keys
    assert not key.all_models and key.allowed_models == ["m1"]
    assert key.service_tiers == ["default", "flex"]  # never priority: an admin grants that
    listed = client.get(reverse("web-keys")).content.decode()
    assert raw not in listed  # shown once
    assert "<td>default, flex</td>" in listed
    # A resubmitted form creates no second key.
    client.post(
        reverse("web-keys"),
        {"action": "create", "name": "laptop", "team": world["team"].pk, "creation_token": TOKEN},
    )
    assert ApiKey.objects.filter(name="laptop").count() == 1
    assert "/v1" in created and "curl" in created


def test_revoking_own_keys_only_and_where_the_team_allows(world):
    client = signed_in(world["member"])
    theirs = world["keys"]["colleague"]
    assert (
        client.post(reverse("web-keys"), {"action": "revoke", "key": theirs.pk}).status_code == 404
    )
    theirs.refresh_from_db()
    assert not theirs.is_revoked
    mine = world["keys"]["member"]
    assert client.post(reverse("web-keys"), {"action": "revoke", "key": mine.pk}).status_code == 302
    mine.refresh_from_db()
    assert mine.is_revoked
    world["team"].members_manage_keys = False
    world["team"].save()
    fresh = ApiKeyFactory(team=world["team"], user=world["member"])
    assert (
        client.post(reverse("web-keys"), {"action": "revoke", "key": fresh.pk}).status_code == 404
    )
    page = client.get(reverse("web-keys")).content
    assert b'id="create-key"' not in page
    assert (
        client.post(reverse("web-keys"), {"action": "create", "team": world["team"].pk}).status_code
        == 200
    )
    assert not ApiKey.objects.filter(user=world["member"], created_by=world["member"]).exists()


def test_my_usage_shows_my_requests_in_the_range(world):
    used(world["keys"]["member"], "m1", 10)
    used(world["keys"]["member"], "m2", 5, days_ago=3, tier="flex")
    used(world["keys"]["colleague"], "m1", 1000)
    batch_used(world["keys"]["member"], "m1", 7)
    client = signed_in(world["member"])
    page = client.get(reverse("web-usage")).content.decode()
    assert "3 requests · 22 prompt tokens" in page
    assert "m2" in page and "1000" not in page
    by_tier = page.split('id="usage-by-tier"')[1].split("</table>")[0]
    assert "<td>default</td><td>2</td><td>17</td>" in by_tier
    assert "<td>flex</td><td>1</td><td>5</td>" in by_tier
    by_batch = page.split('id="usage-by-batch"')[1].split("</table>")[0]
    assert "<td>interactive</td><td>2</td><td>15</td>" in by_batch
    assert "<td>batch</td><td>1</td><td>7</td>" in by_batch
    today = timezone.now().date().isoformat()
    narrowed = client.get(reverse("web-usage"), {"since": today, "until": today}).content.decode()
    assert "2 requests · 17 prompt tokens" in narrowed


def test_team_reports_for_owners_only_and_csv_equals_the_page(world):
    used(world["keys"]["member"], "m1", 10)
    used(world["keys"]["colleague"], "m2", 30, tier="priority")
    used(world["keys"]["stranger"], "m1", 999)
    batch_used(world["keys"]["colleague"], "m2", 4)
    url = reverse("web-team-report", args=[world["team"].pk])
    assert signed_in(world["member"]).get(url).status_code == 404
    assert signed_in(world["stranger"]).get(url).status_code == 404
    owner = signed_in(world["owner"])
    page = owner.get(url).content.decode()
    assert "3 requests · 44 prompt tokens" in page and "999" not in page
    tiers = page.split('id="report-tiers"')[1].split("</ul>")[0]
    assert "<li>priority: 30 tokens, 0.00 USD</li>" in tiers  # no price: no cost
    assert "<li>default: 14 tokens, 0.00 USD</li>" in tiers
    kinds = page.split('id="report-batch"')[1].split("</ul>")[0]
    assert "<li>interactive: 40 tokens, 0.00 USD</li><li>batch: 4 tokens, 0.00 USD</li>" in kinds
    table = page.split('id="report-rows"')[1].split("</table>")[0]
    assert "<td>default</td><td>yes</td><td>1</td><td>4</td>" in table  # the batch line's row
    assert "<td>priority</td><td>no</td><td>1</td><td>30</td>" in table
    assert "<svg" in page and "<rect" in page
    filtered = owner.get(url, {"member": "carl"}).content.decode()
    assert "2 requests · 34 prompt tokens" in filtered
    rows = list(
        csv.reader(
            io.StringIO(owner.get(url, {"member": "carl", "format": "csv"}).content.decode())
        )
    )
    header = ["day", "model", "key", "member", "tier", "batch", "requests", "prompt_tokens"]
    assert rows[0][:8] == header
    assert [r[1] for r in rows[1:-1]] == ["m2", "m2"] and {r[3] for r in rows[1:-1]} == {"carl"}
    assert sorted((r[4], r[5], r[7]) for r in rows[1:-1]) == [
        ("default", "true", "4"),
        ("priority", "false", "30"),
    ]
    assert rows[-1][0] == "total" and rows[-1][7] == "34"
    assert b"alpha" in owner.get(reverse("web-teams")).content


def test_models_page_lists_the_models_a_member_may_use(world, tiny_model_path):
    ModelEntry.objects.create(name="open", path=str(tiny_model_path))
    ModelEntry.objects.create(name="closed", path=str(tiny_model_path))
    key = world["keys"]["member"]
    key.all_models, key.allowed_models = False, ["open"]
    key.save()
    page = signed_in(world["member"]).get(reverse("web-models")).content.decode()
    assert "open" in page and "closed" not in page and "engine-status" in page


@pytest.mark.parametrize("name", ["web-home", "web-keys", "web-usage", "web-models", "web-teams"])
def test_pages_have_a_csp_and_no_inline_scripts(world, name):
    response = signed_in(world["owner"]).get(reverse(name))
    assert response.status_code == 200
    policy = response["Content-Security-Policy"]
    assert "script-src 'self'" in policy and "unsafe-inline" not in policy.split("style-src")[0]
    assert not re.search(rb"<script(?![^>]*\bsrc=)[^>]*>", response.content)
    assert b"csrfmiddlewaretoken" in response.content or name in ("web-teams",)


def test_the_admin_index_shows_today_and_the_status_panel(world):
    from tests.factories import StaffUserFactory

    used(world["keys"]["member"], "m1", 12)
    page = signed_in(StaffUserFactory()).get(reverse("admin:index")).content.decode()
    assert 'id="orchard-today"' in page and "1 requests · 12 prompt tokens" in page
    assert 'id="engine-status"' in page


def test_the_team_reports_link_is_for_owners(world):
    assert b"Team reports" not in signed_in(world["member"]).get(reverse("web-keys")).content
    assert b"Team reports" in signed_in(world["owner"]).get(reverse("web-keys")).content


def test_members_hold_at_most_ten_active_keys_and_only_where_allowed(world):
    client = signed_in(world["member"])
    for index in range(12):
        client.post(
            reverse("web-keys"), {"action": "create", "name": f"k{index}", "team": world["team"].pk}
        )
    assert ApiKey.objects.active().filter(user=world["member"], team=world["team"]).count() == 10
    # Teams do not let members make keys unless an owner says so (the default).
    stranger_team_member = user_in(world["other"], "nia")
    page = signed_in(stranger_team_member).get(reverse("web-keys")).content
    assert b'id="create-key"' not in page
    assert not world["other"].members_manage_keys


def test_odd_form_and_query_values_are_not_errors(world):
    client = signed_in(world["owner"])
    assert client.post(reverse("web-keys"), {"action": "revoke", "key": "abc"}).status_code == 404
    for query in ({"until": "0001-01-01"}, {"since": "9999-12-31"}, {"since": "x"}):
        assert client.get(reverse("web-usage"), query).status_code == 200
        assert (
            client.get(reverse("web-team-report", args=[world["team"].pk]), query).status_code
            == 200
        )
    odd = client.post(
        reverse("web-keys"),
        {"action": "create", "team": world["team"].pk, "creation_token": "x" * 500},
    )
    assert odd.status_code == 200 and ApiKey.objects.filter(user=world["owner"]).count() == 1
