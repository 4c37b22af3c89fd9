"""Tool calls and reasoning end to end: the real Qwen3 (and Llama 3) tokenizers and templates,
a tiny model whose replies a test-only logits processor forces to a script
(tests/fixtures/scripted_daphne.py), the real engine, parsers and streaming, the official
`openai` client and LangChain over real HTTP."""

import json

import openai
import pytest

from inference.services.registry import model_register
from tests.fixtures.tiny_models import build_tiny_model
from tests.inference.api.responses.scripted import CALL_PARIS, GPT_OSS
from tests.inference.api.responses.scripted import MODEL as QWEN

LLAMA = "tiny-llama3-tools"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER_TOOL]
# Its script (TOOL_CALL_SCRIPTS in responses/scripted.py) says something before the call.
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture
def tools_client(scripted_url, make_key, transactional_db) -> openai.OpenAI:
    # Parsers detected from the Qwen3 template (hermes, qwen3); set in the registry for the
    # Llama 3 tokenizer, whose npm template predates tools.
    model_register(name=QWEN, path=build_tiny_model(model_type="qwen3", tokenizer="qwen3"))
    model_register(
        name=LLAMA,
        path=build_tiny_model(model_type="llama", tokenizer="llama3_1"),
        tool_parser="llama3_json",
    )
    # The npm gpt-oss tokenizer has no template: prompts render through openai-harmony, and
    # the harmony parsers are detected from that.
    model_register(name=GPT_OSS, path=build_tiny_model(model_type="llama", tokenizer="gptoss"))
    return openai.OpenAI(base_url=f"{scripted_url}/v1", api_key=make_key(), max_retries=0)


def streamed(client, **kwargs):
    """The stream's chunks joined as a client would, plus what the chunks looked like."""
    content, reasoning, calls, finish, chunks = "", "", {}, None, []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        chunks.append(delta)
        content += delta.content or ""
        reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
        for call in delta.tool_calls or ():
            entry = calls.setdefault(call.index, {"id": None, "name": None, "arguments": ""})
            entry["id"] = call.id or entry["id"]
            if call.function and call.function.name:
                entry["name"] = call.function.name
            entry["arguments"] += (call.function.arguments or "") if call.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content, reasoning, [calls[i] for i in sorted(calls)], finish, chunks


def test_a_tool_call_not_streamed(tools_client):
    completion = tools_client.chat.completions.create(
        model=QWEN, messages=ASK, tools=TOOLS, max_tokens=200
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    assert choice.message.model_extra["reasoning_content"].strip() == "The user wants the weather."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


def test_a_streamed_tool_call_equals_the_non_streamed_one_and_never_leaks_markup(tools_client):
    whole = tools_client.chat.completions.create(
        model=QWEN, messages=ASK, tools=TOOLS, max_tokens=200
    )
    content, reasoning, calls, finish, chunks = streamed(
        tools_client, model=QWEN, messages=ASK, tools=TOOLS, max_tokens=200
    )
    message = whole.choices[0].message
    assert (content, finish) == (message.content, "tool_calls")
    assert reasoning == message.model_extra["reasoning_content"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    for delta in chunks:
        assert "<tool_call>" not in (delta.content or "") and "<think>" not in (delta.content or "")
    argument_chunks = [
        d for d in chunks for c in d.tool_calls or () if c.function and c.function.arguments
    ]
    assert len(argument_chunks) > 3  # the arguments streamed as they were generated


def test_the_tool_result_round_trip_renders_and_answers(tools_client):
    first = tools_client.chat.completions.create(
        model=QWEN, messages=ASK, tools=TOOLS, max_tokens=200
    )
    call = first.choices[0].message.tool_calls[0]
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": first.choices[0].message.content,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 °C"},
    ]
    final = tools_client.chat.completions.create(
        model=QWEN, messages=history, tools=TOOLS, max_tokens=200
    )
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == "It is sunny and 21 °C in Paris."
    assert final.choices[0].message.tool_calls is None


@pytest.mark.parametrize("parallel", [True, False])
def test_several_calls_and_parallel_tool_calls(tools_client, parallel):
    messages = [{"role": "user", "content": "Compare two cities."}]
    completion = tools_client.chat.completions.create(
        model=QWEN, messages=messages, tools=TOOLS, parallel_tool_calls=parallel, max_tokens=200
    )
    cities = [
        json.loads(c.function.arguments)["city"] for c in completion.choices[0].message.tool_calls
    ]
    assert cities == (["Paris", "Rome"] if parallel else ["Paris"])
    _, _, calls, finish, _ = streamed(
        tools_client,
        model=QWEN,
        messages=messages,
        tools=TOOLS,
        parallel_tool_calls=parallel,
        max_tokens=200,
    )
    assert [json.loads(c["arguments"])["city"] for c in calls] == cities
    assert finish == "tool_calls"


