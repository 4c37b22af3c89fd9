"""/v1/responses end to end with the official `openai` client over real HTTP: a tiny model with
the real Qwen3 tokenizer and template whose replies a test-only logits processor forces to a
script (tests/fixtures/scripted_daphne.py); template, engine, parsers, streaming and the
database are real."""

import json

import httpx
import openai
import pytest

from inference.models import StoredResponse, UsageRecord
from inference.services.registry import model_register
from tests.fixtures.daphne import free_port, server_env, start_daphne, stop_daphne
from tests.fixtures.tiny_models import build_tiny_model
from tests.inference.api.test_chat import finished_row

MODEL = "tiny-qwen3-responses"
CALL_CRM = '<tool_call>\n{"name": "crm.lookup_customer", "arguments": {"id": 7}}\n</tool_call>'
CALL_PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SCRIPTS = [
    {"trigger": "Say hello", "text": "Hello there!"},
    {
        "trigger": "weather in Paris",
        "text": "<think>\nThe user wants the weather.\n</think>\n\n" + CALL_PARIS,
    },
    {"trigger": "Sunny, 21", "text": "It is sunny and 21 °C in Paris."},
    {"trigger": "turn one", "text": "First reply."},
    {"trigger": "turn two", "text": "Second reply."},
    {"trigger": "turn three", "text": "Third reply."},
    {"trigger": "Count slowly", "text": "one two three four five six seven eight nine ten"},
    {"trigger": "crm.lookup_customer", "text": CALL_CRM},
    {"trigger": "Reply with the word pong", "text": "pong"},
]
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
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


def start_scripted(folder):
    scripts = folder / "scripts.json"
    scripts.write_text(json.dumps(SCRIPTS))
    port = free_port()
    process = start_daphne(
        port=port,
        env={**server_env(), "ORCHARD_TEST_SCRIPTS": str(scripts)},
        log_path=folder / f"server-{port}.log",
        module="tests.fixtures.scripted_daphne",
    )
    return process, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def scripted_url(django_db_setup, tmp_path_factory):
    process, url = start_scripted(tmp_path_factory.mktemp("responses"))
    yield url
    stop_daphne(process)


@pytest.fixture
def registered(transactional_db):
    model_register(name=MODEL, path=build_tiny_model(model_type="qwen3", tokenizer="qwen3"))


@pytest.fixture
def raw_key(make_key, registered) -> str:
    return make_key()


@pytest.fixture
def client(scripted_url, raw_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{scripted_url}/v1", api_key=raw_key, max_retries=0)


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


def test_a_tool_round_trip_with_previous_response_id(client):
    first = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER_TOOL]
    )
    call = first.output[-1]
    second = client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        tools=[WEATHER_TOOL],
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21"}],
    )
    assert second.output_text == "It is sunny and 21 °C in Paris."
    assert second.previous_response_id == first.id
    # The whole conversation it answered: the question, the reasoning, the call, its output.
    items = client.responses.input_items.list(second.id, order="asc")
    assert [i.type for i in items.data] == [
        "message",
        "reasoning",
        "function_call",
        "function_call_output",
    ]
    assert items.data[2].call_id == call.call_id


def test_a_tool_round_trip_without_storage(client):
    """What stateless clients (Codex) do: store false, and the whole history sent again."""
    first = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER_TOOL], store=False
    )
    history = [{"role": "user", "content": "What is the weather in Paris?"}]
    history += [item.model_dump(exclude_none=True) for item in first.output]
    call = first.output[-1]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21"})
    second = client.responses.create(model=MODEL, input=history, tools=[WEATHER_TOOL], store=False)
    assert second.output_text == "It is sunny and 21 °C in Paris."
    assert not StoredResponse.objects.exists()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as caught:
        client.responses.create(model=MODEL, input="more", previous_response_id=first.id)
    assert caught.value.body["param"] == "previous_response_id"


def test_chaining_three_turns_across_a_server_restart(raw_key, tmp_path, registered):
    process, url = start_scripted(tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=raw_key, max_retries=0)
        first = client.responses.create(
            model=MODEL, input="turn one", instructions="Answer briefly."
        )
    finally:
        stop_daphne(process)
    process, url = start_scripted(tmp_path)
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=raw_key, max_retries=0)
        second = client.responses.create(
            model=MODEL, input="turn two", previous_response_id=first.id
        )
        third = client.responses.create(
            model=MODEL, input="turn three", previous_response_id=second.id
        )
        items = client.responses.input_items.list(third.id)  # newest first
    finally:
        stop_daphne(process)
    assert [r.output_text for r in (first, second, third)] == [
        "First reply.",
        "Second reply.",
        "Third reply.",
    ]
    texts = [item.content[0].text for item in items.data]
    assert texts == ["turn three", "Second reply.", "turn two", "First reply.", "turn one"]
    # Each turn's prompt held the ones before it (instructions are not carried over).
    assert third.usage.input_tokens > second.usage.input_tokens > 0
    assert third.instructions is None and first.instructions == "Answer briefly."


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


