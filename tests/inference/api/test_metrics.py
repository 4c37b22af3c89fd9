"""GET /metrics: scraped from the live server before and after real requests (the official
`openai` client), values checked by their change; protected by a staff key or a token."""

import httpx
import openai
import pytest
from django.test import AsyncClient
from prometheus_client.parser import text_string_to_metric_families

from tests.inference.conftest import TINY

MESSAGES = [{"role": "user", "content": "Hi"}]


def scrape(url: str, key: str) -> dict[tuple[str, tuple], float]:
    response = httpx.get(f"{url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=30)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_count_real_requests(live_server_url, staff_key, client, make_key):
    before = scrape(live_server_url, staff_key)
    plain = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=5)
    streamed = list(
        client.chat.completions.create(
            model=TINY, messages=MESSAGES, max_tokens=6, stream=True, temperature=0
        )
    )
    assert streamed
    limited = openai.OpenAI(
        base_url=f"{live_server_url}/v1", api_key=make_key("rl", "rl-team", rpm=1), max_retries=0
    )
    small = limited.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.RateLimitError):
        limited.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=2)
    after = scrape(live_server_url, staff_key)

    def delta(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    chat = {"endpoint": "chat.completions", "model": TINY}
    assert delta("orchard_requests_total", status="completed", **chat) == 3
    # Refused before its body was read: the model it asked for is not known.
    assert (
        delta("orchard_requests_total", status="rejected", endpoint=chat["endpoint"], model="") == 1
    )
    assert delta("orchard_limiter_rejections_total", reason="rate_limit_exceeded") == 1
    assert delta("orchard_completion_tokens_total", **chat) == plain.usage.completion_tokens + 6 + 2
    assert delta("orchard_prompt_tokens_total", **chat) >= 3 * plain.usage.prompt_tokens
    assert delta("orchard_time_to_first_token_seconds_count", **chat) == 3
    # The gaps between the streamed tokens (and the others'): at least 5 + 4 + 1.
    assert delta("orchard_inter_token_latency_seconds_count", model=TINY) >= 10
    assert value(after, "orchard_engine_running_sequences", model=TINY) == 0
    assert ("orchard_prefix_cache_lookups_total", (("model", TINY),)) in after
    assert delta("orchard_prefix_cache_lookups_total", model=TINY) >= 3
    assert ("orchard_speculative_draft_tokens_total", (("model", TINY),)) in after
    # Each team's share of the engine (engine/core/fairness.py), by team name.
    team = {"model": TINY, "team": "rl-team"}
    assert delta("orchard_team_generated_tokens_total", **team) == small.usage.completion_tokens
    assert delta("orchard_team_prompt_tokens_total", **team) >= 1
    assert value(after, "orchard_team_running_sequences", **team) == 0
    assert ("orchard_engine_preemptions_total", (("model", TINY),)) in after
    drafted = value(after, "orchard_speculative_draft_tokens_total", model=TINY)
    assert 0 <= value(after, "orchard_speculative_accepted_tokens_total", model=TINY) <= drafted


def test_metrics_are_not_public(live_server_url, api_key):
    anonymous = httpx.get(f"{live_server_url}/metrics", timeout=30)
    assert anonymous.status_code == 401 and "orchard_" not in anonymous.text
    member = httpx.get(
        f"{live_server_url}/metrics", headers={"Authorization": f"Bearer {api_key}"}, timeout=30
    )
    assert member.status_code == 403
    wrong = httpx.get(
        f"{live_server_url}/metrics", headers={"Authorization": "Bearer nope"}, timeout=30
    )
    assert wrong.status_code == 401


@pytest.mark.django_db
async def test_a_configured_token_is_accepted(settings):
    settings.ORCHARD_METRICS_TOKEN = "scrape-me-0123456789"
    web = AsyncClient()
    ok = await web.get("/metrics", headers={"Authorization": "Bearer scrape-me-0123456789"})
    assert ok.status_code == 200 and b"orchard_requests" in ok.content
    near = await web.get("/metrics", headers={"Authorization": "Bearer scrape-me-012345678"})
    assert near.status_code == 401
    settings.ORCHARD_METRICS_TOKEN = ""
    empty = await web.get("/metrics", headers={"Authorization": "Bearer "})
    assert empty.status_code == 401
