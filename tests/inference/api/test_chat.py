"""POST /v1/chat/completions with the official OpenAI client against a live daphne server."""

import json
import time

import httpx
import openai
import pytest

from inference.models import UsageRecord
from inference.parsers.json_prefix import INITIAL, advance_text
from tests.inference.conftest import TINY, TINY_SIMPLE

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say something about apples."},
]
GREEDY = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


def finished_row(request_id: str, timeout: float = 10.0) -> UsageRecord:
    deadline = time.monotonic() + timeout
    while True:
        row = UsageRecord.objects.filter(request_id=request_id).first()
        if row and row.status != UsageRecord.Status.IN_PROGRESS:
            return row
        if time.monotonic() > deadline:
            raise AssertionError(f"usage row for {request_id} not finished: {row}")
        time.sleep(0.05)


def test_non_streamed_chat_counts_usage_exactly(client):
    raw = client.chat.completions.with_raw_response.create(model=TINY, messages=MESSAGES, **GREEDY)
    completion = raw.parse()
    assert completion.object == "chat.completion"
    assert completion.model == TINY
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 12
    request_id = raw.headers["x-request-id"]
    row = finished_row(request_id)
    assert row.status == UsageRecord.Status.COMPLETED
    assert row.prompt_tokens == completion.usage.prompt_tokens
    assert row.completion_tokens == completion.usage.completion_tokens
    assert row.endpoint == "chat.completions"


