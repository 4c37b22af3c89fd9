"""GET /v1/organization/costs through a plain HTTP client against the live server: OpenAI's costs
shape (pages of daily buckets of `organization.costs.result` with `amount: {value, currency}`),
grouped by team, line item and key; the usage endpoint's readers (a `reads_usage` key sees its
own team's costs only, never another team's), and the usage API's own cost beside its tokens."""

import datetime
from decimal import Decimal

import httpx
import pytest
from django.test import Client
from django.utils import timezone

from accounts.models import Membership
from accounts.services import api_key_create, team_membership_ensure, user_get_or_create
from inference.models import ModelEntry, ModelPrice, UsageRecord
from inference.services.usage import usage_finish, usage_open

URL = "/v1/organization/costs"
NOW = timezone.now()


@pytest.fixture
def cost_world(transactional_db):
    alice, bob = user_get_or_create(username="alice"), user_get_or_create(username="bob")
    team, _ = team_membership_ensure(user=alice, team_name="alpha")
    other, _ = team_membership_ensure(user=bob, team_name="beta")
    key, reader = api_key_create(user=alice, team=team, reads_usage=True)
    second, _ = api_key_create(user=alice, team=team)
    stranger_key, stranger_reader = api_key_create(user=bob, team=other, reads_usage=True)
    _, plain = api_key_create(user=alice, team=team)
    for name, (cin, cached, cout) in {"m1": ("1", "0.5", "2"), "m2": ("10", None, "20")}.items():
        ModelPrice.objects.create(
            model=ModelEntry.objects.create(name=name, path=f"/models/{name}"),
            effective_from=NOW - datetime.timedelta(days=30),
            input_per_million=Decimal(cin),
            cached_input_per_million=None if cached is None else Decimal(cached),
            output_per_million=Decimal(cout),
        )
    for index, (api_key, model, prompt, cached, completion, days_ago) in enumerate(
        [
            (key, "m1", 1000, 400, 100, 0),  # 0.0006 + 0.0002 + 0.0002
            (second, "m2", 100, 0, 10, 0),
            (key, "m1", 10, 0, 5, 2),
            (stranger_key, "m1", 10**6, 0, 10**6, 0),  # team beta's: 3.0 USD
        ]
    ):
        record = usage_open(
            request_id=f"r{index}", api_key=api_key, model=model, endpoint="chat.completions"
        )
        UsageRecord.objects.filter(pk=record.pk).update(
            started_at=NOW - datetime.timedelta(days=days_ago)
        )
        usage_finish(
            record_id=record.pk,
            status="completed",
            prompt_tokens=prompt,
            cached_tokens=cached,
            completion_tokens=completion,
        )
    start = int((NOW - datetime.timedelta(days=6)).replace(hour=0, minute=0, second=0).timestamp())
    return {
        "team": team,
        "other": other,
        "key": key,
        "second": second,
        "reader": reader,
        "plain": plain,
        "stranger_reader": stranger_reader,
        "start": start,
    }


