"""A batch's input lines, checked as their endpoint checks a request (inference/batches/lines.py),
and the usage row of a line's lost run discarded with its roll-up (services/usage.py)."""

import json

import pytest
from django.utils import timezone

from inference.batches.lines import LinesReader
from inference.models import DailyUsage, ModelEntry, UsageRecord
from inference.services.usage import usage_discard, usage_finish, usage_open
from tests.factories import ApiKeyFactory, ModelEntryFactory

pytestmark = pytest.mark.django_db


def _line(custom_id, body, url="/v1/chat/completions"):
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}).encode()


def _chat(model="chat-a", **fields):
    return {"model": model, "messages": [{"role": "user", "content": "Hi"}], **fields}


def _read(api_key, lines, *, endpoint="/v1/chat/completions", max_lines=100):
    reader = LinesReader(api_key=api_key, endpoint=endpoint, max_lines=max_lines)
    return list(reader.read(lines)), reader


def test_lines_the_endpoint_refuses_are_answered_and_the_rest_run():
    ModelEntryFactory(name="chat-a")
    ModelEntryFactory(name="embed", kind=ModelEntry.Kind.EMBEDDING)
    ModelEntryFactory(name="chat-b")
    api_key = ApiKeyFactory(models=["chat-a", "embed"])
    parsed, reader = _read(
        api_key,
        [
            _line("ok", _chat()),
            b"\n",
            _line("streamed", _chat(stream=True)),
            _line("not-allowed", _chat(model="chat-b")),
            _line("wrong-kind", _chat(model="embed")),
            _line("bad-field", _chat(temperature="hot")),
        ],
    )
    assert not reader.errors and reader.models == {"chat-a"} and reader.num_lines == 5
    assert [line.index for line in parsed] == [0, 1, 2, 3, 4]
    refusals = {line.custom_id: line.refusal for line in parsed}
    assert refusals["ok"] is None
    assert refusals["streamed"].status == 400 and refusals["streamed"].param == "stream"
    assert refusals["not-allowed"].status == 404  # as a key sees a model it may not use
    assert (
        refusals["wrong-kind"].status == 400 and "embedding model" in refusals["wrong-kind"].message
    )
    assert refusals["bad-field"].status == 400 and refusals["bad-field"].param == "temperature"


def test_file_faults():
    ModelEntryFactory(name="chat-a")
    ModelEntryFactory(name="chat-b")
    api_key = ApiKeyFactory()
    _, reader = _read(api_key, [_line(f"l{i}", _chat()) for i in range(4)], max_lines=3)
    assert [(e.code, e.line) for e in reader.errors] == [("too_many_requests", 4)]
    _, reader = _read(api_key, [b"", b"  \n"])
    assert [e.code for e in reader.errors] == ["empty_file"]
    _, reader = _read(api_key, [_line("a", _chat()), _line("b", _chat(model="chat-b"))])
    assert [e.code for e in reader.errors] == ["mismatched_model"]
    _, reader = _read(api_key, [b"[1, 2]", _line("x" * 513, _chat()), _line("b", "text")])
    assert [e.code for e in reader.errors] == [
        "invalid_json_line",
        "invalid_custom_id",
        "invalid_body",
    ]


def test_discarding_a_lost_run_takes_its_roll_up_with_it():
    api_key = ApiKeyFactory()
    for request_id, finish in (("lost-open", False), ("lost-finished", True)):
        row = usage_open(
            request_id=request_id, api_key=api_key, model="m", endpoint="e", batch_id="batch_1"
        )
        if finish:
            usage_finish(
                record_id=row.pk,
                status="completed",
                prompt_tokens=5,
                completion_tokens=7,
                finished_at=timezone.now(),
            )
    daily = DailyUsage.objects.get(batch=True)
    assert (daily.num_requests, daily.completion_tokens) == (1, 7)
    assert usage_discard(request_id="lost-open") and usage_discard(request_id="lost-finished")
    assert not usage_discard(request_id="lost-finished")
    assert not UsageRecord.objects.exists()
    daily.refresh_from_db()
    assert (daily.num_requests, daily.prompt_tokens, daily.completion_tokens) == (0, 0, 0)