def test_a_malformed_call_is_content_not_a_crash(tools_client):
    messages = [{"role": "user", "content": "Make a broken call."}]
    completion = tools_client.chat.completions.create(
        model=QWEN, messages=messages, tools=TOOLS, max_tokens=200
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == "<tool_call>\n{not json}\n</tool_call>"
    content, _, calls, finish, _ = streamed(
        tools_client, model=QWEN, messages=messages, tools=TOOLS, max_tokens=200
    )
    assert (content, calls, finish) == (choice.message.content, [], "stop")


def test_without_tools_or_with_tool_choice_none_the_reply_is_not_parsed_for_calls(tools_client):
    for extra in ({}, {"tools": TOOLS, "tool_choice": "none"}):
        completion = tools_client.chat.completions.create(
            model=QWEN, messages=ASK, max_tokens=200, **extra
        )
        message = completion.choices[0].message
        assert message.tool_calls is None and completion.choices[0].finish_reason == "stop"
        assert message.content == "Let me check." + CALL_PARIS
        assert message.model_extra["reasoning_content"].strip() == "The user wants the weather."


def test_enable_thinking_false_gives_content_only(tools_client):
    completion = tools_client.chat.completions.create(
        model=QWEN,
        messages=[{"role": "user", "content": "Answer, no thinking please."}],
        max_tokens=50,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    message = completion.choices[0].message
    assert message.content == "Just the answer."
    assert "reasoning_content" not in (message.model_extra or {})


def test_n_choices_parse_independently(tools_client):
    completion = tools_client.chat.completions.create(
        model=QWEN, messages=ASK, tools=TOOLS, n=3, temperature=0.9, seed=1, max_tokens=200
    )
    ids = set()
    for choice in completion.choices:
        assert choice.finish_reason == "tool_calls"
        [call] = choice.message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        ids.add(call.id)
    assert len(ids) == 3


def test_llama3_json_calls_through_the_llama_tokenizer(tools_client):
    messages = [{"role": "user", "content": "llama weather, please"}]
    completion = tools_client.chat.completions.create(
        model=LLAMA, messages=messages, tools=TOOLS, max_tokens=100
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Oslo"},
    )
    _, _, calls, finish, _ = streamed(
        tools_client, model=LLAMA, messages=messages, tools=TOOLS, max_tokens=100
    )
    assert finish == "tool_calls" and json.loads(calls[0]["arguments"]) == {"city": "Oslo"}


def test_langchain_drives_a_tool_loop(tools_client, scripted_url):
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"Sunny, 21 °C in {city}"

    llm = ChatOpenAI(
        model=QWEN,
        base_url=f"{scripted_url}/v1",
        api_key=tools_client.api_key,
        max_tokens=200,
        max_retries=0,
    ).bind_tools([get_weather])
    messages = [HumanMessage(ASK[0]["content"])]
    reply = llm.invoke(messages)
    assert [(c["name"], c["args"]) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    messages.append(reply)
    for call in reply.tool_calls:
        messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    final = llm.invoke(messages)
    assert final.tool_calls == []
    assert final.content == "It is sunny and 21 °C in Paris."


def test_gpt_oss_harmony_calls_reasoning_and_the_round_trip(tools_client):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the weather in Berlin?"},
    ]
    completion = tools_client.chat.completions.create(
        model=GPT_OSS, messages=messages, tools=TOOLS, max_tokens=200
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Berlin"},
    )
    content, reasoning, calls, finish, chunks = streamed(
        tools_client, model=GPT_OSS, messages=messages, tools=TOOLS, max_tokens=200
    )
    assert (content, reasoning, finish) == ("", "Need the weather.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Berlin"})
    ]
    for delta in chunks:
        assert "<|" not in (delta.content or "")
    history = [
        *messages,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": call.function.arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call.id, "content": "Cloudy, 12 °C"},
    ]
    final = tools_client.chat.completions.create(
        model=GPT_OSS, messages=history, tools=TOOLS, max_tokens=200
    )
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == "Cloudy and 12 °C in Berlin."
    assert final.choices[0].message.model_extra["reasoning_content"] == "Report it."
