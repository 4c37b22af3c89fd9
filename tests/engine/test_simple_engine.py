"""The serialized engine stays serialized across cancellation (docs/architecture.md)."""

import asyncio
import threading
import time
from dataclasses import replace

import pytest

from engine.core.simple import SimpleEngine
from engine.local import LocalEngineClient
from engine.models.loader import LoadedModel, load_tokenizer
from engine.protocol import (
    EngineOverloadedError,
    GenerationOutput,
    ModelInfo,
    ModelSpec,
    RequestStatus,
    ServiceClass,
)
from engine.worker import EngineWorker
from tests.engine.conftest import eventually, greedy, make_request
from tests.fixtures.tiny_models import tokenizer_dir


class CountingEngine(SimpleEngine):
    """A blocking fake generate that counts how many run at once (no model needed)."""

    active = 0
    max_active = 0
    started: list[str] = []
    lock = threading.Lock()

    def generate(self, request):
        with self.lock:
            type(self).active += 1
            type(self).max_active = max(self.max_active, self.active)
            self.started.append(request.request_id)
        try:
            for i in range(40):
                time.sleep(0.01)  # stands in for an MLX step that a cancel cannot interrupt
                request.emit(GenerationOutput(index=0, text="x", token_ids=(i,)))
                if self._poll(current=request, block=False):
                    break
            self.finish(request, RequestStatus.FINISHED_STOPPED)
        finally:
            with self.lock:
                type(self).active -= 1


@pytest.fixture
async def client():
    tokenizer, _ = load_tokenizer(tokenizer_dir("qwen3"))
    info = ModelInfo(name="fake", context_length=512, vocab_size=151669, eos_token_ids=(151645,))
    loaded = LoadedModel(
        model=None, tokenizer=tokenizer, config={}, info=info, tokenizer_source="test"
    )
    worker = EngineWorker(loader=lambda spec: loaded, engines={"simple": CountingEngine})
    client = LocalEngineClient(worker)
    await client.ensure_model(ModelSpec(name="tiny", path="unused", engine="simple", max_waiting=2))
    yield client
    await client.shutdown()


async def _waiting(client, count: int) -> bool:
    return (await client.stats())[0].num_waiting == count


async def started(request_id):
    await eventually(lambda: request_id in CountingEngine.started)


async def consume(client, request_id):
    return [o async for o in client.generate(make_request(request_id, [1, 2, 3], greedy(8)))]


async def test_concurrency_never_exceeds_one_across_cancellation(client):
    first = asyncio.create_task(consume(client, "first"))
    await started("first")
    first.cancel()
    second = asyncio.create_task(consume(client, "second"))
    third = asyncio.create_task(consume(client, "third"))
    with pytest.raises(asyncio.CancelledError):
        await first
    assert (await second)[-1].finish_reason == "stop"
    assert (await third)[-1].finish_reason == "stop"
    assert CountingEngine.max_active == 1
    assert CountingEngine.started[-3:] == ["first", "second", "third"]


async def test_full_waiting_queue_is_overloaded(client):
    running = asyncio.create_task(consume(client, "a"))
    await started("a")
    waiting = [asyncio.create_task(consume(client, rid)) for rid in ("b", "c")]
    await asyncio.sleep(0.05)
    assert (await client.stats())[0].num_waiting == 2
    with pytest.raises(EngineOverloadedError):
        await consume(client, "d")
    await asyncio.gather(running, *waiting)


async def test_the_next_request_is_the_fair_shares_turn(client):
    """A priority request queued after a flex one starts first (engine/core/fairness.py)."""

    async def consume_as(request_id, tier):
        request = replace(
            make_request(request_id, [1, 2, 3], greedy(8)),
            service=ServiceClass(tenant=request_id, tier=tier),
        )
        return [o async for o in client.generate(request)]

    running = asyncio.create_task(consume_as("a", "default"))
    await started("a")
    flex = asyncio.create_task(consume_as("b", "flex"))
    await eventually(lambda: _waiting(client, 1))
    urgent = asyncio.create_task(consume_as("c", "priority"))
    await asyncio.gather(running, flex, urgent)
    assert CountingEngine.started[-3:] == ["a", "c", "b"]
