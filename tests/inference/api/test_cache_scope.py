"""The prefix cache is per team (issue 27): another team's key sending the very prompt a team sent
reuses nothing (`cached_tokens` 0, so it learns nothing of the prompt), while the team's other
members and keys do; `cache_salt` separates requests within a team, on every endpoint;
`prefix_cache_shared` lets every team hit; a bad salt is a 400 in the endpoint's own shape.

Every test has teams of its own, so their scopes start empty: a cold request reports 0 cached
tokens exactly (not even the chat template's first tokens). Scopes shared between tests (a
model's shared cache) may hold those few tokens from earlier tests."""

import uuid

import anthropic
import openai
import pytest

from inference.models import ModelEntry, UsageRecord
from tests.inference.api.test_chat import finished_row
from tests.inference.api.test_prefix_cache import TEMPLATE_HEAD, conversation
from tests.inference.conftest import TINY

GREEDY = {"temperature": 0, "max_tokens": 4}


def openai_client(live_server_url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=key, max_retries=0)


def chat_usage(client: openai.OpenAI, messages: list[dict], salt: str | None = None):
    extra = {"cache_salt": salt} if salt is not None else None
    reply = client.chat.completions.create(
        model=TINY, messages=messages, extra_body=extra, **GREEDY
    )
    return reply.usage


@pytest.fixture
def keys(live_server_url, make_key, tiny_models) -> dict[str, openai.OpenAI]:
    """alice and carol in team A (each with a key of her own), bob in team B."""
    return {
        "alice": openai_client(live_server_url, make_key("alice", "team-a")),
        "carol": openai_client(live_server_url, make_key("carol", "team-a")),
        "bob": openai_client(live_server_url, make_key("bob", "team-b")),
    }


def test_another_team_reuses_nothing_of_a_teams_prompt_its_members_reuse_it(keys):
    messages = conversation()  # a long system prompt no one sent before
    first = chat_usage(keys["alice"], messages)
    assert first.prompt_tokens > 100 and first.prompt_tokens_details.cached_tokens == 0
    other_team = chat_usage(keys["bob"], messages)
    assert other_team.prompt_tokens_details.cached_tokens == 0
    member = chat_usage(keys["carol"], messages)
    assert member.prompt_tokens_details.cached_tokens == member.prompt_tokens - 1
    # Team B's own request is its own to reuse.
    again = chat_usage(keys["bob"], messages)
    assert again.prompt_tokens_details.cached_tokens == again.prompt_tokens - 1
    started = UsageRecord.objects.order_by("started_at").values_list("request_id", flat=True)
    rows = [finished_row(request_id) for request_id in started]
    assert [(r.team.name, r.cached_tokens) for r in rows] == [
        ("team-a", 0),
        ("team-b", 0),
        ("team-a", member.prompt_tokens - 1),
        ("team-b", again.prompt_tokens - 1),
    ]


def test_a_cache_salt_separates_requests_of_one_team(keys):
    messages = conversation()
    salt, other_salt = f"user-{uuid.uuid4().hex}", f"user-{uuid.uuid4().hex}"
    assert chat_usage(keys["alice"], messages, salt).prompt_tokens_details.cached_tokens == 0
    assert chat_usage(keys["carol"], messages, other_salt).prompt_tokens_details.cached_tokens == 0
    # Neither salted request left anything in the team's unsalted scope.
    assert chat_usage(keys["carol"], messages).prompt_tokens_details.cached_tokens == 0
    same = chat_usage(keys["carol"], messages, salt)
    assert same.prompt_tokens_details.cached_tokens == same.prompt_tokens - 1
    # The salt narrows the team's scope; it does not open another team's.
    assert chat_usage(keys["bob"], messages, salt).prompt_tokens_details.cached_tokens == 0


