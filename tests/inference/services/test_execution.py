"""Execution's accounting holds on the awkward paths: a client that leaves while its usage row
is being written still gets exactly one finished row and its limiter slot back."""

import asyncio
import time

import pytest
from asgiref.sync import sync_to_async

from accounts import limits
from accounts.services import api_key_create, team_membership_ensure, user_get_or_create
from engine.protocol import GenerationOutput, GenerationRequest, SamplingParams
from inference.api.openai_format import SSE_DONE, aggregate, chat_chunks, chat_completion_body
from inference.errors import APIError
from inference.models import UsageRecord
from inference.services import execution as execution_module
from inference.services.execution import Execution


def make_key():
    user = user_get_or_create(username="exec")
    team, _ = team_membership_ensure(user=user, team_name="exec-team")
    api_key, _ = api_key_create(user=user, team=team, max_parallel=1)
    return api_key


@pytest.mark.django_db(transaction=True)
async def test_cancel_while_the_usage_row_is_written(monkeypatch):
    api_key = await sync_to_async(make_key)()
    real_open = execution_module.usage_open

    def slow_open(**kwargs):
        time.sleep(0.3)
        return real_open(**kwargs)

    monkeypatch.setattr(execution_module, "usage_open", slow_open)
    request = GenerationRequest("req_slow", "m", (1, 2, 3), SamplingParams(max_tokens=4))
    execution = Execution(
        api_key=api_key,
        model="m",
        endpoint="chat.completions",
        request_id="req_slow",
        requests=[request],
    )
    task = asyncio.create_task(execution.start())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    row = await sync_to_async(UsageRecord.objects.get)(request_id="req_slow")
    assert row.status == UsageRecord.Status.CANCELLED
    assert row.finished_at is not None
    # max_parallel=1: the slot came back, so a new request is admitted.
    admission = await limits.admit(api_key, reserved_tokens=1)
    await admission.release(used_tokens=0)


class FakeEngine:
    """Streams fixed outputs; records aborts."""

    def __init__(self, outputs):
        self.outputs = outputs
        self.aborted = []

    async def generate(self, request):
        for output in self.outputs:
            yield output

    async def abort(self, request_id):
        self.aborted.append(request_id)


def engine_failing_with(reason):
    return FakeEngine(
        [
            GenerationOutput(index=0, text="Hel", token_ids=(1,), num_prompt_tokens=3),
            GenerationOutput(
                index=0, text="", token_ids=(), finish_reason=reason, num_prompt_tokens=3
            ),
        ]
    )


async def start_execution(monkeypatch, engine, request_id):
    monkeypatch.setattr(execution_module, "get_engine_client", lambda: engine)
    api_key = await sync_to_async(make_key)()
    request = GenerationRequest(request_id, "m", (1, 2, 3), SamplingParams(max_tokens=4))
    execution = Execution(
        api_key=api_key,
        model="m",
        endpoint="chat.completions",
        request_id=request_id,
        requests=[request],
    )
    await execution.start()
    return execution


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("reason", "code"), [("error", "engine_error"), ("abort", "engine_aborted")]
)
async def test_engine_failure_mid_stream_is_recorded_as_failed(monkeypatch, reason, code):
    execution = await start_execution(monkeypatch, engine_failing_with(reason), f"req_s{reason}")
    chunks = [
        c
        async for c in chat_chunks(
            execution, completion_id="c", created=0, model="m", include_usage=True
        )
    ]
    assert b'"error"' in chunks[-1]
    assert SSE_DONE not in chunks
    row = await sync_to_async(UsageRecord.objects.get)(request_id=f"req_s{reason}")
    assert (row.status, row.error_code, row.completion_tokens) == ("failed", code, 1)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("reason", "code"), [("error", "engine_error"), ("abort", "engine_aborted")]
)
async def test_engine_failure_non_streamed_is_a_500_and_recorded_as_failed(
    monkeypatch, reason, code
):
    execution = await start_execution(monkeypatch, engine_failing_with(reason), f"req_n{reason}")
    choices = await aggregate(execution, 1)
    with pytest.raises(APIError) as caught:
        chat_completion_body(
            execution, choices, completion_id="c", created=0, model="m", want_logprobs=False
        )
    assert caught.value.status == 500
    row = await sync_to_async(UsageRecord.objects.get)(request_id=f"req_n{reason}")
    assert (row.status, row.error_code) == ("failed", code)
