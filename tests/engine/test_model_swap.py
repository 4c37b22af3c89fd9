"""A changed spec loads beside the old engine without blocking the event loop; the old engine
serves until the new one is ready, then finishes its in-flight requests and stops."""

import asyncio
import threading
import time

import pytest

import engine.worker
from engine.local import LocalEngineClient
from engine.protocol import ModelLoadError, ModelNotLoadedError, ModelSpec, PromptInput
from engine.worker import EngineWorker
from tests.engine.conftest import eventually, greedy, make_request

OLD = ModelSpec(name="tiny", path="unused", max_waiting=8)
NEW = ModelSpec(name="tiny", path="unused", max_waiting=9)
STEP_DELAY_S = 0.4


@pytest.fixture
async def client(tiny_llama):
    client = LocalEngineClient(EngineWorker(loader=lambda spec: tiny_llama))
    await client.ensure_model(OLD)
    yield client
    await client.shutdown()


async def collect(stream) -> list:
    async with asyncio.timeout(30):
        return [output async for output in stream]


async def test_spec_change_neither_blocks_the_loop_nor_cuts_a_stream(client, monkeypatch):
    old = client.worker.get("tiny")
    real_execute = old.runner.execute

    def slow_execute(plan, **kwargs):
        time.sleep(STEP_DELAY_S)  # a slow device step: stopping this engine would wait for it
        return real_execute(plan, **kwargs)

    monkeypatch.setattr(old.runner, "execute", slow_execute)
    stream = client.generate(make_request("long", [1, 2, 3], greedy(6, ignore_eos=True)))
    first = await anext(stream)  # the next step starts now and takes STEP_DELAY_S
    rest = asyncio.create_task(collect(stream))

    longest_gap, running = 0.0, True

    async def tick() -> None:
        nonlocal longest_gap
        last = time.perf_counter()
        while running:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            longest_gap, last = max(longest_gap, now - last), now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0.02)  # the ticker is running before the swap starts
    await client.ensure_model(NEW)
    outputs = [first, *await rest]
    running = False
    await ticker

    assert longest_gap < STEP_DELAY_S / 2
    assert outputs[-1].finish_reason == "length"
    assert sum(len(o.token_ids) for o in outputs) == 6
    assert client.worker.get("tiny").spec == NEW
    await eventually(lambda: not old.is_alive())
    outputs = await collect(client.generate(make_request("new", [4, 5], greedy(2))))
    assert outputs[-1].finish_reason == "length"


async def test_the_old_engine_serves_until_the_new_one_is_ready(tiny_llama):
    loading = threading.Event()
    release = threading.Event()

    def loader(spec):
        if spec == NEW:
            loading.set()
            release.wait(30)
        return tiny_llama

    client = LocalEngineClient(EngineWorker(loader=loader))
    await client.ensure_model(OLD)
    old = client.worker.get("tiny")
    swap = asyncio.create_task(client.ensure_model(NEW))
    await asyncio.to_thread(loading.wait, 30)

    assert client.worker.get("tiny") is old
    assert (await client.render_prompt("tiny", PromptInput(token_ids=(7, 8)))).token_ids == (7, 8)
    outputs = await collect(client.generate(make_request("during", [1, 2], greedy(2))))
    assert outputs[-1].finish_reason == "length"

    release.set()
    await swap
    new = client.worker.get("tiny")
    assert new is not old and new.spec == NEW
    with pytest.raises(ModelNotLoadedError):  # retired: the worker sends requests to `new`
        old.submit(make_request("late", [1, 2], greedy(2)), lambda output: None)
    await client.shutdown()


async def test_cancelling_a_stream_on_a_draining_engine_aborts_it(client):
    old = client.worker.get("tiny")
    stream = client.generate(make_request("long", [1, 2, 3], greedy(4000, ignore_eos=True)))
    await anext(stream)
    await client.ensure_model(NEW)
    assert old.is_alive()  # still draining "long"
    await stream.aclose()
    await eventually(lambda: not old.is_alive())


async def test_abort_and_close_need_no_stats(client, monkeypatch):
    def no_stats():
        raise AssertionError("abort builds no stats snapshots")

    monkeypatch.setattr(client.worker, "stats", no_stats)
    task = asyncio.create_task(
        collect(client.generate(make_request("long", [1, 2], greedy(4000, ignore_eos=True))))
    )
    await eventually(lambda: client.worker.get("tiny").stats().num_running == 1)
    await client.abort("long")
    outputs = await task
    assert outputs[-1].finish_reason == "abort"

    engine = client.worker.get("tiny")
    client.close(timeout=5)  # what an atexit hook calls: no event loop needed
    assert not engine.is_alive()


BROKEN = ModelSpec(name="tiny", path="/no/such/model")


def broken_or(tiny_llama, calls):
    def loader(spec):
        calls.append(spec)
        if spec == BROKEN:
            raise FileNotFoundError("no config.json in /no/such/model")
        return tiny_llama

    return loader