def get(url, key, **params):
    return httpx.get(
        f"{url}{URL}", params=params, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def amounts(body):
    return [r["amount"]["value"] for b in body["data"] for r in b["results"]]


def test_daily_cost_buckets_of_the_keys_own_team(live_server_url, cost_world):
    body = get(live_server_url, cost_world["reader"], start_time=cost_world["start"]).json()
    assert body["object"] == "page" and len(body["data"]) == 7 and body["has_more"] is False
    today = body["data"][-1]
    assert today["object"] == "bucket" and today["end_time"] - today["start_time"] == 86400
    [result] = today["results"]
    assert result["object"] == "organization.costs.result"
    assert result["amount"]["currency"] == "usd"
    # m1: 600 × 1 + 400 × 0.5 + 100 × 2 per million = 0.001; m2: 100 × 10 + 10 × 20 = 0.0012
    assert result["amount"]["value"] == pytest.approx(0.0022)
    assert result["line_item"] is None and result["project_id"] is None
    two_days_ago = body["data"][-3]["results"]
    assert [r["amount"]["value"] for r in two_days_ago] == [pytest.approx(0.00002)]
    assert all(not b["results"] for b in body["data"][:-3])
    # Team beta's 3.0 is nowhere, even when asked for by its id.
    asked = get(
        live_server_url,
        cost_world["reader"],
        start_time=cost_world["start"],
        project_ids=[cost_world["other"].pk],
    ).json()
    assert all(not b["results"] for b in asked["data"])
    beta = get(live_server_url, cost_world["stranger_reader"], start_time=cost_world["start"])
    assert amounts(beta.json()) == [pytest.approx(3.0)]


def test_grouped_by_line_item_team_and_key(live_server_url, cost_world):
    body = get(
        live_server_url,
        cost_world["reader"],
        start_time=cost_world["start"],
        group_by=["line_item", "project_id"],
    ).json()
    today = {r["line_item"]: r for r in body["data"][-1]["results"]}
    assert set(today) == {"m1, input", "m1, cached input", "m1, output", "m2, input", "m2, output"}
    assert today["m1, input"]["quantity"] == 600
    assert today["m1, input"]["amount"]["value"] == pytest.approx(0.0006)
    assert today["m1, cached input"]["quantity"] == 400
    assert today["m1, cached input"]["amount"]["value"] == pytest.approx(0.0002)
    assert today["m2, output"]["quantity"] == 10
    assert today["m2, output"]["amount"]["value"] == pytest.approx(0.0002)
    assert {r["project_id"] for r in today.values()} == {cost_world["team"].pk}
    by_key = get(
        live_server_url,
        cost_world["reader"],
        start_time=cost_world["start"],
        group_by="api_key_id",
        api_key_ids=[cost_world["second"].prefix],
    ).json()
    [only] = by_key["data"][-1]["results"]
    assert only["api_key_id"] == cost_world["second"].prefix
    assert only["amount"]["value"] == pytest.approx(0.0012)


def test_pages_and_refusals(live_server_url, cost_world):
    first = get(live_server_url, cost_world["reader"], start_time=cost_world["start"], limit=3)
    body = first.json()
    assert len(body["data"]) == 3 and body["has_more"] and body["next_page"]
    rest = get(
        live_server_url,
        cost_world["reader"],
        start_time=cost_world["start"],
        limit=180,
        page=body["next_page"],
    ).json()
    assert len(rest["data"]) == 4 and not rest["has_more"]
    assert get(live_server_url, cost_world["plain"], start_time=0).status_code == 403
    bad = get(live_server_url, cost_world["reader"], start_time=0, group_by="model")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "group_by"
    too_many = get(live_server_url, cost_world["reader"], start_time=0, limit=181)
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "limit"
    anonymous = httpx.get(f"{live_server_url}{URL}", params={"start_time": 0}, timeout=30)
    assert anonymous.status_code in (401, 403) and "error" in anonymous.json()


def test_an_owners_session_reads_their_teams_costs(cost_world):
    owner = user_get_or_create(username="olive")
    Membership.objects.create(team=cost_world["team"], user=owner, role=Membership.Role.OWNER)
    client = Client()
    client.force_login(owner)
    body = client.get(URL, {"start_time": cost_world["start"], "group_by": "project_id"}).json()
    assert {r["project_id"] for b in body["data"] for r in b["results"]} == {cost_world["team"].pk}
    assert sum(amounts(body)) == pytest.approx(0.0022 + 0.00002)


def test_the_usage_api_reports_cost_beside_tokens(live_server_url, cost_world):
    body = httpx.get(
        f"{live_server_url}/v1/organization/usage/completions",
        params={"start_time": cost_world["start"], "group_by": "model"},
        headers={"Authorization": f"Bearer {cost_world['reader']}"},
        timeout=30,
    ).json()
    today = {r["model"]: r for r in body["data"][-1]["results"]}
    assert today["m1"]["cost"] == {"value": pytest.approx(0.001), "currency": "usd"}
    assert today["m2"]["cost"]["value"] == pytest.approx(0.0012)
