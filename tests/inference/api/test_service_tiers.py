"""Service tiers (issue 28) over real HTTP with the official clients: `service_tier` on chat
completions, completions, /v1/responses and /v1/messages resolves against the key's tiers, the
tier served is echoed in each API's own shape (every chat chunk included) and recorded on the
usage row and its roll-up, and a tier the key may not use (or an unknown value) is a 400 in the
route's own shape before anything is reserved. Resolution itself, case by case:
tests/inference/services/test_service_class.py."""

import anthropic
import openai
import pytest

from inference.models import DailyUsage, UsageRecord
from tests.inference.api.test_cache_scope import openai_client
from tests.inference.api.test_chat import finished_row
from tests.inference.conftest import TINY

HI = [{"role": "user", "content": "hi"}]
SHORT = {"temperature": 0, "max_tokens": 2}


@pytest.fixture
def claude_for(live_server_url):
    def make(key: str) -> anthropic.Anthropic:
        return anthropic.Anthropic(base_url=live_server_url, api_key=key, max_retries=0)

    return make


def message(claude: anthropic.Anthropic, **fields):
    return claude.messages.create(model=TINY, max_tokens=2, messages=HI, **fields)


def rows() -> list[tuple[str, str]]:
    started = UsageRecord.objects.order_by("started_at").values_list("request_id", flat=True)
    return [(r.endpoint, r.service_tier) for r in map(finished_row, started)]


def test_the_tier_served_is_echoed_on_every_endpoint_and_metered(
    live_server_url, make_key, tiny_models, claude_for
):
    key = make_key("alice", "team-a", service_tiers=["priority", "default", "flex"])
    client, claude = openai_client(live_server_url, key), claude_for(key)

    assert client.chat.completions.create(model=TINY, messages=HI, **SHORT).service_tier == (
        "default"  # auto, or no tier named: default, where the key may use it
    )
    chunks = list(
        client.chat.completions.create(
            model=TINY,
            messages=HI,
            stream=True,
            stream_options={"include_usage": True},
            service_tier="flex",
            **SHORT,
        )
    )
    assert len(chunks) > 2 and {chunk.service_tier for chunk in chunks} == {"flex"}
    completion = client.completions.create(
        model=TINY, prompt="hi", extra_body={"service_tier": "priority"}, **SHORT
    )
    assert completion.service_tier == "priority"
    completion_chunks = list(
        client.completions.create(
            model=TINY, prompt="hi", stream=True, extra_body={"service_tier": "flex"}, **SHORT
        )
    )
    assert {chunk.service_tier for chunk in completion_chunks} == {"flex"}
    response = client.responses.create(
        model=TINY, input="hi", max_output_tokens=2, service_tier="flex"
    )
    assert response.service_tier == "flex"
    # Anthropic's auto (its default) is priority capacity where the key has it.
    assert message(claude).usage.service_tier == "priority"
    events = list(message(claude, service_tier="standard_only", stream=True))
    assert events[0].type == "message_start"
    assert events[0].message.usage.service_tier == "standard"

    assert rows() == [
        ("chat.completions", "default"),
        ("chat.completions", "flex"),
        ("completions", "priority"),
        ("completions", "flex"),
        ("responses", "flex"),
        ("messages", "priority"),
        ("messages", "default"),
    ]
    daily = DailyUsage.objects.values_list("service_tier", "num_requests")
    assert sorted(daily) == [("default", 2), ("flex", 3), ("priority", 2)]


def test_auto_is_the_best_tier_the_key_has(live_server_url, make_key, tiny_models, claude_for):
    flex_only = make_key("bob", "team-b", service_tiers=["flex"])
    client = openai_client(live_server_url, flex_only)
    assert client.chat.completions.create(model=TINY, messages=HI, **SHORT).service_tier == "flex"
    auto = client.chat.completions.create(model=TINY, messages=HI, service_tier="auto", **SHORT)
    assert auto.service_tier == "flex"
    assert message(claude_for(flex_only)).usage.service_tier == "batch"
    # A key with the default tiers: Anthropic's auto falls back to standard.
    assert message(claude_for(make_key("carol", "team-b"))).usage.service_tier == "standard"


def test_a_tier_the_key_may_not_use_or_an_unknown_one_is_a_400_in_openais_shape(
    live_server_url, make_key, tiny_models
):
    client = openai_client(live_server_url, make_key())  # default and flex
    calls = {
        "chat": lambda tier: client.chat.completions.create(
            model=TINY, messages=HI, extra_body={"service_tier": tier}, **SHORT
        ),
        "completions": lambda tier: client.completions.create(
            model=TINY, prompt="hi", extra_body={"service_tier": tier}, **SHORT
        ),
        "responses": lambda tier: client.responses.create(
            model=TINY, input="hi", extra_body={"service_tier": tier}
        ),
    }
    for name, call in calls.items():
        for tier, message_part in (
            ("priority", "may use 'default', 'flex'"),
            ("scale", "'auto', 'default', 'flex', 'priority'"),
        ):
            with pytest.raises(openai.BadRequestError) as caught:
                call(tier)
            error = caught.value.body
            assert error["type"] == "invalid_request_error", (name, tier)
            assert error["param"] == "service_tier", (name, tier)
            assert message_part in error["message"], (name, tier)
    assert not UsageRecord.objects.exists()  # refused before anything was reserved


def test_an_unknown_tier_is_a_400_in_anthropics_shape(make_key, tiny_models, claude_for):
    claude = claude_for(make_key(service_tiers=["priority"]))
    with pytest.raises(anthropic.BadRequestError) as caught:
        message(claude, service_tier="priority")  # an OpenAI value, not one of Anthropic's
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "service_tier" in body["error"]["message"]
    assert "'auto', 'standard_only'" in body["error"]["message"]
    assert not UsageRecord.objects.exists()
