"""Execution's accounting holds on the awkward paths: a client that leaves while its usage row
is being written still gets exactly one finished row and its limiter slot back; an engine
failure is recorded as failed; several prompts left early close cleanly, each aborted once."""

import asyncio
import time

import pytest
from asgiref.sync import sync_to_async

from accounts import limits
from accounts.services import api_key_create, team_membership_ensure, user_get_or_create
from engine.protocol import GenerationOutput, GenerationRequest, SamplingParams
from inference.api.common import ending_stream
from inference.api.openai_format import SSE_DONE, aggregate, chat_chunks
from inference.errors import APIError
from inference.models import ModelEntry, UsageRecord
from inference.services import execution as execution_module
from inference.services import settlement as settlement_module
from inference.services.admission import request_intake
from inference.services.execution import Execution
from inference.services.generation import Generation
from tests.engine.conftest import eventually


def make_key():
    user = user_get_or_create(username="exec")
    team, _ = team_membership_ensure(user=user, team_name="exec-team")
    api_key, _ = api_key_create(user=user, team=team, max_parallel=1)
    return api_key


async def admitted(api_key, request_id, requests) -> Execution:
    """An execution of `requests` admitted for `api_key`, as the generation service makes it."""
    async with request_intake(
        api_key=api_key, request_id=request_id, endpoint="chat.completions"
    ) as intake:
        settlement = await intake.reserve(
            model="m",
            reserved_tokens=sum(len(r.prompt_token_ids) + r.sampling.max_tokens for r in requests),
        )
    return Execution(settlement, requests)


@pytest.mark.django_db(transaction=True)
async def test_cancel_while_the_usage_row_is_written(monkeypatch):
    api_key = await sync_to_async(make_key)()
    real_open = settlement_module.usage_open

    def slow_open(**kwargs):
        time.sleep(0.3)
        return real_open(**kwargs)

    monkeypatch.setattr(settlement_module, "usage_open", slow_open)
    request = GenerationRequest("req_slow", "m", (1, 2, 3), SamplingParams(max_tokens=4))
    execution = await admitted(api_key, "req_slow", [request])
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
    """Streams fixed outputs (the same for every request); records which streams were closed
    before their end (what aborts a request in the real client)."""

    def __init__(self, outputs, *, hold: asyncio.Event | None = None):
        self.outputs = outputs
        self.hold = hold
        self.closed_early = []

    async def generate(self, request):
        finished = False
        try:
            for output in self.outputs:
                yield output
                if self.hold is not None:
                    await self.hold.wait()
            finished = True
        finally:
            if not finished:
                self.closed_early.append(request.request_id)


def engine_failing_with(reason):
    return FakeEngine(
        [
            GenerationOutput(index=0, text="Hel", token_ids=(1,), num_prompt_tokens=3),
            GenerationOutput(
                index=0, text="", token_ids=(), finish_reason=reason, num_prompt_tokens=3
            ),
        ]
    )


def engine_finishing():
    return FakeEngine(
        [
            GenerationOutput(index=0, text="Hel", token_ids=(1,), num_prompt_tokens=3),
            GenerationOutput(
                index=0, text="lo", token_ids=(2,), finish_reason="length", num_prompt_tokens=3
            ),
        ]
    )


async def start_generation(monkeypatch, engine, request_id, *, num_prompts=1):
    monkeypatch.setattr(execution_module, "get_engine_client", lambda: engine)
    api_key = await sync_to_async(make_key)()
    requests = [
        GenerationRequest(f"{request_id}-{i}", "m", (1, 2, 3), SamplingParams(max_tokens=4))
        for i in range(num_prompts)
    ]
    execution = await admitted(api_key, request_id, requests)
    await execution.start()
    return Generation(execution, ModelEntry(name="m"))


async def streamed(generation) -> list[bytes]:
    chunks = chat_chunks(generation, completion_id="c", created=0, include_usage=True)
    async with asyncio.timeout(10):  # a stream that never ends fails the test
        return [c async for c in ending_stream(chunks)]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(
    ("reason", "code"), [("error", "engine_error"), ("abort", "engine_aborted")]
)
async def test_engine_failure_mid_stream_is_recorded_as_failed(monkeypatch, reason, code):
    generation = await start_generation(monkeypatch, engine_failing_with(reason), f"req_s{reason}")
    chunks = await streamed(generation)
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
    generation = await start_generation(monkeypatch, engine_failing_with(reason), f"req_n{reason}")
    with pytest.raises(APIError) as caught:
        await aggregate(generation)
    assert caught.value.status == 500
    row = await sync_to_async(UsageRecord.objects.get)(request_id=f"req_n{reason}")
    assert (row.status, row.error_code) == ("failed", code)


@pytest.mark.django_db(transaction=True)
async def test_an_error_part_way_through_a_stream_still_ends_it(monkeypatch):
    generation = await start_generation(monkeypatch, engine_finishing(), "req_broken")

    def broken(*args, **kwargs):
        raise RuntimeError("a formatting bug")

    monkeypatch.setattr("inference.api.openai_format._chat_chunk", broken)
    chunks = await streamed(generation)
    assert len(chunks) == 1 and b'"error"' in chunks[0] and b"server_error" in chunks[0]
    row = await sync_to_async(UsageRecord.objects.get)(request_id="req_broken")
    assert (row.status, row.error_code) == ("failed", "server_error")


@pytest.mark.django_db(transaction=True)
async def test_several_prompts_left_early_close_cleanly_and_abort_once(monkeypatch, caplog):
    hold = asyncio.Event()  # every stream stalls after its first output
    engine = FakeEngine(
        [GenerationOutput(index=0, text=t, token_ids=(1,), num_prompt_tokens=3) for t in "abc"],
        hold=hold,
    )
    generation = await start_generation(monkeypatch, engine, "req_multi", num_prompts=3)
    async with generation.deltas() as deltas:
        await anext(deltas)  # then the client leaves
    assert sorted(engine.closed_early) == ["req_multi-0", "req_multi-1", "req_multi-2"]
    errors = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert not errors, [r.getMessage() for r in errors]
    row = await sync_to_async(UsageRecord.objects.get)(request_id="req_multi")
    assert row.status == "cancelled"


@pytest.mark.django_db(transaction=True)
async def test_a_request_task_cancelled_outside_its_stream_closes_every_stream_once(
    monkeypatch, caplog
):
    """The client leaves while the server is sending a chunk: the task ends with the outputs
    suspended mid-stream, their readers still inside the engine streams."""
    hold = asyncio.Event()
    engine = FakeEngine(
        [GenerationOutput(index=0, text=t, token_ids=(1,), num_prompt_tokens=3) for t in "abc"],
        hold=hold,
    )
    sending = asyncio.Event()
    kept = []

    async def request_task():
        generation = await start_generation(monkeypatch, engine, "req_send", num_prompts=3)
        deltas = generation.execution.outputs()
        kept.append(deltas)  # like Django's response iterator: not closed when cancelled
        await anext(deltas)
        sending.set()
        await asyncio.sleep(30)  # `await send(chunk)`, where the cancellation lands

    task = asyncio.create_task(request_task())
    await sending.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: len(engine.closed_early) == 3)
    assert sorted(engine.closed_early) == ["req_send-0", "req_send-1", "req_send-2"]

    async def row_cancelled() -> bool:
        row = await sync_to_async(UsageRecord.objects.get)(request_id="req_send")
        return row.status == "cancelled"

    await eventually(row_cancelled)
    errors = [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    assert not errors, [r.getMessage() for r in errors]
    await kept[0].aclose()