def test_a_model_that_shares_its_prefix_cache_lets_every_team_hit(keys):
    ModelEntry.objects.filter(name=TINY).update(prefix_cache_shared=True)
    messages = conversation()
    first = chat_usage(keys["alice"], messages)
    assert first.prompt_tokens_details.cached_tokens < TEMPLATE_HEAD
    other_team = chat_usage(keys["bob"], messages)
    assert other_team.prompt_tokens_details.cached_tokens == other_team.prompt_tokens - 1
    # A salt still applies.
    salted = chat_usage(keys["bob"], messages, f"s-{uuid.uuid4().hex}")
    assert salted.prompt_tokens_details.cached_tokens == 0
    # Unshared again: from the next request on, no team meets the shared entries.
    ModelEntry.objects.filter(name=TINY).update(prefix_cache_shared=False)
    assert chat_usage(keys["bob"], messages).prompt_tokens_details.cached_tokens == 0


def test_the_salt_scopes_completions_responses_and_messages(keys, live_server_url, make_key):
    alice = keys["alice"]
    claude = anthropic.Anthropic(
        base_url=live_server_url, api_key=make_key("dave", "team-a"), max_retries=0
    )
    system = conversation()[0]["content"]

    def completions(salt):
        extra = {"cache_salt": salt} if salt else None
        usage = alice.completions.create(
            model=TINY, prompt=system, extra_body=extra, **GREEDY
        ).usage
        return usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens

    def responses(salt):
        extra = {"cache_salt": salt} if salt else None
        usage = alice.responses.create(
            model=TINY,
            instructions=system,
            input="Name a fruit.",
            max_output_tokens=4,
            temperature=0,
            extra_body=extra,
        ).usage
        return usage.input_tokens_details.cached_tokens, usage.input_tokens

    def messages(salt):
        extra = {"cache_salt": salt} if salt else None
        usage = claude.messages.create(
            model=TINY,
            max_tokens=4,
            system=system,
            messages=[{"role": "user", "content": "Name a fruit."}],
            extra_body=extra,
        ).usage
        cached = usage.cache_read_input_tokens
        return cached, usage.input_tokens + cached

    for endpoint in (completions, responses, messages):
        salt = f"s-{uuid.uuid4().hex}"
        endpoint(None)  # the team's unsalted scope holds this prompt now
        assert endpoint(salt)[0] == 0, endpoint.__name__
        cached, prompt_tokens = endpoint(salt)
        assert cached == prompt_tokens - 1, endpoint.__name__


BAD_SALTS = [("", "must not be empty"), ("x" * 257, "at most 256"), (5, "must be a string")]


@pytest.mark.parametrize(("salt", "message"), BAD_SALTS)
def test_a_bad_cache_salt_is_a_400_in_openais_shape(keys, salt, message):
    client = keys["alice"]
    calls = {
        "chat": lambda extra: client.chat.completions.create(
            model=TINY, messages=[{"role": "user", "content": "hi"}], extra_body=extra
        ),
        "completions": lambda extra: client.completions.create(
            model=TINY, prompt="hi", extra_body=extra
        ),
        "responses": lambda extra: client.responses.create(
            model=TINY, input="hi", extra_body=extra
        ),
    }
    for name, call in calls.items():
        with pytest.raises(openai.BadRequestError) as caught:
            call({"cache_salt": salt})
        error = caught.value.body
        assert error["type"] == "invalid_request_error", name
        assert error["param"] == "cache_salt" and message in error["message"], name
    assert not UsageRecord.objects.exists()  # refused before anything was reserved


@pytest.mark.parametrize(("salt", "message"), BAD_SALTS)
def test_a_bad_cache_salt_is_a_400_in_anthropics_shape(
    live_server_url, make_key, tiny_models, salt, message
):
    claude = anthropic.Anthropic(base_url=live_server_url, api_key=make_key(), max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model=TINY,
            max_tokens=4,
            messages=[{"role": "user", "content": "hi"}],
            extra_body={"cache_salt": salt},
        )
    body = caught.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "cache_salt" in body["error"]["message"] and message in body["error"]["message"]
    assert not UsageRecord.objects.exists()
