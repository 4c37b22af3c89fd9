"""The prefix cache through the API: a resent or continued conversation reports its cached
prompt tokens in usage (chat and completions, streamed and not) and in its usage row, and the
reply is the one a cold cache gives."""

import uuid

import pytest

from inference.models import UsageRecord
from tests.inference.api.test_chat import finished_row
from tests.inference.conftest import TINY

# The live server's cache outlives tests, and every chat starts with the template's same few
# tokens: a new conversation may find those cached, never more.
TEMPLATE_HEAD = 10


def conversation() -> list[dict]:
    system = f"{uuid.uuid4().hex}: you are an assistant. " + "Answer briefly and well. " * 20
    return [{"role": "system", "content": system}, {"role": "user", "content": "Name a fruit."}]


GREEDY = {"temperature": 0, "max_tokens": 6}


@pytest.mark.parametrize("stream", [False, True])
def test_a_resent_chat_reports_its_cached_prompt_tokens(client, stream):
    messages = conversation()

    def ask():
        if not stream:
            raw = client.chat.completions.with_raw_response.create(
                model=TINY, messages=messages, **GREEDY
            )
            reply = raw.parse()
            return reply.choices[0].message.content, reply.usage, raw.headers["x-request-id"]
        with client.chat.completions.with_streaming_response.create(
            model=TINY,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            **GREEDY,
        ) as response:
            chunks = list(response.parse())
            request_id = response.headers["x-request-id"]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, chunks[-1].usage, request_id

    first_text, first, _ = ask()
    second_text, second, request_id = ask()
    assert first.prompt_tokens_details.cached_tokens < TEMPLATE_HEAD
    assert second.prompt_tokens_details.cached_tokens == second.prompt_tokens - 1
    assert second_text == first_text
    assert finished_row(request_id).cached_tokens == second.prompt_tokens - 1


def test_completions_share_a_prefix_across_prompts_and_requests(client):
    head = f"{uuid.uuid4().hex}: " + "the orchard is in bloom. " * 30
    first = client.completions.create(model=TINY, prompt=head + "Apples", **GREEDY)
    second = client.completions.create(model=TINY, prompt=head + "Pears", **GREEDY)
    assert first.usage.prompt_tokens_details.cached_tokens < TEMPLATE_HEAD
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0.8 * first.usage.prompt_tokens < cached < second.usage.prompt_tokens
    rows = UsageRecord.objects.filter(endpoint="completions").order_by("started_at")
    assert [r.cached_tokens for r in rows][-1] == cached


def test_the_simple_engine_reports_cached_tokens_too(live_server_url, api_key):
    import openai

    from tests.inference.conftest import TINY_SIMPLE

    simple = openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=api_key, max_retries=0)
    messages = conversation()
    first = simple.chat.completions.create(model=TINY_SIMPLE, messages=messages, **GREEDY)
    second = simple.chat.completions.create(model=TINY_SIMPLE, messages=messages, **GREEDY)
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    assert second.choices[0].message.content == first.choices[0].message.content


def test_a_burst_of_long_prompts_beyond_memory_is_all_answered(
    live_server_url, api_key, tiny_model_path
):
    """A model whose memory budget holds about three of these requests at once: 64 arrive
    together; admission makes them wait their turn, every one is answered, none fails."""
    import asyncio

    import httpx

    from inference.services.registry import model_register

    entry = model_register(name="tiny-small-memory", path=tiny_model_path)
    entry.memory_budget_bytes = 1_200_000  # ~2300 tokens of this model's KV cache
    entry.prefix_cache_bytes = 0
    entry.save()
    filler = "lorem ipsum dolor sit amet " * 80

    async def one(client: httpx.AsyncClient, index: int) -> int:
        body = {
            "model": "tiny-small-memory",
            "prompt": f"{index} {filler}",
            "max_tokens": 8,
            "temperature": 0,
        }
        response = await client.post("/v1/completions", json=body)
        return response.status_code

    async def burst() -> list[int]:
        async with httpx.AsyncClient(
            base_url=live_server_url,
            headers={"Authorization": f"Bearer {api_key}"},
            timeout=120,
            limits=httpx.Limits(max_connections=70),
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(64)))

    assert asyncio.run(burst()) == [200] * 64
