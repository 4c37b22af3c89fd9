"""Cost and budgets where people look: the member's usage (cost per day, model and tier), their
keys page (used / remaining of their keys', their own and their team's budgets), the team report
and its CSV (cost exactly, with its currency), the admin index (today's cost) and totals, and the
admin's budget, price and webhook pages with who may change what."""

import csv
import datetime
import io
from decimal import Decimal

import pytest
from django.contrib.auth.models import Permission
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.models import AlertWebhook, Budget, Membership
from inference.models import ModelEntry, ModelPrice, UsageRecord
from inference.services.usage import usage_finish, usage_open
from tests.factories import ApiKeyFactory, MembershipFactory, TeamFactory, UserFactory

pytestmark = pytest.mark.django_db
NOW = timezone.now()


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def world():
    team, other = TeamFactory(name="alpha"), TeamFactory(name="beta")
    owner = UserFactory(username="olive", is_staff=True)
    MembershipFactory(team=team, user=owner, role=Membership.Role.OWNER)
    mia = UserFactory(username="mia")
    key = ApiKeyFactory(team=team, user=mia, name="mia's")
    stranger_key = ApiKeyFactory(team=other, user=UserFactory(username="sam"))
    entry = ModelEntry.objects.create(name="m1", path="/models/m1")
    ModelPrice.objects.create(
        model=entry,
        effective_from=NOW - datetime.timedelta(days=1),
        input_per_million=Decimal("1000"),  # 0.001 a token: round figures below
        output_per_million=Decimal("2000"),
    )
    for index, (api_key, prompt, completion) in enumerate(
        [(key, 1000, 500), (key, 250, 0), (stranger_key, 9000, 9000)]
    ):
        record = usage_open(request_id=f"r{index}", api_key=api_key, model="m1", endpoint="chat")
        usage_finish(
            record_id=record.pk,
            status="completed",
            prompt_tokens=prompt,
            completion_tokens=completion,
        )
    return {"team": team, "owner": owner, "mia": mia, "key": key, "entry": entry}


def test_the_members_usage_page_shows_cost(world):
    page = signed_in(world["mia"]).get(reverse("web-usage")).content.decode()
    # 1,250 prompt tokens at 0.001, 500 completion tokens at 0.002
    assert "2 requests · 1250 prompt tokens (0 cached) · 500 completion tokens · 2.25 USD" in page
    by_model = page.split('id="usage-by-model"')[1].split("</table>")[0]
    assert "<th>Cost</th>" in by_model and "<td>2.25 USD</td>" in by_model
    assert "27.00" not in page  # team beta's


def test_the_keys_page_shows_used_and_remaining_of_every_budget(world):
    team, mia, key = world["team"], world["mia"], world["key"]
    Budget.objects.create(team=team, scope="team", unit="money", amount=Decimal("10"))
    Budget.objects.create(team=team, scope="member", user=mia, unit="tokens", amount=5000)
    Budget.objects.create(team=team, scope="key", api_key=key, unit="money", amount=Decimal("3"))
    page = signed_in(mia).get(reverse("web-keys")).content.decode()
    budgets = page.split('id="budgets"')[1].split("</ul>")[0]
    assert "alpha&#x27;s budget: 2.25 of 10.00 USD this month (7.75 left)" in budgets
    assert "Your budget in alpha: 1,750 of 5,000 tokens this month (3,250 left)" in budgets
    used = page.split('class="key-used"')[1].split("</td>")[0]
    assert "2.25 of 3.00 USD this month (0.75 left)" in used


def test_the_team_report_and_its_csv_carry_cost(world):
    url = reverse("web-team-report", args=[world["team"].pk])
    owner = signed_in(world["owner"])
    page = owner.get(url).content.decode()
    assert "1750 in all · 2.25 USD" in page
    assert "<li><code>m1</code>: 1750 tokens, 2.25 USD</li>" in page
    rows = list(csv.reader(io.StringIO(owner.get(url, {"format": "csv"}).content.decode())))
    assert rows[0][-3:] == ["total_tokens", "cost", "currency"]
    assert rows[1][-2:] == ["2.25", "USD"] and rows[-1][0] == "total"
    assert rows[-1][-2:] == ["2.25", "USD"]
    teams = owner.get(reverse("web-teams")).content.decode()
    assert "<td>2.25 USD</td>" in teams


def test_the_admin_index_and_totals_show_cost():
    staff = UserFactory(username="root", is_staff=True, is_superuser=True)
    key = ApiKeyFactory()
    ModelPrice.objects.create(
        model=ModelEntry.objects.create(name="m1", path="/m"),
        effective_from=NOW - datetime.timedelta(days=1),
        input_per_million=Decimal("1"),
        output_per_million=Decimal("1"),
    )
    record = usage_open(request_id="r", api_key=key, model="m1", endpoint="chat")
    usage_finish(record_id=record.pk, status="completed", prompt_tokens=10**6)
    client = signed_in(staff)
    index = client.get(reverse("admin:index")).content.decode()
    assert '<span id="today-cost">1.00 USD</span>' in index
    totals = client.get(reverse("admin:inference_usagerecord_totals")).content.decode()
    assert "<td>1.00 USD</td>" in totals
    rows = client.get(reverse("admin:inference_usagerecord_changelist")).content.decode()
    assert "1.00" in rows and UsageRecord.objects.get().cost == 10**9


def test_prices_on_the_models_admin_page(world):
    staff = UserFactory(username="root", is_staff=True, is_superuser=True)
    page = signed_in(staff).get(
        reverse("admin:inference_modelentry_change", args=[world["entry"].pk])
    )
    assert page.status_code == 200
    text = page.content.decode()
    assert "a change is a new price from a later time" in text and "In USD." in text
    history = signed_in(staff).get(reverse("admin:inference_modelprice_changelist"))
    assert "in force" in history.content.decode()


def test_an_owner_sets_member_budgets_but_not_the_teams(world):
    owner = world["owner"]
    owner.user_permissions.add(
        *Permission.objects.filter(content_type__app_label="accounts", codename__endswith="budget")
    )
    client = signed_in(owner)
    add = reverse("admin:accounts_budget_add")
    base = {
        "team": world["team"].pk,
        "unit": "tokens",
        "amount": "1000",
        "period": "monthly",
        "alert_thresholds": "[]",
    }
    refused = client.post(add, {**base, "scope": "team"})
    assert refused.status_code == 200 and "Only a superuser sets a team" in refused.content.decode()
    made = client.post(add, {**base, "scope": "member", "user": world["mia"].pk})
    assert made.status_code == 302
    assert Budget.objects.get().scope == "member"
    other_team = TeamFactory(name="gamma")
    stranger = client.post(add, {**base, "team": other_team.pk, "scope": "member"})
    assert stranger.status_code == 200 and Budget.objects.count() == 1
    team_budget = Budget.objects.create(team=world["team"], scope="team", unit="tokens", amount=1)
    change = client.get(reverse("admin:accounts_budget_change", args=[team_budget.pk]))
    assert change.status_code == 200 and 'name="amount"' not in change.content.decode()


def test_the_delivery_log_lists_only_the_owners_teams(world):
    hook = AlertWebhook.objects.create(team=world["team"], url="http://127.0.0.1:1/x")
    AlertWebhook.objects.create(team=None, url="http://127.0.0.1:1/global")
    staff = UserFactory(username="root", is_staff=True, is_superuser=True)
    page = signed_in(staff).get(reverse("admin:accounts_alertwebhook_change", args=[hook.pk]))
    assert page.status_code == 200 and hook.secret in page.content.decode()
    assert hook.secret.startswith("whsec_")
