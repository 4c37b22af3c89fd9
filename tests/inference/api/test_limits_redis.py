"""With REDIS_URL set, every web process shares one set of counters: two daphne processes
serving the same key never admit more than its max_parallel between them."""

import asyncio

import httpx
import pytest
import redis
from asgiref.sync import sync_to_async

from inference.models import DailyUsage, UsageRecord
from tests.fixtures.daphne import daphne_servers, server_env
from tests.inference.conftest import TINY, refused_count

REDIS_URL = "redis://127.0.0.1:6379/15"
MESSAGES = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def two_servers(django_db_setup, tmp_path_factory):
    env = {**server_env(), "REDIS_URL": REDIS_URL}
    with daphne_servers(2, env, tmp_path_factory.mktemp("daphne-redis")) as urls:
        yield urls


def peak_overlap(rows: list[UsageRecord]) -> int:
    events = sorted([(r.started_at, 1) for r in rows] + [(r.finished_at, -1) for r in rows])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    return peak


@pytest.mark.redis
def test_max_parallel_holds_across_two_processes(two_servers, make_key, tiny_models):
    key = make_key(max_parallel=2)
    body = {
        "model": TINY,
        "messages": MESSAGES,
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def burst() -> list[int]:
        clients = [
            httpx.AsyncClient(
                base_url=url,
                headers={"Authorization": f"Bearer {key}"},
                timeout=60,
                limits=httpx.Limits(max_connections=30),
            )
            for url in two_servers
        ]
        try:
            responses = await asyncio.gather(
                *(clients[i % 2].post("/v1/chat/completions", json=body) for i in range(20))
            )
        finally:
            for client in clients:
                await client.aclose()
        return [r.status_code for r in responses]

    try:
        statuses = asyncio.run(burst())
    finally:
        client = redis.Redis.from_url(REDIS_URL)
        for name in client.scan_iter(f"*{key[:16]}*"):
            client.delete(name)
    admitted = statuses.count(200)
    assert admitted >= 2
    assert statuses.count(429) == 20 - admitted
    completed = list(UsageRecord.objects.filter(status=UsageRecord.Status.COMPLETED))
    assert len(completed) == admitted
    assert {r.request_id for r in completed}  # rows from both processes land in one database
    assert peak_overlap(completed) <= 2
    assert refused_count(20 - admitted) == 20 - admitted


@pytest.mark.django_db(transaction=True)
async def test_a_redis_that_does_not_answer_is_a_503_not_a_hang(
    silent_redis, settings, sync_thread_db
):
    """In process (the limiter follows settings.REDIS_URL): a key with limits needs Redis."""
    from django.test import AsyncClient

    from accounts.services import api_key_create, team_membership_ensure, user_get_or_create
    from inference.services.registry import model_register
    from tests.fixtures.tiny_models import build_tiny_model

    def setup() -> str:
        user = user_get_or_create(username="stalled")
        team, _ = team_membership_ensure(user=user, team_name="stalled")
        model_register(name=TINY, path=build_tiny_model(model_type="qwen3", tokenizer="qwen3"))
        return api_key_create(user=user, team=team, rpm=100)[1]

    raw = await sync_to_async(setup)()
    settings.REDIS_URL = silent_redis
    client = AsyncClient()
    auth = {"Authorization": f"Bearer {raw}"}
    async with asyncio.timeout(15):
        response = await client.post(
            "/v1/chat/completions",
            {"model": TINY, "messages": MESSAGES, "max_tokens": 1},
            content_type="application/json",
            headers=auth,
        )
        models = await client.get("/v1/models", headers=auth)
    assert response.status_code == 503, response.content
    error = response.json()["error"]
    assert error["code"] == "limits_unavailable" and error["type"] == "server_error"
    assert models.status_code == 200 and "x-ratelimit-limit-requests" not in models.headers
    # A refusal has no usage row; the day's roll-up counts it (inference/services/refusals.py).
    assert not await UsageRecord.objects.aexists()
    counted = DailyUsage.objects.filter(num_rejected=1)
    for _ in range(200):  # written within a second
        if await counted.aexists():
            break
        await asyncio.sleep(0.05)
    assert await counted.aexists()
