"""Per-key limits enforced at the real HTTP API: 429 bodies, x-ratelimit headers on streamed and
non-streamed responses, and real concurrency against max_parallel."""

import asyncio

import httpx
import openai
import pytest

from inference.models import UsageRecord
from tests.inference.conftest import TINY, key_alerts_written, refused_count

MESSAGES = [{"role": "user", "content": "Hi"}]
RATE_HEADERS = (
    "x-ratelimit-limit-requests",
    "x-ratelimit-limit-tokens",
    "x-ratelimit-remaining-requests",
    "x-ratelimit-remaining-tokens",
    "x-ratelimit-reset-requests",
    "x-ratelimit-reset-tokens",
)


def client_for(live_server_url, key):
    return openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=key, max_retries=0)


def test_rate_limit_headers_on_every_response_of_a_limited_key(
    live_server_url, make_key, tiny_models
):
    key = make_key(rpm=100, tpm=100_000)
    client = client_for(live_server_url, key)
    raw = client.chat.completions.with_raw_response.create(
        model=TINY, messages=MESSAGES, max_tokens=2
    )
    for name in RATE_HEADERS:
        assert name in raw.headers, name
    assert raw.headers["x-ratelimit-limit-requests"] == "100"
    assert int(raw.headers["x-ratelimit-remaining-requests"]) == 99
    with client.chat.completions.with_streaming_response.create(
        model=TINY, messages=MESSAGES, max_tokens=2, stream=True
    ) as streamed:
        assert int(streamed.headers["x-ratelimit-remaining-requests"]) == 98
        list(streamed.iter_lines())
    models = client.models.with_raw_response.list()
    assert models.headers["x-ratelimit-limit-requests"] == "100"


def test_rpm_limit_gives_429_with_an_openai_body_and_a_counted_refusal(
    live_server_url, make_key, tiny_models
):
    key = make_key(rpm=2)
    client = client_for(live_server_url, key)
    for _ in range(2):
        client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=1)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=1)
    assert caught.value.code == "rate_limit_exceeded"
    assert caught.value.response.headers["x-ratelimit-remaining-requests"] == "0"
    statuses = sorted(UsageRecord.objects.values_list("status", flat=True))
    assert statuses == ["completed", "completed"]  # a refusal has no row of its own...
    assert refused_count() == 1  # ...but the day's roll-up counts it


def test_budget_exhaustion_is_insufficient_quota(live_server_url, make_key, tiny_models):
    key = make_key(budget_tokens=60)
    client = client_for(live_server_url, key)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=100)
    assert caught.value.code == "insufficient_quota"
    assert caught.value.body["type"] == "insufficient_quota"
    ok = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=5)
    assert ok.usage.total_tokens <= 60
    # The budget's alerts (50/80/100 %) as far as this request reached them.
    reached = sum(1 for t in (50, 80, 100) if ok.usage.total_tokens * 100 >= t * 60)
    assert key_alerts_written(ok.usage.total_tokens, 60) == reached


