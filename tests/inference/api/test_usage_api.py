"""GET /v1/organization/usage/completions over real HTTP: daily buckets shaped like OpenAI's
organization usage API, grouping, filters (batch work apart from interactive) and cursor pages;
readable by a key marked reads_usage (its own team only) and by an owner's session, by nobody
else."""

import datetime

import httpx
import pytest
from django.test import Client
from django.utils import timezone

from accounts.models import Membership
from accounts.services import api_key_create, team_membership_ensure, user_get_or_create
from inference.services.usage import usage_finish, usage_open, usage_record_finished

URL = "/v1/organization/usage/completions"


@pytest.fixture
def usage_world(transactional_db):
    alice = user_get_or_create(username="alice")
    bob = user_get_or_create(username="bob")
    team, _ = team_membership_ensure(user=alice, team_name="alpha")
    other, _ = team_membership_ensure(user=bob, team_name="beta")
    team_membership_ensure(user=bob, team_name="alpha")
    key, reader = api_key_create(user=alice, team=team, reads_usage=True)
    _, plain = api_key_create(user=alice, team=team)
    bob_key, _ = api_key_create(user=bob, team=team)
    stranger_key, _ = api_key_create(user=bob, team=other)
    now = timezone.now()
    for api_key, model, prompt, days_ago in [
        (key, "m1", 10, 0),
        (key, "m2", 20, 0),
        (bob_key, "m1", 5, 1),
        (key, "m1", 7, 3),
        (stranger_key, "m1", 999, 0),
    ]:
        usage_record_finished(
            request_id=f"r-{api_key.pk}-{model}-{days_ago}",
            api_key=api_key,
            model=model,
            endpoint="chat.completions",
            status="completed",
            started_at=now - datetime.timedelta(days=days_ago),
            prompt_tokens=prompt,
        )
    start = int((now - datetime.timedelta(days=6)).replace(hour=0, minute=0, second=0).timestamp())
    return {"reader": reader, "plain": plain, "key": key, "start": start, "team": team}


def get(url, key, **params):
    return httpx.get(
        f"{url}{URL}", params=params, headers={"Authorization": f"Bearer {key}"}, timeout=30
    )


def test_daily_buckets_grouped_by_model(live_server_url, usage_world):
    body = get(
        live_server_url,
        usage_world["reader"],
        start_time=usage_world["start"],
        group_by="model",
        limit=7,
    ).json()
    assert body["object"] == "page" and len(body["data"]) == 7 and not body["has_more"]
    today = body["data"][-1]
    assert today["object"] == "bucket" and today["end_time"] - today["start_time"] == 86400
    by_model = {r["model"]: r for r in today["results"]}
    assert by_model["m1"]["input_tokens"] == 10 and by_model["m2"]["input_tokens"] == 20
    assert by_model["m1"]["object"] == "organization.usage.completions.result"
    assert by_model["m1"]["num_model_requests"] == 1
    total = sum(r["input_tokens"] for b in body["data"] for r in b["results"])
    assert total == 10 + 20 + 5 + 7  # the other team's 999 is not there


def test_grouping_by_member_and_key_filters_and_pages(live_server_url, usage_world):
    body = get(
        live_server_url,
        usage_world["reader"],
        start_time=usage_world["start"],
        group_by=["user_id", "api_key_id"],
        limit=2,
    ).json()
    assert len(body["data"]) == 2 and body["has_more"] and body["next_page"]
    rest = get(
        live_server_url,
        usage_world["reader"],
        start_time=usage_world["start"],
        group_by=["user_id"],
        limit=7,
        page=body["next_page"],
    ).json()
    assert len(rest["data"]) == 5 and not rest["has_more"]
    members = {r["user_id"] for b in rest["data"] for r in b["results"]}
    assert members == {"alice", "bob"}
    only_m2 = get(
        live_server_url, usage_world["reader"], start_time=usage_world["start"], models="m2"
    ).json()
    assert sum(r["input_tokens"] for b in only_m2["data"] for r in b["results"]) == 20


