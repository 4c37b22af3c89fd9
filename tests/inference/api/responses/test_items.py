"""/v1/responses end to end with the official `openai` client over real HTTP: output items,
events and streaming, and what a body may hold. A tiny model with the real Qwen3 tokenizer and
template whose replies a test-only logits processor forces to a script
(tests/fixtures/scripted_daphne.py); template, engine, parsers, streaming and the database are
real."""

import json

import httpx
import openai
import pytest

from inference.models import StoredResponse, UsageRecord
from tests.inference.api.responses.scripted import MODEL, WEATHER_TOOL
from tests.inference.api.test_chat import finished_row

TEXT_EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    "response.output_text.delta",
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def collect(stream):
    """The events of a streamed response, checked to be numbered 0, 1, 2, ... in order."""
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def without_ids(output):
    """Output items with their generated ids left out (two runs differ only there)."""
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


def dumped(output):
    return [item.model_dump(exclude_none=True) for item in output]


def test_a_plain_response_not_streamed(client):
    response = client.responses.create(model=MODEL, input="Say hello", max_output_tokens=50)
    assert response.id.startswith("resp_")
    assert response.object == "response"
    assert response.status == "completed"
    assert response.output_text == "Hello there!"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.status == "completed"
    assert [(p.type, p.text) for p in message.content] == [("output_text", "Hello there!")]
    usage = response.usage
    assert usage.input_tokens > 5 and usage.output_tokens == 4  # "Hello there!" + end
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.input_tokens_details.cached_tokens >= 0
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert response.store is True and response.max_output_tokens == 50
    # Stored for the team: GET gives the same response.
    again = client.responses.retrieve(response.id)
    assert again.model_dump() == response.model_dump()
    row = UsageRecord.objects.get(endpoint="responses")
    assert (row.status, row.completion_tokens) == ("completed", 4)
    assert row.prompt_tokens == usage.input_tokens


def test_a_plain_response_streamed_event_by_event(client):
    with client.responses.stream(model=MODEL, input="Say hello") as stream:
        events = collect(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == "Hello there!" and len(deltas) >= 2  # token by token
    assert kinds == TEXT_EVENTS[:4] + ["response.output_text.delta"] * len(deltas) + TEXT_EVENTS[5:]
    created, completed = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == []
    assert completed.status == "completed" and completed.output_text == "Hello there!"
    added, done = events[2], events[-2]
    assert added.item.status == "in_progress" and done.item.status == "completed"
    text_done, part_done = events[-4], events[-3]
    assert text_done.text == "Hello there!" and part_done.part.text == "Hello there!"
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {added.item.id}
    assert final.id == created.id
    assert client.responses.retrieve(final.id).output_text == "Hello there!"


def test_the_stream_has_no_done_line(scripted_url, raw_key):
    body = {"model": MODEL, "input": "Say hello", "stream": True}
    lines = []
    with httpx.stream(
        "POST",
        f"{scripted_url}/v1/responses",
        json=body,
        headers={"Authorization": f"Bearer {raw_key}"},
        timeout=30,
    ) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith(("event: ", "data: {")) for line in lines)
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    assert names == [e["type"] for e in events]
    assert events[-1]["type"] == "response.completed"


def test_reasoning_and_a_tool_call_streamed_and_not(client):
    kwargs = {"model": MODEL, "input": "What is the weather in Paris?", "tools": [WEATHER_TOOL]}
    response = client.responses.create(**kwargs)
    reasoning, call = response.output
    assert reasoning.type == "reasoning"
    assert [c.text for c in reasoning.content] == ["\nThe user wants the weather.\n"]
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"}
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert response.output_text == "" and response.status == "completed"
    assert response.usage.output_tokens_details.reasoning_tokens > 3
    with client.responses.stream(**kwargs) as stream:
        events = collect(stream)
    kinds = [e.type for e in events]
    assert without_ids(dumped(events[-1].response.output)) == without_ids(dumped(response.output))
    first_call = kinds.index("response.function_call_arguments.delta")
    assert kinds[:4] == TEXT_EVENTS[:4]
    assert events[2].item.type == "reasoning"
    assert "response.reasoning_text.delta" in kinds[4:first_call]
    reasoning_done = kinds.index("response.reasoning_text.done")
    assert kinds[reasoning_done : reasoning_done + 4] == [
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # the call: no message for the whitespace between
    ]
    assert events[reasoning_done + 3].item.type == "function_call"
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )
    assert json.loads(arguments) == {"city": "Paris"} == json.loads(events[-3].arguments)
    assert events[-3].name == "get_weather"