def test_fifty_simultaneous_requests_against_max_parallel_two(
    live_server_url, make_key, tiny_models
):
    key = make_key(max_parallel=2)

    async def one(client: httpx.AsyncClient) -> int:
        response = await client.post(
            "/v1/chat/completions",
            json={
                "model": TINY,
                "messages": MESSAGES,
                "max_tokens": 40,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        if response.status_code == 429:
            assert response.json()["error"]["code"] == "rate_limit_exceeded"
        return response.status_code

    async def burst() -> list[int]:
        async with httpx.AsyncClient(
            base_url=live_server_url,
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
            limits=httpx.Limits(max_connections=60),
        ) as client:
            return await asyncio.gather(*(one(client) for _ in range(50)))

    statuses = asyncio.run(burst())
    admitted = statuses.count(200)
    assert admitted >= 2
    assert statuses.count(429) == 50 - admitted
    rows = list(UsageRecord.objects.all())
    completed = [r for r in rows if r.status == UsageRecord.Status.COMPLETED]
    assert len(completed) == len(rows) == admitted
    assert refused_count(50 - admitted) == 50 - admitted
    # Never more than two admitted requests overlapping in time.
    events = sorted(
        [(r.started_at, 1) for r in completed] + [(r.finished_at, -1) for r in completed]
    )
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak <= 2


def test_error_responses_of_a_limited_key_carry_rate_limit_headers(
    live_server_url, make_key, tiny_models
):
    key = make_key(rpm=100, tpm=100_000)
    headers = {"Authorization": f"Bearer {key}"}
    url = f"{live_server_url}/v1/chat/completions"
    not_found = httpx.post(url, json={"model": "nope", "messages": MESSAGES}, headers=headers)
    invalid = httpx.post(url, json={"model": TINY, "messages": MESSAGES, "n": 0}, headers=headers)
    for response, status in ((not_found, 404), (invalid, 400)):
        assert response.status_code == status
        assert response.headers["x-ratelimit-limit-requests"] == "100"
        assert response.headers["x-ratelimit-limit-tokens"] == "100000"


@pytest.mark.parametrize("stream", [False, True])
def test_a_tpm_below_the_context_admits_requests_without_max_tokens(
    live_server_url, make_key, tiny_models, stream
):
    """max_tokens omitted (the SDK default) asks for the rest of the 4096-token context; a key
    with tpm 300 gets what its window has left, and the reply stops there."""
    key = make_key(tpm=300)
    client = client_for(live_server_url, key)
    kwargs = {"model": TINY, "messages": MESSAGES, "extra_body": {"ignore_eos": True}}
    if stream:
        chunks = list(
            client.chat.completions.create(
                stream=True, stream_options={"include_usage": True}, **kwargs
            )
        )
        usage = chunks[-1].usage
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        reply = client.chat.completions.create(**kwargs)
        usage, finish = reply.usage, reply.choices[0].finish_reason
    assert finish == "length"
    assert usage.total_tokens == 300
    row = UsageRecord.objects.get(status=UsageRecord.Status.COMPLETED)
    assert row.reserved_tokens == 300 and row.prompt_tokens + row.completion_tokens == 300
    # The window is full now: the next request is refused, not cut to nothing.
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(**kwargs)
    assert caught.value.code == "rate_limit_exceeded"
    assert refused_count() == 1  # written: nothing is left to write as the test's data goes


def test_a_budget_below_one_context_is_not_exhausted(live_server_url, make_key, tiny_models):
    key = make_key(budget_tokens=250)
    client = client_for(live_server_url, key)
    first = client.chat.completions.create(
        model=TINY, messages=MESSAGES, max_tokens=10, extra_body={"ignore_eos": True}
    )
    rest = client.chat.completions.create(
        model=TINY, messages=MESSAGES, n=2, extra_body={"ignore_eos": True}
    )
    assert [c.finish_reason for c in rest.choices] == ["length", "length"]
    assert first.usage.total_tokens + rest.usage.total_tokens <= 250
    assert rest.usage.total_tokens >= 250 - first.usage.total_tokens - 1  # n=2 splits evenly
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=TINY, messages=MESSAGES)
    assert caught.value.code == "insufficient_quota"
    assert refused_count() == 1
    used = first.usage.total_tokens + rest.usage.total_tokens
    assert key_alerts_written(used, 250) >= 2  # 50 % and 80 % at least


def test_a_limited_key_is_refused_before_its_prompt_is_rendered(
    live_server_url, make_key, tiny_models
):
    key = make_key(rpm=1)
    client = client_for(live_server_url, key)
    client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=1)
    # Rendered, this prompt would be a 400 (it overflows the context): the 429 comes first.
    too_long = [{"role": "user", "content": "apple " * 5000}]
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=TINY, messages=too_long, max_tokens=1)
    assert caught.value.code == "rate_limit_exceeded"
    assert refused_count() == 1


def test_bad_requests_and_token_counts_spend_the_keys_requests_too(
    live_server_url, make_key, tiny_models
):
    """Every authenticated request counts against rpm, whatever it asks: a 400 and a
    count_tokens of one key spend its window; another team's key is untouched."""
    key, other = make_key(rpm=3), make_key("bob", "team-b", rpm=3)
    with httpx.Client(base_url=live_server_url, timeout=60) as http:
        bad = http.post(
            "/v1/chat/completions",
            json={"model": TINY, "messages": "not a list"},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert bad.status_code == 400
        assert bad.headers["x-ratelimit-remaining-requests"] == "2"
        counted = http.post(
            "/v1/messages/count_tokens",
            json={"model": TINY, "messages": [{"role": "user", "content": "Hi"}]},
            headers={"x-api-key": key, "anthropic-version": "2023-06-01"},
        )
        assert counted.status_code == 200, counted.text
        assert counted.json()["input_tokens"] > 0
        unknown = http.post(
            "/v1/chat/completions",
            json={"model": "no-such-model", "messages": MESSAGES},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert unknown.status_code == 404
        refused = http.post(
            "/v1/chat/completions",
            json={"model": TINY, "messages": MESSAGES, "max_tokens": 1},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert refused.status_code == 429
        assert refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused_count() == 1
    answered = client_for(live_server_url, other).chat.completions.create(
        model=TINY, messages=MESSAGES, max_tokens=1
    )
    assert answered.usage.completion_tokens == 1
