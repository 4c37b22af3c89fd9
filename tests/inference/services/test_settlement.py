"""A request's settlement (inference/services/settlement.py), for generations and embeddings
alike: a usage row the database refuses does not hang the response and is not lost, a slow one
does not hold the response's end, and an embedding request that ends early frees its
reservation with exactly one finished row."""

import asyncio
import time

import numpy as np
import pytest
from asgiref.sync import sync_to_async
from django.db import OperationalError

from accounts import limits
from engine import EmbeddingInfo
from inference.api.openai_format import SSE_DONE
from inference.models import ModelEntry, UsageRecord
from inference.services import embeddings as embeddings_module
from inference.services import settlement as settlement_module
from inference.services.admission import request_intake
from inference.services.embeddings import embeddings_create
from tests.engine.conftest import eventually
from tests.inference.services.test_execution import (
    engine_finishing,
    make_key,
    start_generation,
    streamed,
)


@pytest.mark.django_db(transaction=True)
async def test_a_usage_row_the_database_refuses_neither_hangs_the_stream_nor_is_lost(
    monkeypatch,
):
    real_finish = settlement_module.usage_finish
    attempts = []

    def locked_twice(**kwargs):
        attempts.append(kwargs["status"])
        if len(attempts) <= 2:
            raise OperationalError("database is locked")
        return real_finish(**kwargs)

    monkeypatch.setattr(settlement_module, "usage_finish", locked_twice)
    monkeypatch.setattr(settlement_module, "USAGE_RETRY_DELAYS_S", (0.05, 0.05, 0.05))
    generation = await start_generation(monkeypatch, engine_finishing(), "req_locked")
    chunks = await streamed(generation)
    assert chunks[-1] == SSE_DONE  # the client got its whole response, and its end
    await eventually(lambda: len(attempts) >= 3)

    async def finished() -> bool:  # the third attempt has begun; wait for its commit
        row = await sync_to_async(UsageRecord.objects.get)(request_id="req_locked")
        return row.status != UsageRecord.Status.IN_PROGRESS

    await eventually(finished)
    row = await sync_to_async(UsageRecord.objects.get)(request_id="req_locked")
    assert (row.status, row.completion_tokens) == ("completed", 2)
    assert len(attempts) == 3
    # The limiter slot came back at once (max_parallel=1): the next request is admitted.
    admission = await limits.admit(generation.execution.settlement.api_key, reserved_tokens=1)
    await admission.release(used_tokens=0)


@pytest.mark.django_db(transaction=True)
async def test_a_slow_usage_write_does_not_hold_the_end_of_the_stream(monkeypatch):
    real_finish = settlement_module.usage_finish
    calls = []

    def busy_database(**kwargs):  # a write waiting on SQLite's busy timeout, then landing
        calls.append(kwargs["finished_at"])
        time.sleep(1.5)
        return real_finish(**kwargs)

    monkeypatch.setattr(settlement_module, "usage_finish", busy_database)
    monkeypatch.setattr(settlement_module, "USAGE_WRITE_WAIT_S", 0.1)
    generation = await start_generation(monkeypatch, engine_finishing(), "req_busy")
    started = time.monotonic()
    chunks = await streamed(generation)
    assert chunks[-1] == SSE_DONE and time.monotonic() - started < 1.0
    await eventually(lambda: len(calls) == 1)
    row = await sync_to_async(UsageRecord.objects.get)(request_id="req_busy")
    for _ in range(100):
        if row.status == "completed":
            break
        await asyncio.sleep(0.05)
        row = await sync_to_async(UsageRecord.objects.get)(request_id="req_busy")
    assert (row.status, row.completion_tokens) == ("completed", 2)
    assert row.finished_at == calls[0]  # the time the request ended, not the write's
    assert len(calls) == 1  # waited for, not written twice


class FakeEmbedder:
    """The three calls the embeddings service makes of the engine; `embed` waits on `hold`."""

    def __init__(self, hold: asyncio.Event | None = None):
        self.hold = hold

    async def embedding_model(self, spec):
        return EmbeddingInfo(spec.name, 4, 16, 100, normalize=True, pooling="mean")

    async def tokenize(self, model, texts, *, timeout_s=None):
        return [[1, 2, 3] for _ in texts]

    async def embed(self, model, token_ids, progress=None):
        if self.hold is not None:
            await self.hold.wait()
        return np.ones((len(token_ids), 4), np.float32)


async def embed(api_key, request_id, inputs):
    async with request_intake(api_key=api_key, request_id=request_id, endpoint="embeddings") as i:
        return await embeddings_create(intake=i, model="emb", inputs=inputs)


async def embedding_key(monkeypatch, engine):
    monkeypatch.setattr(embeddings_module, "get_engine_client", lambda: engine)
    await sync_to_async(ModelEntry.objects.create)(
        name="emb", path="/models/emb", kind=ModelEntry.Kind.EMBEDDING
    )
    return await sync_to_async(make_key)()


@pytest.mark.django_db(transaction=True)
async def test_an_embeddings_usage_row_the_database_refuses_is_retried(monkeypatch):
    real_finish = settlement_module.usage_finish
    attempts = []

    def locked_once(**kwargs):
        attempts.append(kwargs["status"])
        if len(attempts) == 1:
            raise OperationalError("database is locked")
        return real_finish(**kwargs)

    monkeypatch.setattr(settlement_module, "usage_finish", locked_once)
    monkeypatch.setattr(settlement_module, "USAGE_RETRY_DELAYS_S", (0.05,))
    api_key = await embedding_key(monkeypatch, FakeEmbedder())
    result = await embed(api_key, "req_emb", ["a", "b"])
    assert result.vectors.shape == (2, 4) and result.num_tokens == 6

    async def finished() -> bool:
        row = await sync_to_async(UsageRecord.objects.get)(request_id="req_emb")
        return row.status != UsageRecord.Status.IN_PROGRESS

    await eventually(finished)
    row = await sync_to_async(UsageRecord.objects.get)(request_id="req_emb")
    assert (row.status, row.prompt_tokens, row.reserved_tokens) == ("completed", 6, 6)
    assert attempts == ["completed", "completed"]


@pytest.mark.django_db(transaction=True)
async def test_an_embedding_request_cancelled_frees_its_reservation(monkeypatch):
    hold = asyncio.Event()  # the model never answers: the client leaves first
    api_key = await embedding_key(monkeypatch, FakeEmbedder(hold))
    task = asyncio.create_task(embed(api_key, "req_gone", ["a"]))

    async def row_open() -> bool:
        return await sync_to_async(UsageRecord.objects.filter(request_id="req_gone").exists)()

    await eventually(row_open)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    row = await sync_to_async(UsageRecord.objects.get)(request_id="req_gone")
    assert (row.status, row.prompt_tokens) == ("cancelled", 0)
    assert row.error_code == "client_disconnected"
    # max_parallel=1: the slot came back, so a new request is admitted.
    admission = await limits.admit(api_key, reserved_tokens=1)
    await admission.release(used_tokens=0)
