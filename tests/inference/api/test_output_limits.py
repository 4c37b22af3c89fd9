"""Output limits over real HTTP, with the official SDKs: a model's default output size applies
where a request leaves max_tokens unset, its ceiling and a key's own refuse a request that asks
for more (a 400 in each route's shape naming the field it was sent as), and one key's ceiling is
not another team's."""

import anthropic
import openai
import pytest

from inference.models import ModelEntry
from tests.inference.conftest import TINY

ASK = [{"role": "user", "content": "Tell me about apples."}]
LONG = {"extra_body": {"ignore_eos": True}}  # generate to the size, whatever the model says


@pytest.fixture
def clients(live_server_url, make_key, tiny_models):
    """Two teams' clients: team-a's key may ask for at most 5 tokens a reply, team-b's has no
    ceiling of its own; the model's default is 8 and its ceiling 50."""
    ModelEntry.objects.filter(name=TINY).update(default_max_tokens=8, max_output_tokens=50)
    keys = [
        make_key(username="alice", team="team-a", max_output_tokens=5),
        make_key(username="bob", team="team-b"),
    ]
    return [
        openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=key, max_retries=0) for key in keys
    ]


def test_the_defaults_fit_the_model_and_the_key(clients):
    capped, free = clients
    for client, size in ((capped, 5), (free, 8)):
        reply = client.chat.completions.create(model=TINY, messages=ASK, **LONG)
        assert reply.usage.completion_tokens == size
        assert reply.choices[0].finish_reason == "length"
    # Under the model's ceiling, the caller's own size is theirs.
    reply = free.chat.completions.create(model=TINY, messages=ASK, max_tokens=20, **LONG)
    assert reply.usage.completion_tokens == 20


def test_every_route_refuses_more_than_a_ceiling_in_its_own_shape(clients, live_server_url):
    capped, free = clients
    over_key = [
        (
            "max_tokens",
            lambda: capped.chat.completions.create(model=TINY, messages=ASK, max_tokens=6),
        ),
        (
            "max_completion_tokens",
            lambda: capped.chat.completions.create(
                model=TINY, messages=ASK, max_completion_tokens=6
            ),
        ),
        ("max_tokens", lambda: capped.completions.create(model=TINY, prompt="Hi", max_tokens=6)),
        (
            "max_output_tokens",
            lambda: capped.responses.create(model=TINY, input="Hi", max_output_tokens=16),
        ),
    ]
    for param, call in over_key:
        with pytest.raises(openai.BadRequestError) as caught:
            call()
        assert caught.value.param == param and caught.value.code == "invalid_value"
        assert "This API key may ask for at most 5 tokens" in caught.value.message
    # The other team's key reaches the model's own ceiling.
    with pytest.raises(openai.BadRequestError) as caught:
        free.chat.completions.create(model=TINY, messages=ASK, max_tokens=51)
    assert f"The model '{TINY}' generates at most 50 tokens" in caught.value.message

    messages = anthropic.Anthropic(
        base_url=live_server_url, api_key=capped.api_key, max_retries=0
    ).messages
    with pytest.raises(anthropic.BadRequestError) as caught:
        messages.create(model=TINY, messages=ASK, max_tokens=6)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "at most 5 tokens" in caught.value.body["error"]["message"]
    assert messages.create(model=TINY, messages=ASK, max_tokens=5).usage.output_tokens <= 5
