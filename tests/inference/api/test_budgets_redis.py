"""With REDIS_URL set, a team's budget is one set of counters for every web process: 32 requests
spread over two daphne processes, from two members' keys, never finish past it."""

import asyncio
import datetime
from decimal import Decimal

import httpx
import pytest
import redis
from django.utils import timezone

from accounts.models import Budget
from accounts.services import api_key_create, team_membership_ensure, user_get_or_create
from inference.models import ModelEntry, ModelPrice, UsageRecord
from inference.services.prices import Price
from tests.fixtures.daphne import daphne_servers, server_env
from tests.inference.conftest import TINY

REDIS_URL = "redis://127.0.0.1:6379/15"
BODY = {
    "model": TINY,
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.fixture(scope="module")
def two_servers(django_db_setup, tmp_path_factory):
    env = {**server_env(), "REDIS_URL": REDIS_URL}
    with daphne_servers(2, env, tmp_path_factory.mktemp("daphne-budget")) as urls:
        yield urls


@pytest.mark.redis
def test_a_team_money_budget_holds_across_two_processes(two_servers, tiny_models):
    row = ModelPrice.objects.create(
        model=ModelEntry.objects.get(name=TINY),
        effective_from=timezone.now() - datetime.timedelta(minutes=1),
        input_per_million=Decimal("2"),
        output_per_million=Decimal("4"),
    )
    keys = []
    for username in ("mia", "carl"):
        user = user_get_or_create(username=username)
        team, _ = team_membership_ensure(user=user, team_name="alpha")
        keys.append(api_key_create(user=user, team=team)[1])
    Budget.objects.create(team=team, unit="money", amount=Decimal("0.0004"))

    async def burst():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=40)) as c:
            return await asyncio.gather(
                *(
                    c.post(
                        f"{two_servers[i % 2]}/v1/chat/completions",
                        json=BODY,
                        headers={"Authorization": f"Bearer {keys[(i // 2) % 2]}"},
                    )
                    for i in range(32)
                )
            )

    try:
        replies = asyncio.run(burst())
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        for name in client.scan_iter(f"*{{t{team.pk}}}*"):
            client.delete(name)
        client.close()
    statuses = [r.status_code for r in replies]
    assert set(statuses) == {200, 429}
    refused = next(r for r in replies if r.status_code == 429).json()["error"]
    assert refused["message"].startswith("This team's monthly money budget is exhausted")
    rows = list(UsageRecord.objects.filter(team=team, status="completed"))
    assert len(rows) == statuses.count(200)
    price = Price.of(row)
    for one in rows:
        assert (
            one.cost
            == price.cost(
                prompt_tokens=one.prompt_tokens,
                cached_tokens=one.cached_tokens,
                completion_tokens=one.completion_tokens,
            ).total
        )
    assert sum(one.cost for one in rows) <= 400_000