def test_team_isolation(client, scripted_url, make_key, registered):
    mine = client.responses.create(model=MODEL, input="Say hello")
    other = openai.OpenAI(
        base_url=f"{scripted_url}/v1", api_key=make_key("bob", "team-b"), max_retries=0
    )
    for attempt in (
        lambda: other.responses.retrieve(mine.id),
        lambda: other.responses.delete(mine.id),
        lambda: other.responses.input_items.list(mine.id),
        lambda: other.responses.create(model=MODEL, input="x", previous_response_id=mine.id),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            attempt()
        assert caught.value.body["type"] == "invalid_request_error"
    # A colleague on the same team sees it; deleting it makes it unknown to both.
    colleague = openai.OpenAI(
        base_url=f"{scripted_url}/v1", api_key=make_key("carol", "team-a"), max_retries=0
    )
    assert colleague.responses.retrieve(mine.id).output_text == "Hello there!"
    colleague.responses.delete(mine.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(mine.id)


def test_input_items_pages(client):
    history = [{"role": "user", "content": f"message {i}"} for i in range(5)]
    history.append({"role": "user", "content": "Say hello"})
    response = client.responses.create(model=MODEL, input=history)
    page = client.responses.input_items.list(response.id, limit=2, order="asc")
    assert [i.content[0].text for i in page.data] == ["message 0", "message 1"]
    assert page.has_more and page.first_id == page.data[0].id and page.last_id == page.data[1].id
    texts = [
        item.content[0].text
        for item in client.responses.input_items.list(response.id, limit=2, order="asc")
    ]  # the SDK pages through with `after`
    assert texts == [m["content"] for m in history]
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.input_items.list(response.id, limit=1000)
    assert caught.value.body["param"] == "limit"


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
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
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


def test_unknown_ids_are_404_in_openai_shape(client):
    for attempt in (
        lambda: client.responses.retrieve("resp_nope"),
        lambda: client.responses.delete("resp_nope"),
        lambda: client.responses.input_items.list("resp_nope"),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            attempt()
        assert "resp_nope" in caught.value.body["message"]


GPT_OSS = "tiny-gpt-oss-responses"
HARMONY_SCRIPTS = [
    {
        "trigger": "weather in Berlin",
        "text": "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant"
        "<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Berlin"}<|call|>',
    },
    {
        "trigger": "Cloudy, 12",
        "text": "<|channel|>analysis<|message|>Report it.<|end|><|start|>assistant"
        "<|channel|>final<|message|>Cloudy and 12 °C in Berlin.<|return|>",
    },
]
SCRIPTS.extend(HARMONY_SCRIPTS)


def test_harmony_reasoning_and_calls_round_trip(client):
    """gpt-oss (rendered by openai-harmony, read by the harmony parser): the analysis channel
    is a reasoning item, the commentary call a function_call; both replay into the next turn."""
    model_register(name=GPT_OSS, path=build_tiny_model(model_type="llama", tokenizer="gptoss"))
    tools = [{**WEATHER_TOOL}]
    first = client.responses.create(
        model=GPT_OSS,
        input="What is the weather in Berlin?",
        tools=tools,
        reasoning={"effort": "low"},
    )
    reasoning, call = first.output
    assert [c.text for c in reasoning.content] == ["Need the weather."]
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Berlin"})
    second = client.responses.create(
        model=GPT_OSS,
        previous_response_id=first.id,
        tools=tools,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Cloudy, 12"}],
    )
    assert [item.type for item in second.output] == ["reasoning", "message"]
    assert second.output_text == "Cloudy and 12 °C in Berlin."
    assert second.usage.input_tokens > first.usage.input_tokens


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


def test_truncation_auto_drops_the_oldest_turns(client):
    long = " ".join(["apple"] * 1500)
    history = []
    for turn in range(3):
        history += [
            {"role": "user", "content": f"{turn} {long}"},
            {"role": "assistant", "content": "ok"},
        ]
    history.append({"role": "user", "content": "Say hello"})
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=history, max_output_tokens=20)
    assert caught.value.body["code"] == "context_length_exceeded"
    response = client.responses.create(
        model=MODEL,
        input=history,
        truncation="auto",
        instructions="Be brief.",
        max_output_tokens=20,
    )
    assert response.output_text == "Hello there!" and response.truncation == "auto"
    kept = [i.content[0].text for i in client.responses.input_items.list(response.id, order="asc")]
    assert kept[-1] == "Say hello" and len(kept) < len(history)
    assert kept[0].startswith(("1 ", "2 "))  # the oldest turn went first


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
