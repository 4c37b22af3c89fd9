"""Cancelling a stream mid-generation frees its slot between steps; other streams are untouched."""

import asyncio

import pytest

from engine.local import LocalEngineClient
from engine.protocol import ModelSpec
from engine.worker import EngineWorker
from tests.engine.conftest import eventually, greedy, make_request

NUM_TOKENS = 120


@pytest.fixture
async def client(tiny_llama):
    client = LocalEngineClient(EngineWorker(loader=lambda spec: tiny_llama))
    # Two slots: the third request waits and can only run once a slot is freed.
    await client.ensure_model(ModelSpec(name="tiny", path="unused", max_num_seqs=2))
    yield client
    await client.shutdown()


async def collect(client, request, stop_after=None) -> tuple[list[int], str | None]:
    tokens, finish_reason = [], None
    async for output in client.generate(request):
        tokens += output.token_ids
        finish_reason = output.finish_reason
        if stop_after is not None and len(tokens) >= stop_after:
            await asyncio.sleep(3600)  # stays here until cancelled
    return tokens, finish_reason


async def idle_stats(client):
    """Stats once the engine has published the end of its last step (it does so after emitting)."""
    engine = client.worker.get("tiny")
    await eventually(lambda: engine.stats().num_running == engine.stats().num_waiting == 0)
    return engine.stats()


async def test_cancel_frees_the_slot_and_leaves_other_streams_unchanged(client):
    keep = make_request("keep", [1000, 2000, 3000, 4000], greedy(NUM_TOKENS, ignore_eos=True))
    victim = make_request("victim", [5000, 6000, 7000], greedy(4000, ignore_eos=True))
    queued = make_request("queued", [8000, 9000], greedy(8, ignore_eos=True))
    expected = {r.request_id: await collect(client, r) for r in (keep, queued)}
    baseline_tokens = (await client.stats())[0].num_generated_tokens

    keep_task = asyncio.create_task(collect(client, keep))
    victim_task = asyncio.create_task(collect(client, victim, stop_after=3))
    await eventually(lambda: client.worker.get("tiny").stats().num_running == 2)
    queued_task = asyncio.create_task(collect(client, queued))
    # Both slots taken: queued waits.
    await eventually(lambda: client.worker.get("tiny").stats().num_waiting == 1)
    victim_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await victim_task

    assert await asyncio.wait_for(queued_task, 30) == expected["queued"]
    assert not keep_task.done(), "queued ran in the victim's slot, while keep still ran"
    assert await asyncio.wait_for(keep_task, 30) == expected["keep"]
    assert expected["keep"][1] == "length" and len(expected["keep"][0]) == NUM_TOKENS

    engine = client.worker.get("tiny")
    stats = await idle_stats(client)
    assert (stats.num_waiting, stats.num_running) == (0, 0)
    assert stats.num_generated_tokens - baseline_tokens < 2 * NUM_TOKENS + 8 + 100  # victim stopped
    await asyncio.to_thread(engine.stop)  # join the engine thread before looking at its state
    assert not engine.scheduler.has_work()
    assert engine.runner.num_rows == 0 and not engine.runner._prefill_caches


async def test_closing_the_iterator_aborts_the_request(client):
    stream = client.generate(make_request("early", [11, 12, 13], greedy(200, ignore_eos=True)))
    first = await anext(stream)
    assert first.token_ids
    await stream.aclose()
    stats = await idle_stats(client)
    assert stats.num_running == 0 and stats.num_generated_tokens < 200


async def test_shutdown_ends_streams_with_abort(client):
    stream = client.generate(make_request("long", [21, 22], greedy(500, ignore_eos=True)))
    await anext(stream)
    await client.shutdown()
    outputs = [output async for output in stream]
    assert outputs[-1].finish_reason == "abort"