def test_an_incomplete_response(client):
    response = client.responses.create(model=MODEL, input="Count slowly", max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.usage.output_tokens == 3
    with client.responses.stream(model=MODEL, input="Count slowly", max_output_tokens=3) as s:
        events = collect(s)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == response.output_text


def test_namespaced_tools_reach_the_template_and_hosted_ones_are_left_out(client):
    tools = [
        {"type": "web_search", "external_web_access": False},
        {
            "type": "namespace",
            "name": "crm",
            "description": "Customer records.",
            "tools": [
                {
                    "type": "function",
                    "name": "lookup_customer",
                    "parameters": {"type": "object", "properties": {"id": {"type": "integer"}}},
                }
            ],
        },
    ]
    # The script answers with a call only if the prompt shows the namespaced tool.
    response = client.responses.create(model=MODEL, input="Find customer 7", tools=tools)
    [call] = response.output
    assert (call.type, call.namespace, call.name) == ("function_call", "crm", "lookup_customer")
    assert json.loads(call.arguments) == {"id": 7}
    assert [t.type for t in response.tools] == ["web_search", "namespace"]
    # Its result goes back under the same namespace.
    follow = client.responses.create(
        model=MODEL,
        previous_response_id=response.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21"}],
        tools=tools,
    )
    assert follow.output_text == "It is sunny and 21 °C in Paris."


def test_a_client_leaving_mid_stream_is_billed_for_what_it_got(scripted_url, raw_key):
    body = {"model": MODEL, "input": "Write a long story.", "stream": True}
    body["max_output_tokens"] = 2000
    deltas, response_id = 0, None
    with httpx.stream(
        "POST",
        f"{scripted_url}/v1/responses",
        json=body,
        headers={"Authorization": f"Bearer {raw_key}"},
        timeout=30,
    ) as response:
        request_id = response.headers["x-request-id"]
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            response_id = response_id or event["response"]["id"]
            deltas += event["type"].endswith(".delta")
            if deltas >= 20:
                break
    row = finished_row(request_id)
    assert row.status == UsageRecord.Status.CANCELLED
    assert deltas <= row.completion_tokens <= deltas + 200
    assert not StoredResponse.objects.filter(id=response_id).exists()


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": 5}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_audio", "data": "x"}]}]},
            "input[0].content[0].type",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0].image_url",
        ),
        ({"input": [{"type": "computer_call_output"}]}, "input[0].type"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "x"}}}},
            "text.format",
        ),
        ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text"),
        ({"input": "hi", "background": True}, "background"),
        ({"input": "hi", "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
        ({"input": "hi", "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name"),
        ({"input": "hi", "metadata": {"k": 5}}, "metadata"),
        (
            {
                "input": "hi",
                "max_output_tokens": 4,
                "tools": [WEATHER_TOOL],
                "tool_choice": {
                    "type": "allowed_tools",
                    "mode": "auto",
                    "tools": [{"type": "function", "name": {"a": 1}}],
                },
            },
            None,
        ),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "hi", "temperature": "hot"}, "temperature"),
        ({"input": "hi", "reasoning": {"effort": "extreme"}}, "reasoning"),
        ({"input": "hi", "chat_template_kwargs": {"chat_template": "x"}}, "chat_template_kwargs"),
        ({"input": "hi", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": "hi", "model": "no-such-model"}, "model"),
    ],
)
def test_bad_input_is_a_clear_error(scripted_url, raw_key, body, param):
    response = httpx.post(
        f"{scripted_url}/v1/responses",
        json={"model": MODEL, **body},
        headers={"Authorization": f"Bearer {raw_key}"},
        timeout=30,
    )
    if param is None:  # odd but harmless: no error, nothing broken
        assert response.status_code == 200, response.text
        return
    assert response.status_code in (400, 404), response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert error["message"] and error["type"] == "invalid_request_error"
    assert not UsageRecord.objects.exclude(status="rejected").exists()


def test_reasoning_items_replay_into_the_template(client):
    """Qwen3's template renders the reasoning of the turn after the last user message: the
    same history with its reasoning item is a longer prompt than without it."""
    first = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER_TOOL], store=False
    )
    reasoning, call = (item.model_dump(exclude_none=True) for item in first.output)
    question = {"role": "user", "content": "What is the weather in Paris?"}
    result = {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny, 21"}
    kwargs = {"model": MODEL, "tools": [WEATHER_TOOL], "store": False}
    with_reasoning = client.responses.create(input=[question, reasoning, call, result], **kwargs)
    without = client.responses.create(input=[question, call, result], **kwargs)
    assert with_reasoning.output_text == without.output_text == "It is sunny and 21 °C in Paris."
    assert with_reasoning.usage.input_tokens >= without.usage.input_tokens + 6


def test_chat_template_kwargs_reach_the_template(client):
    plain = client.responses.create(model=MODEL, input="Say hello")
    no_thinking = client.responses.create(
        model=MODEL,
        input="Say hello",
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    # Qwen3's template closes an empty think block in the prompt when thinking is off.
    assert no_thinking.usage.input_tokens == plain.usage.input_tokens + 4
    assert no_thinking.output_text == "Hello there!"


def test_json_object_format(client):
    response = client.responses.create(
        model=MODEL,
        input="Give me a JSON object.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=40,
        temperature=1.0,
    )
    assert response.text.format.type == "json_object"
    assert response.output_text.lstrip().startswith("{")
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)


def test_the_openai_agents_sdk_runs_a_tool_loop(scripted_url, raw_key):
    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return "Sunny, 21"

    model = OpenAIResponsesModel(
        model=MODEL,
        openai_client=openai.AsyncOpenAI(
            base_url=f"{scripted_url}/v1", api_key=raw_key, max_retries=0
        ),
    )
    agent = Agent(name="weather", instructions="Use tools.", model=model, tools=[get_weather])
    result = Runner.run_sync(agent, "What is the weather in Paris?")
    assert asked == ["Paris"]
    assert result.final_output == "It is sunny and 21 °C in Paris."
