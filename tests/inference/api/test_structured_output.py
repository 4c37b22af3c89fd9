"""Structured output through the API with the official `openai` client over real HTTP, on a tiny
random-weight model with the real Qwen3 tokenizer (and one with Llama 3's): whatever the model
would say, a json_schema reply validates, regexes and choices match, a forced tool choice is a
call the parser reads; a schema the library refuses is a 400 naming its field."""

import json
import re

import httpx
import jsonschema
import openai
import pytest

from inference.parsers.json_prefix import INITIAL, advance_text
from inference.services.registry import model_register
from tests.fixtures.tiny_models import build_tiny_model
from tests.inference.conftest import TINY

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "member"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person."}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"offset": {"type": "integer", "minimum": -12, "maximum": 12}},
                "required": ["offset"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "person", "schema": PERSON, "strict": True},
}


def check_person(text: str, finish_reason: str) -> None:
    assert finish_reason == "stop", text
    jsonschema.validate(json.loads(text), PERSON)


# On the batched engine: that the simple engine applies a grammar the same way, token for token,
# tests/engine/test_grammar.py proves (test_constrained_rows_leave_free_rows_unchanged_and_...).
def test_json_schema_replies_validate(client):
    completion = client.chat.completions.create(
        model=TINY,
        messages=ASK,
        response_format=SCHEMA_FORMAT,
        n=3,
        temperature=1.0,
        seed=1,
        max_tokens=150,
    )
    for choice in completion.choices:
        check_person(choice.message.content, choice.finish_reason)


def test_json_schema_streamed_equals_not_streamed(client):
    kwargs = {"model": TINY, "messages": ASK, "response_format": SCHEMA_FORMAT, "max_tokens": 150}
    kwargs.update(temperature=0.8, seed=7)
    whole = client.chat.completions.create(**kwargs).choices[0]
    parts, finish = [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(parts) == whole.message.content and finish == whole.finish_reason
    check_person(whole.message.content, whole.finish_reason)


def test_json_object_and_a_length_stop(client):
    # Any object. A random model's strings often run on past max_tokens: every reply is a
    # prefix of an object, and those that end are one.
    choices = client.chat.completions.create(
        model=TINY,
        messages=ASK,
        response_format={"type": "json_object"},
        n=4,
        temperature=1.0,
        seed=2,
        max_tokens=60,
    ).choices
    for choice in choices:
        assert advance_text(INITIAL, choice.message.content) is not None
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
    cut = client.chat.completions.create(
        model=TINY, messages=ASK, response_format=SCHEMA_FORMAT, max_tokens=3
    ).choices[0]
    assert cut.finish_reason == "length" and cut.message.content.startswith("{")


def test_regex_choice_and_lark_through_structured_outputs(client):
    pattern = r"[0-9]{3}-[0-9]{4}"
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]?/\n'
    for spec, check in [
        ({"regex": pattern}, lambda text: re.fullmatch(pattern, text)),
        ({"choice": ["red", "green"]}, lambda text: text in ("red", "green")),
        ({"grammar": lark}, lambda text: re.fullmatch(r"The answer is [1-9][0-9]?\.", text)),
        ({"json": PERSON}, lambda text: jsonschema.validate(json.loads(text), PERSON) is None),
    ]:
        completion = client.chat.completions.create(
            model=TINY,
            messages=ASK,
            extra_body={"structured_outputs": spec},
            temperature=1.0,
            seed=3,
            n=2,
            max_tokens=150,
        )
        for choice in completion.choices:
            assert choice.finish_reason == "stop" and check(choice.message.content), spec
    text = (
        client.completions.create(
            model=TINY, prompt="Phone:", extra_body={"structured_outputs": {"regex": pattern}}
        )
        .choices[0]
        .text
    )
    assert re.fullmatch(pattern, text)


def test_stop_strings_still_apply(client):
    completion = client.chat.completions.create(
        model=TINY,
        messages=ASK,
        extra_body={"structured_outputs": {"regex": "abc-def-ghi"}},
        stop=["-g"],
    ).choices[0]
    assert (completion.message.content, completion.finish_reason) == ("abc-def", "stop")


def test_responses_text_format_json_schema(client):
    response = client.responses.create(
        model=TINY,
        input="Describe a person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON}},
        max_output_tokens=150,
    )
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON)


def forced_calls(client, model, tool_choice, samples=6, **kwargs):
    """The calls of `samples` replies sampled at once (n choices, each its own draw)."""
    choices = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Anything."}],
        tools=TOOLS,
        tool_choice=tool_choice,
        temperature=1.0,
        seed=0,
        n=samples,
        max_tokens=200,
        **kwargs,
    ).choices
    assert len(choices) == samples
    for choice in choices:
        assert choice.finish_reason == "tool_calls", choice
        yield choice.message.tool_calls


def test_tool_choice_required_always_yields_a_parsed_call(client):
    for calls in forced_calls(client, TINY, "required"):
        assert calls
        for call in calls:
            tool = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
            jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_a_named_tool_choice_yields_a_call_of_that_function(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    for calls in forced_calls(client, TINY, named, parallel_tool_calls=False):
        [call] = calls
        assert call.function.name == "get_time"
        assert -12 <= json.loads(call.function.arguments)["offset"] <= 12


def test_forced_tool_calls_in_llama3_syntax(client):
    model_register(
        name="tiny-llama3-forced",
        path=build_tiny_model(model_type="llama", tokenizer="llama3_1"),
        tool_parser="llama3_json",
    )
    for calls in forced_calls(client, "tiny-llama3-forced", "required", samples=4):
        assert calls and {c.function.name for c in calls} <= {"get_weather", "get_time"}


def test_responses_tool_choice_required(client):
    response = client.responses.create(
        model=TINY,
        input="Anything.",
        tools=[{"type": "function", **tool["function"]} for tool in TOOLS],
        tool_choice="required",
        max_output_tokens=200,
        temperature=1.0,
        extra_body={"seed": 0},  # a random model's draw, fixed: unseeded, one in a few hundred
        # ran out of tokens inside a second call's JSON
    )
    assert response.output and all(item.type == "function_call" for item in response.output)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
                "tool_choice": "required",
            },
            "tools",
        ),
        ({"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
    ],
)
def test_refused_grammars_are_a_400_naming_the_field(live_server_url, api_key, body, param):
    response = httpx.post(
        f"{live_server_url}/v1/chat/completions",
        json={"model": TINY, "messages": ASK, **body},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_required_tool_choice_without_a_tool_parser_is_a_400(client, smollm2_path):
    model_register(name="no-tool-syntax", path=smollm2_path)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="no-tool-syntax", messages=ASK, tools=TOOLS, tool_choice="required"
        )
    assert caught.value.body["param"] == "tool_choice"


def test_forced_tool_calls_in_harmony(client):
    """gpt-oss: the forced call is a commentary message to=functions.NAME, read by the harmony
    parser from the token ids."""
    model_register(
        name="tiny-gpt-oss-forced", path=build_tiny_model(model_type="llama", tokenizer="gptoss")
    )
    named = {"type": "function", "function": {"name": "get_weather"}}
    for calls in forced_calls(client, "tiny-gpt-oss-forced", named, samples=2):
        [call] = calls
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome", "Oslo")
