"""Anthropic's Messages API with the official `anthropic` SDK over real HTTP: a tiny model with the
real Qwen3 tokenizer and template whose replies the test-only scripted daphne forces
(tests/fixtures/scripted_daphne.py); template, engine, parsers, streaming, keys, limits and
usage rows are real."""

import json

import anthropic
import httpx
import pytest

from inference.models import UsageRecord
from inference.services.registry import model_register
from tests.fixtures.tiny_models import build_tiny_model
from tests.inference.api.responses.scripted import MODEL
from tests.inference.api.test_chat import finished_row

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
# Bounded (a random model's strings and extra keys would run on past max_tokens).
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
STREAM_ORDER = ["message_start", "ping", "content_block_start"]


@pytest.fixture
def raw_key(make_key, transactional_db) -> str:
    model_register(name=MODEL, path=build_tiny_model(model_type="qwen3", tokenizer="qwen3"))
    return make_key()


@pytest.fixture
def client(scripted_url, raw_key) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=scripted_url, api_key=raw_key, max_retries=0)


def test_a_plain_message(client):
    message = client.messages.create(
        model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "Say hello"}]
    )
    assert message.id.startswith("msg_") and message.type == "message"
    assert message.role == "assistant" and message.model == MODEL
    assert [(b.type, b.text) for b in message.content] == [("text", "Hello there!")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    usage = message.usage
    assert usage.output_tokens == 4 and usage.input_tokens + usage.cache_read_input_tokens > 5
    row = finished_row(UsageRecord.objects.get(endpoint="messages").request_id)
    assert (row.status, row.completion_tokens) == ("completed", 4)
    assert row.prompt_tokens == usage.input_tokens + usage.cache_read_input_tokens
    assert row.cached_tokens == usage.cache_read_input_tokens


def test_a_streamed_message_event_by_event(client, scripted_url, raw_key):
    with client.messages.stream(
        model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "Say hello"}]
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.text for e in events if e.type == "content_block_delta"]
    assert "".join(deltas) == "Hello there!" and len(deltas) >= 2
    assert final.content[0].text == "Hello there!" and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == 4
    # On the wire: `event:` lines naming each data line's type, no [DONE].
    with httpx.stream(
        "POST",
        f"{scripted_url}/v1/messages",
        json={
            "model": MODEL,
            "max_tokens": 50,
            "stream": True,
            "messages": [{"role": "user", "content": "Say hello"}],
        },
        headers={"x-api-key": raw_key, "anthropic-version": "2023-06-01"},
        timeout=30,
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    types = [json.loads(line[6:])["type"] for line in lines if line.startswith("data: ")]
    assert names == types and types[-1] == "message_stop"


def test_thinking_and_a_tool_use_round_trip(client):
    first = client.messages.create(
        model=MODEL, max_tokens=200, tools=[WEATHER], messages=ASK_WEATHER
    )
    thinking, tool_use = first.content[0], first.content[-1]
    assert thinking.type == "thinking" and thinking.thinking == "\nThe user wants the weather.\n"
    assert tool_use.type == "tool_use" and tool_use.name == "get_weather"
    assert tool_use.input == {"city": "Paris"} and tool_use.id.startswith("toolu_")
    assert first.stop_reason == "tool_use"
    assert [b.type for b in first.content] == ["thinking", "tool_use"]
    second = client.messages.create(
        model=MODEL,
        max_tokens=200,
        tools=[WEATHER],
        messages=[
            *ASK_WEATHER,
            {"role": "assistant", "content": [b.model_dump() for b in first.content]},
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": tool_use.id, "content": "Sunny, 21"}
                ],
            },
        ],
    )
    assert second.content[0].text == "It is sunny and 21 °C in Paris."
    assert second.stop_reason == "end_turn"


