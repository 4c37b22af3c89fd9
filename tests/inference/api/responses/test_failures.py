"""A response whose generation fails part-way ends with `response.failed` (the error in it),
is stored as failed and its usage row too; an unexpected error while streaming is one `error`
event, and the stream still ends."""

import asyncio

import pytest
from asgiref.sync import sync_to_async

from inference.api.responses import views
from inference.api.responses.events import ResponseBuilder
from inference.models import StoredResponse, UsageRecord
from inference.services.responses import ResponseRun
from inference.services.stored_responses import Conversation
from tests.inference.services.test_execution import engine_failing_with, start_generation

BODY = {"text": {"format": {"type": "text"}}}


async def run_for(monkeypatch, request_id, *, store=True):
    generation = await start_generation(monkeypatch, engine_failing_with("error"), request_id)
    builder = ResponseBuilder(
        views._response_object(f"resp_{request_id}", BODY, generation, store), {}
    )
    conversation = Conversation([{"id": "msg_1", "type": "message", "role": "user", "content": []}])
    run = ResponseRun(generation.execution.settlement.api_key, generation, conversation, store)
    return views._Run(run, builder)


async def events_of(stream):
    async with asyncio.timeout(10):
        return [event async for event in stream]


@pytest.mark.django_db(transaction=True)
async def test_a_failed_generation_ends_with_response_failed_and_is_stored_failed(monkeypatch):
    run = await run_for(monkeypatch, "req_fail")
    events = await events_of(run.events())
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.failed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "server_error"
    assert failed["output_text"] == "Hel"  # what was generated before the failure
    stored = await sync_to_async(StoredResponse.objects.get)(id="resp_req_fail")
    assert stored.status == "failed"
    row = await sync_to_async(UsageRecord.objects.get)(request_id="req_fail")
    assert (row.status, row.error_code) == ("failed", "engine_error")


@pytest.mark.django_db(transaction=True)
async def test_an_unexpected_error_while_streaming_is_an_error_event(monkeypatch):
    run = await run_for(monkeypatch, "req_broken", store=False)

    def broken(delta):
        raise RuntimeError("formatting broke")

    monkeypatch.setattr(run.builder, "feed", broken)
    chunks = await events_of(views._stream(run))
    assert chunks[-1].startswith(b"event: error\ndata: ")
    assert b'"code":"server_error"' in chunks[-1]
    row = await sync_to_async(UsageRecord.objects.get)(request_id="req_broken")
    assert row.status == "failed"
