"""/v1/responses across turns with the official `openai` client over real HTTP: continuing a
stored response (`previous_response_id`, also across a server restart), storing or not, input
items, truncation "auto", and every lookup scoped to the key's team."""

import json

import openai
import pytest

from inference.models import StoredResponse
from inference.services.registry import model_register
from tests.fixtures.daphne import stop_daphne
from tests.fixtures.tiny_models import build_tiny_model
from tests.inference.api.responses.scripted import GPT_OSS, MODEL, WEATHER_TOOL, start_scripted


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


def test_chaining_three_turns_across_a_server_restart(client, raw_key, tmp_path):
    # The first turn is served by a server that then stops; the shared scripted server, another
    # process that never saw it, continues the conversation from the database alone.
    process, url = start_scripted(tmp_path)
    try:
        gone = openai.OpenAI(base_url=f"{url}/v1", api_key=raw_key, max_retries=0)
        first = gone.responses.create(model=MODEL, input="turn one", instructions="Answer briefly.")
    finally:
        stop_daphne(process)
    second = client.responses.create(model=MODEL, input="turn two", previous_response_id=first.id)
    third = client.responses.create(model=MODEL, input="turn three", previous_response_id=second.id)
    items = client.responses.input_items.list(third.id)  # newest first
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


def test_unknown_ids_are_404_in_openai_shape(client):
    for attempt in (
        lambda: client.responses.retrieve("resp_nope"),
        lambda: client.responses.delete("resp_nope"),
        lambda: client.responses.input_items.list("resp_nope"),
    ):
        with pytest.raises(openai.NotFoundError) as caught:
            attempt()
        assert "resp_nope" in caught.value.body["message"]