def test_who_may_read(live_server_url, usage_world):
    assert get(live_server_url, usage_world["plain"], start_time=0).status_code == 403
    anonymous = httpx.get(f"{live_server_url}{URL}", params={"start_time": 0}, timeout=30)
    assert anonymous.status_code in (401, 403) and "error" in anonymous.json()
    bad = get(live_server_url, usage_world["reader"], start_time="x")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "start_time"


def test_an_owners_session_reads_their_teams(usage_world):
    owner = user_get_or_create(username="olive")
    Membership.objects.create(team=usage_world["team"], user=owner, role=Membership.Role.OWNER)
    client = Client()
    client.force_login(owner)
    body = client.get(URL, {"start_time": usage_world["start"], "group_by": "project_id"}).json()
    teams = {r["project_id"] for b in body["data"] for r in b["results"]}
    assert teams == {usage_world["team"].pk}
    member = user_get_or_create(username="mia")
    Membership.objects.create(team=usage_world["team"], user=member)
    client.force_login(member)  # a member who owns no team sees nothing
    empty = client.get(URL, {"start_time": usage_world["start"]}).json()
    assert all(not b["results"] for b in empty["data"])


def test_out_of_range_times_are_a_400(live_server_url, usage_world):
    for start in (10**12, 10**20, -1):
        response = get(live_server_url, usage_world["reader"], start_time=start)
        assert response.status_code == 400 and response.json()["error"]["param"] == "start_time"


def test_grouping_by_service_tier(usage_world):
    usage_record_finished(
        request_id="r-priority",
        api_key=usage_world["key"],
        model="m1",
        endpoint="chat.completions",
        status="completed",
        started_at=timezone.now(),
        prompt_tokens=3,
        service_tier="priority",
    )
    owner = user_get_or_create(username="olive")
    Membership.objects.create(team=usage_world["team"], user=owner, role=Membership.Role.OWNER)
    client = Client()
    client.force_login(owner)
    body = client.get(URL, {"start_time": usage_world["start"], "group_by": "service_tier"}).json()
    today = {r["service_tier"]: r["input_tokens"] for r in body["data"][-1]["results"]}
    assert today == {"default": 10 + 20, "priority": 3}
    plain = client.get(URL, {"start_time": usage_world["start"]}).json()
    assert [r["service_tier"] for r in plain["data"][-1]["results"]] == [None]


def test_batch_work_is_a_filter_and_a_grouping(live_server_url, usage_world):
    for n, (model, prompt) in enumerate([("m1", 40), ("m2", 2)]):
        record = usage_open(
            request_id=f"batch_req_{n}",
            api_key=usage_world["key"],
            model=model,
            endpoint="chat.completions",
            batch_id="batch_abc",
        )
        usage_finish(record_id=record.pk, status="completed", prompt_tokens=prompt)
    start, reader = usage_world["start"], usage_world["reader"]

    def today(**params):
        response = get(live_server_url, reader, start_time=start, **params)
        assert response.status_code == 200, response.text
        return response.json()["data"][-1]["results"]

    by_batch = {
        r["batch"]: (r["input_tokens"], r["num_model_requests"]) for r in today(group_by="batch")
    }
    assert by_batch == {False: (10 + 20, 2), True: (40 + 2, 2)}
    both = today(group_by=["model", "batch"])
    assert {(r["model"], r["batch"]): r["input_tokens"] for r in both} == {
        ("m1", False): 10,
        ("m2", False): 20,
        ("m1", True): 40,
        ("m2", True): 2,
    }
    assert [(r["batch"], r["input_tokens"]) for r in today()] == [(None, 10 + 20 + 40 + 2)]
    assert [r["input_tokens"] for r in today(batch="true")] == [42]
    assert [r["input_tokens"] for r in today(batch="false", models="m1")] == [10]
    bad = get(live_server_url, reader, start_time=start, batch="sometimes")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "batch"