async def test_a_failed_reload_keeps_the_old_engine_serving(tiny_llama):
    calls = []
    client = LocalEngineClient(EngineWorker(loader=broken_or(tiny_llama, calls)))
    try:
        await client.ensure_model(OLD)
        old = client.worker.get("tiny")
        with pytest.raises(FileNotFoundError):
            await client.ensure_model(BROKEN)
        assert client.worker.get("tiny") is old and old.is_serving
        status = client.model_status("tiny")
        assert status.state == "serving" and status.serving == OLD
        assert "no config.json" in status.error and status.failed_spec == BROKEN
        outputs = await collect(client.generate(make_request("still", [1, 2], greedy(2))))
        assert outputs[-1].finish_reason == "length"
        # Requests for the broken spec are served by the old engine and retry nothing.
        for _ in range(5):
            assert await client.serving_model(BROKEN) == old.info
        assert calls.count(BROKEN) == 1
        # An admin's reload (start_loading / load) tries again at once.
        with pytest.raises(FileNotFoundError):
            await asyncio.wrap_future(client.worker.load(BROKEN))
        assert calls.count(BROKEN) == 2
    finally:
        await client.shutdown()


async def test_a_model_that_never_loaded_fails_fast_with_its_error(tiny_llama, monkeypatch):
    calls = []
    client = LocalEngineClient(EngineWorker(loader=broken_or(tiny_llama, calls)))
    try:
        with pytest.raises(FileNotFoundError):
            await client.serving_model(BROKEN)
        for _ in range(3):
            with pytest.raises(ModelLoadError, match=r"no config\.json"):
                await client.serving_model(BROKEN)
        assert calls.count(BROKEN) == 1
        assert client.model_status("tiny").state == "failed"
        # Past the retry interval, the next request tries the load again.
        monkeypatch.setattr(engine.worker, "LOAD_RETRY_AFTER_S", 0.0)
        await client.unload_model("tiny")
        with pytest.raises(FileNotFoundError):
            await client.serving_model(BROKEN)
        with pytest.raises(FileNotFoundError):
            await client.serving_model(BROKEN)
        assert calls.count(BROKEN) == 3
        # A fixed spec loads and clears the failure.
        await client.serving_model(OLD)
        assert client.model_status("tiny").state == "serving"
        assert client.model_status("tiny").error is None
    finally:
        await client.shutdown()


async def test_a_reload_never_makes_a_request_wait(tiny_llama):
    loading = threading.Event()
    release = threading.Event()

    def loader(spec):
        if spec == NEW:
            loading.set()
            release.wait(30)
        return tiny_llama

    client = LocalEngineClient(EngineWorker(loader=loader))
    try:
        await client.ensure_model(OLD)
        old = client.worker.get("tiny")
        async with asyncio.timeout(1):  # answered at once, with the serving engine's info
            assert await client.serving_model(NEW) == old.info
        await asyncio.to_thread(loading.wait, 30)
        assert client.model_status("tiny").loading == NEW
        async with asyncio.timeout(1):
            assert await client.serving_model(NEW) == old.info
        release.set()
        await eventually(lambda: client.worker.get("tiny").spec == NEW)
        assert client.model_status("tiny").loading is None
    finally:
        release.set()
        await client.shutdown()


async def test_a_waiter_that_leaves_does_not_cancel_the_load_for_the_others(tiny_llama):
    release = threading.Event()

    def loader(spec):
        release.wait(30)
        return tiny_llama

    client = LocalEngineClient(EngineWorker(loader=loader))
    try:
        leaving = asyncio.create_task(client.serving_model(OLD))
        staying = asyncio.create_task(client.serving_model(OLD))
        await asyncio.sleep(0.05)
        leaving.cancel()  # a client disconnects while the model loads
        with pytest.raises(asyncio.CancelledError):
            await leaving
        release.set()
        async with asyncio.timeout(30):
            assert (await staying).name == tiny_llama.info.name
        assert client.model_status("tiny").state == "serving"
    finally:
        release.set()
        await client.shutdown()


async def test_a_forced_reload_of_the_serving_spec_loads_a_fresh_engine(client):
    old = client.worker.get("tiny")
    await asyncio.wrap_future(client.worker.load(OLD, force=True))
    new = client.worker.get("tiny")
    assert new is not old and new.spec == OLD
    await eventually(lambda: not old.is_alive())


async def test_returning_to_the_serving_spec_clears_a_failed_reload(tiny_llama):
    client = LocalEngineClient(EngineWorker(loader=broken_or(tiny_llama, [])))
    try:
        await client.ensure_model(OLD)
        with pytest.raises(FileNotFoundError):
            await client.ensure_model(BROKEN)
        assert client.model_status("tiny").error
        await client.serving_model(OLD)  # the admin put the old path back
        assert client.model_status("tiny").error is None
    finally:
        await client.shutdown()


async def test_a_name_that_becomes_an_embedding_model_waits_for_its_load(client, minilm_path):
    old = client.worker.get("tiny")
    spec = ModelSpec(name="tiny", path=str(minilm_path), kind="embedding")
    # Not the chat model's info, which served the name until now: the encoder's, once loaded.
    assert (await client.embedding_model(spec)).dimensions == 384
    assert client.model_status("tiny").serving == spec
    await eventually(lambda: not old.is_alive())
    with pytest.raises(ModelNotLoadedError):
        await client.render_prompt("tiny", PromptInput(text="x"))