def test_a_streamed_tool_use(client):
    with client.messages.stream(
        model=MODEL, max_tokens=200, tools=[WEATHER], messages=ASK_WEATHER
    ) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta for e in events if e.type == "content_block_delta"]
    partial = "".join(d.partial_json for d in deltas if d.type == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"} == final.content[-1].input
    assert "".join(d.thinking for d in deltas if d.type == "thinking_delta") == (
        "\nThe user wants the weather.\n"
    )
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    assert final.stop_reason == "tool_use"


def test_tool_choice_any_forces_a_call(client):
    message = client.messages.create(
        model=MODEL,
        max_tokens=200,
        tools=[{**WEATHER, "input_schema": CITY_SCHEMA}],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        messages=[{"role": "user", "content": "Anything."}],
        extra_body={"temperature": 1.0},  # this SDK version no longer offers the parameter
    )
    assert message.stop_reason == "tool_use", message
    assert message.content[-1].type == "tool_use" and message.content[-1].name == "get_weather"
    assert message.content[-1].input["city"] in ("Paris", "Rome")


def test_stop_sequences_and_max_tokens(client):
    stopped = client.messages.create(
        model=MODEL,
        max_tokens=50,
        stop_sequences=["STOP", "never"],
        messages=[{"role": "user", "content": "Count slowly"}],
    )
    assert stopped.stop_reason == "end_turn"  # the script has no STOP: the model ended it
    cut = client.messages.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Count slowly"}]
    )
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    three = client.messages.create(
        model=MODEL,
        max_tokens=50,
        stop_sequences=[" three"],
        messages=[{"role": "user", "content": "Count slowly"}],
    )
    assert (three.stop_reason, three.stop_sequence) == ("stop_sequence", " three")
    assert three.content[0].text == "one two"


def test_count_tokens_and_thinking(client):
    messages = [{"role": "user", "content": "Say hello"}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages, system="Be brief.")
    message = client.messages.create(
        model=MODEL, max_tokens=20, messages=messages, system="Be brief."
    )
    usage = message.usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    off = client.messages.count_tokens(
        model=MODEL, messages=messages, system="Be brief.", thinking={"type": "disabled"}
    )
    # Qwen3's template closes an empty think block in the prompt when thinking is off.
    assert off.input_tokens == counted.input_tokens + 4
    with_tools = client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens + 20
    assert not UsageRecord.objects.filter(endpoint="messages", prompt_tokens=0).exists()


def test_count_tokens_refuses_an_embedding_model(client, tmp_path):
    from inference.models import ModelEntry

    ModelEntry.objects.create(name="an-encoder", path=str(tmp_path), kind=ModelEntry.Kind.EMBEDDING)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(
            model="an-encoder", messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.body["error"]["type"] == "invalid_request_error"


def test_bearer_and_x_api_key_both_authenticate(scripted_url, raw_key):
    body = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "Say hello"}]}
    for headers in ({"x-api-key": raw_key}, {"Authorization": f"Bearer {raw_key}"}):
        response = httpx.post(f"{scripted_url}/v1/messages", json=body, headers=headers, timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["type"] == "message"


@pytest.mark.parametrize(
    ("body", "status", "kind"),
    [
        ({"messages": [{"role": "user", "content": "hi"}]}, 400, "invalid_request_error"),
        ({"max_tokens": 5, "messages": []}, 400, "invalid_request_error"),
        ({"max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400, None),
        (
            {
                "max_tokens": 5,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image", "source": {"type": "base64", "data": "x"}}],
                    }
                ],
            },
            400,
            None,
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "model": "no"},
            404,
            "not_found_error",
        ),
        (
            {
                "max_tokens": 5,
                "messages": [{"role": "user", "content": "x"}],
                "tool_choice": {"type": "x"},
            },
            400,
            None,
        ),
        (
            {"max_tokens": 5, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
            400,
            None,
        ),
        ({"max_tokens": 0, "messages": [{"role": "user", "content": "x"}]}, 400, None),
    ],
)
def test_errors_in_anthropics_shape(scripted_url, raw_key, body, status, kind):
    response = httpx.post(
        f"{scripted_url}/v1/messages",
        json={"model": MODEL, **body},
        headers={"x-api-key": raw_key},
        timeout=30,
    )
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and error["error"]["message"]
    assert error["error"]["type"] == (kind or "invalid_request_error")


def test_sdk_errors_and_unknown_routes(scripted_url, raw_key):
    bad = anthropic.Anthropic(base_url=scripted_url, api_key="sk-orch-nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        bad.messages.create(model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["type"] == "authentication_error"
    missing = httpx.post(
        f"{scripted_url}/v1/messages/nope", json={}, headers={"x-api-key": raw_key}, timeout=30
    )
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    # The OpenAI routes keep OpenAI's shape.
    openai_style = httpx.post(f"{scripted_url}/v1/chat/completions", json={}, timeout=30)
    assert set(openai_style.json()) == {"error"}