def test_streamed_text_equals_non_streamed_and_ends_with_usage(client):
    whole = client.chat.completions.create(model=TINY, messages=MESSAGES, **GREEDY)
    stream = client.chat.completions.create(
        model=TINY, messages=MESSAGES, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finishes == ["length"]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_sse_wire_format_ends_with_done(live_server_url, api_key):
    body = {"model": TINY, "messages": MESSAGES, "stream": True, "max_tokens": 3, "temperature": 0}
    with httpx.stream(
        "POST",
        f"{live_server_url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=30,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["x-request-id"].startswith("req_")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(line.startswith("data: ") for line in events)
    json.loads(events[0][len("data: ") :])


def test_simple_engine_matches_batched_engine_greedy(client):
    batched = client.chat.completions.create(model=TINY, messages=MESSAGES, **GREEDY)
    simple = client.chat.completions.create(model=TINY_SIMPLE, messages=MESSAGES, **GREEDY)
    assert simple.choices[0].message.content == batched.choices[0].message.content


async def test_async_client_streams(async_client):
    stream = await async_client.chat.completions.create(
        model=TINY, messages=MESSAGES, stream=True, **GREEDY
    )
    pieces = [chunk.choices[0].delta.content async for chunk in stream if chunk.choices]
    whole = await async_client.chat.completions.create(model=TINY, messages=MESSAGES, **GREEDY)
    assert "".join(p or "" for p in pieces) == whole.choices[0].message.content


def test_n_choices_with_seed_are_reproducible(client):
    kwargs = {
        "model": TINY,
        "messages": MESSAGES,
        "n": 3,
        "seed": 7,
        "temperature": 1.0,
        "max_tokens": 8,
        "extra_body": {"ignore_eos": True},
    }
    first = client.chat.completions.create(**kwargs)
    second = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert first.usage.completion_tokens == 24
    assert len({c.message.content for c in first.choices}) > 1


def test_logprobs_and_top_logprobs(client):
    completion = client.chat.completions.create(
        model=TINY, messages=MESSAGES, logprobs=True, top_logprobs=3, **GREEDY
    )
    content = completion.choices[0].logprobs.content
    assert len(content) == 12
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_stop_string_is_never_emitted(client):
    whole = (
        client.chat.completions.create(
            model=TINY,
            messages=MESSAGES,
            temperature=0,
            max_tokens=30,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .message.content
    )
    stop = whole[len(whole) // 2 : len(whole) // 2 + 3]
    expected = whole[: whole.index(stop)]
    for stream in (False, True):
        response = client.chat.completions.create(
            model=TINY,
            messages=MESSAGES,
            temperature=0,
            max_tokens=30,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
        )
        if stream:
            chunks = [c for c in response if c.choices]
            text = "".join(c.choices[0].delta.content or "" for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = response.choices[0].message.content, response.choices[0].finish_reason
        assert text == expected
        assert finish == "stop"


def test_text_content_parts_and_developer_role(client):
    parts = [
        {"role": "developer", "content": "You are terse."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Say something "},
                {"type": "text", "text": "about apples."},
            ],
        },
    ]
    a = client.chat.completions.create(model=TINY, messages=parts, **GREEDY)
    b = client.chat.completions.create(model=TINY, messages=MESSAGES, **GREEDY)
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    assert a.choices[0].message.content == b.choices[0].message.content


def test_tool_history_is_accepted(client):
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"},
    ]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    completion = client.chat.completions.create(
        model=TINY, messages=messages, tools=tools, **GREEDY
    )
    plain = client.chat.completions.create(model=TINY, messages=messages[:1], **GREEDY)
    assert completion.usage.prompt_tokens > plain.usage.prompt_tokens + 20


def test_client_disconnect_aborts_and_records_what_was_sent(live_server_url, api_key):
    body = {
        "model": TINY,
        "messages": MESSAGES,
        "stream": True,
        "max_tokens": 3000,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,  # one logprobs entry per token: the client can count tokens
    }
    received = 0
    with httpx.stream(
        "POST",
        f"{live_server_url}/v1/chat/completions",
        json=body,
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=30,
    ) as response:
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[len("data: ") :])["choices"][0]
                received += len((choice["logprobs"] or {}).get("content") or [])
            if received >= 20:
                break
    row = finished_row(request_id)
    assert row.status == UsageRecord.Status.CANCELLED
    assert row.error_code == "client_disconnected"
    # Billed: what was sent. The client read 20; a few more may have been in flight when it
    # closed the connection, but the generation stopped far short of max_tokens.
    assert received <= row.completion_tokens <= received + 200
    # The engine freed the slot: a new request is served at once.
    quick = openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=api_key, max_retries=0)
    assert quick.chat.completions.create(model=TINY, messages=MESSAGES, **GREEDY).choices


def test_langchain_chat_openai_invoke_and_stream(live_server_url, api_key):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(
        model=TINY,
        base_url=f"{live_server_url}/v1",
        api_key=api_key,
        temperature=0,
        max_tokens=8,
        max_retries=0,
    )
    message = llm.invoke("Say something about apples.")
    assert isinstance(message.content, str) and message.content
    streamed = "".join(chunk.content for chunk in llm.stream("Say something about apples."))
    assert streamed == message.content


@pytest.mark.parametrize("stream", [False, True])
def test_json_object_response_format_gives_a_json_object(client, stream):
    # The tiny model is random: unconstrained it never writes JSON, so this tests the constraint,
    # token by token (its objects run on for hundreds of tokens: a few dozen show the prefix).
    kwargs = {
        "model": TINY,
        "messages": [{"role": "user", "content": "Reply in JSON."}],
        "response_format": {"type": "json_object"},
        "max_tokens": 24,
        "seed": 3,
        "temperature": 0.8,
    }
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        finish = chunks[-1].choices[0].finish_reason
    else:
        completion = client.chat.completions.create(**kwargs)
        text, finish = completion.choices[0].message.content, completion.choices[0].finish_reason
    if finish == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert finish == "length" and text.lstrip().startswith("{")
        assert advance_text(INITIAL, text) is not None  # a prefix of an object


def test_tool_choice_decides_which_tools_the_template_sees(client):
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "g", "parameters": {"type": "object"}}},
    ]
    plain = client.chat.completions.create(model=TINY, messages=MESSAGES, **GREEDY)
    with_tools = client.chat.completions.create(
        model=TINY, messages=MESSAGES, tools=tools, **GREEDY
    )
    hidden = client.chat.completions.create(
        model=TINY, messages=MESSAGES, tools=tools, tool_choice="none", **GREEDY
    )
    required = client.chat.completions.create(
        model=TINY, messages=MESSAGES, tools=tools, tool_choice="required", **GREEDY
    )
    named = client.chat.completions.create(
        model=TINY,
        messages=MESSAGES,
        tools=tools,
        tool_choice={"type": "function", "function": {"name": "g"}},
        **GREEDY,
    )
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens
    assert required.usage.prompt_tokens == with_tools.usage.prompt_tokens
    assert plain.usage.prompt_tokens < named.usage.prompt_tokens < with_tools.usage.prompt_tokens
    for choice, extra in (
        ({"type": "function", "function": {"name": "missing"}}, {"tools": tools}),
        ("required", {}),
        ({"type": "function"}, {"tools": tools}),
        ("sometimes", {"tools": tools}),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(
                model=TINY, messages=MESSAGES, tool_choice=choice, **extra, **GREEDY
            )
        assert caught.value.body["param"] == "tool_choice"


@pytest.mark.parametrize("model", [TINY, TINY_SIMPLE])
def test_penalties_work_and_leave_other_streams_alone(client, model):
    """Penalty state lives on the engine thread; building it elsewhere once crashed the step
    and every other stream in the batch with it."""
    long = client.chat.completions.create(
        model=model,
        messages=MESSAGES,
        stream=True,
        max_tokens=60,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    first = next(iter(long))
    for penalty in (
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"extra_body": {"repetition_penalty": 1.2, "ignore_eos": True}},
    ):
        kwargs = {"temperature": 0, "max_tokens": 8, **penalty}
        reply = client.chat.completions.create(model=model, messages=MESSAGES, **kwargs)
        assert reply.choices[0].finish_reason in ("length", "stop")
    rest = [chunk for chunk in long if chunk.choices]
    assert first.choices and rest[-1].choices[0].finish_reason == "length"


def test_concurrent_streams_all_finish_and_are_all_counted(live_server_url, api_key):
    """The live server reaches its SQLite database through DATABASE_URL (as users configure it):
    twelve streams opening and finishing rows at once must all succeed."""
    import asyncio

    body = {**{k: v for k, v in GREEDY.items() if k != "extra_body"}, "ignore_eos": True}
    body.update(model=TINY, messages=MESSAGES, stream=True, max_tokens=8)

    async def one(client: httpx.AsyncClient) -> bool:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = [line async for line in response.aiter_lines() if line]
        return response.status_code == 200 and lines[-1] == "data: [DONE]"

    async def burst() -> list[bool]:
        async with httpx.AsyncClient(
            base_url=live_server_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
        ) as client:
            return await asyncio.gather(*(one(client) for _ in range(12)))

    assert all(asyncio.run(burst()))
    deadline = time.monotonic() + 10
    while UsageRecord.objects.filter(status=UsageRecord.Status.COMPLETED).count() < 12:
        assert time.monotonic() < deadline, "some usage rows were not finished"
        time.sleep(0.05)
    assert not UsageRecord.objects.exclude(status=UsageRecord.Status.COMPLETED).exists()
