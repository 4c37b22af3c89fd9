"""Requests running now, across processes: the live server (another process) writes a running
request's tokens so far to its usage row, and a cancel asked for here, in the test process, by
the service the admin's running-now page calls, stops it there: its stream ends with an error
that says so, its engine slot is freed, its row is cancelled with the tokens its client got."""

import json
import time

import httpx
import openai

from inference.models import UsageRecord
from inference.services.output import FAILURE_CODES, FAILURE_MESSAGES
from inference.services.running import running_request_cancel
from tests.factories import StaffUserFactory
from tests.inference.api.test_chat import finished_row
from tests.inference.conftest import TINY

LONG = {"max_tokens": 3000, "ignore_eos": True, "temperature": 0}


def content_of(event: str) -> str:
    choices = json.loads(event).get("choices") or [{}]
    return choices[0].get("delta", {}).get("content") or ""


def row_with_tokens(request_id: str, timeout: float = 10.0) -> UsageRecord:
    """The request's row once the server has written some tokens so far to it (every second)."""
    deadline = time.monotonic() + timeout
    while True:
        row = UsageRecord.objects.filter(request_id=request_id).first()
        if row is not None and row.completion_tokens > 0:
            return row
        assert time.monotonic() < deadline, f"no tokens so far on {row}"
        time.sleep(0.05)


def test_a_cancel_from_another_process_ends_the_stream_and_bills_what_was_sent(
    live_server_url, api_key
):
    body = {"model": TINY, "messages": [{"role": "user", "content": "Go"}], "stream": True, **LONG}
    headers = {"Authorization": f"Bearer {api_key}"}
    received, events = 0, []
    with httpx.stream(
        "POST", f"{live_server_url}/v1/chat/completions", json=body, headers=headers, timeout=60
    ) as response:
        request_id = response.headers["x-request-id"]
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: {") and content_of(line[6:]):
                received += 1
            if received >= 5:
                break
        row = row_with_tokens(request_id)
        assert row.status == UsageRecord.Status.IN_PROGRESS and row.prompt_tokens > 0
        assert running_request_cancel(user=StaffUserFactory(), record_id=row.pk)
        for line in lines:  # the stream ends on its own
            if line.startswith("data: "):
                events.append(line[6:])
    error = json.loads(events[-1])["error"]
    assert error["message"] == FAILURE_MESSAGES["cancelled"]
    received += sum(1 for event in events[:-1] if content_of(event))
    row = finished_row(request_id)
    assert row.status == UsageRecord.Status.CANCELLED
    assert row.error_code == FAILURE_CODES["cancelled"]
    assert received <= row.completion_tokens < LONG["max_tokens"]
    # A finished request is no longer cancellable, and the engine serves the next one.
    assert not running_request_cancel(user=StaffUserFactory(), record_id=row.pk)
    quick = openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=api_key, max_retries=0)
    reply = quick.chat.completions.create(
        model=TINY, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert reply.choices[0].finish_reason == "length"
