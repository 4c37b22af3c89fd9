"""One memory budget for every model a worker serves (engine/cache/host.py, engine/worker.py):
a model loads only where it fits, idle models that are not pinned make room least recently used
first, a load that cannot fit is refused (never an over-committed machine), and idle models
unload after their time."""

import asyncio
import dataclasses
import time

import pytest

from engine.cache.host import MIN_CACHE_BYTES, HostMemory
from engine.cache.memory import weights_bytes
from engine.local import LocalEngineClient
from engine.protocol import ModelCapacityError, ModelSpec
from engine.text.processes import PoolSize
from engine.worker import EngineWorker
from tests.engine.conftest import eventually, greedy, make_request

MIB = 1 << 20
CACHE = 100 * MIB  # each test model's caches' budget (its registry setting)


def spec(name: str, **fields) -> ModelSpec:
    return ModelSpec(name=name, path="unused", memory_budget_bytes=CACHE, **fields)


@pytest.fixture
async def client(tiny_llama):
    # Room for two models (caches and weights), not three.
    budget = 2 * (CACHE + weights_bytes(tiny_llama.model)) + 10 * MIB
    worker = EngineWorker(loader=lambda spec: tiny_llama, memory=HostMemory(budget))
    client = LocalEngineClient(worker, render=PoolSize(processes=1))
    yield client
    await client.shutdown()


def age(worker: EngineWorker, name: str, seconds: float) -> None:
    """Pretend `name`'s last request was `seconds` ago, and none is on its way."""
    worker.residency.last_used[name] = time.time() - seconds
    while worker.residency.is_held(name):
        worker.residency.unhold(name)


async def run(client, model: str, rid: str) -> list:
    async with asyncio.timeout(30):
        request = dataclasses.replace(make_request(rid, [1, 2, 3], greedy(2)), model=model)
        return [o async for o in client.generate(request)]


def test_a_reservation_is_what_the_model_wants_or_what_is_left():
    memory = HostMemory(1000 * MIB, cache_share=0.5)
    a, b, c = object(), object(), object()
    flexible = ModelSpec(name="a", path="unused")
    assert memory.reserve(a, flexible).cache_bytes == 500 * MIB  # its share of the budget
    # The next takes the rest (less than its share, more than the least).
    assert memory.reserve(b, ModelSpec(name="b", path="unused")).cache_bytes == 500 * MIB
    assert memory.reserve(c, ModelSpec(name="c", path="unused")) is None  # no room left
    assert memory.used() == 1000 * MIB
    memory.release(a)
    assert memory.by_name() == {"b": 500 * MIB}
    fixed = ModelSpec(name="d", path="unused", memory_budget_bytes=600 * MIB)
    assert memory.reserve(c, fixed) is None  # a fixed budget is not cut to fit
    assert memory.least(ModelSpec(name="e", path="unused")) == MIN_CACHE_BYTES


def test_victims_are_the_least_recently_used_and_only_as_many_as_needed():
    memory = HostMemory(300 * MIB)
    old, newer, newest = object(), object(), object()
    for engine, name in ((old, "old"), (newer, "newer"), (newest, "newest")):
        memory.reserve(engine, spec(name))
    candidates = [(newest, 30.0), (old, 10.0), (newer, 20.0)]
    assert memory.victims(spec("next"), candidates) == [old]
    two = ModelSpec(name="big", path="unused", memory_budget_bytes=2 * CACHE)
    assert memory.victims(two, candidates) == [old, newer]
    huge = ModelSpec(name="huge", path="unused", memory_budget_bytes=10 * CACHE)
    assert memory.victims(huge, candidates) == []  # cannot fit even with all: unload nothing


async def test_an_idle_model_makes_room_and_a_busy_one_does_not(client, monkeypatch):
    worker = client.worker
    await client.ensure_model(spec("a"))
    await client.ensure_model(spec("b"))
    assert worker.memory.by_name().keys() == {"a", "b"}
    age(worker, "a", 20)
    age(worker, "b", 10)
    # "c" needs room: "a", the least recently used idle model, goes; "b" stays.
    await client.ensure_model(spec("c"))
    assert worker.status("a").state == "not_loaded"
    assert worker.status("b").state == worker.status("c").state == "serving"
    assert (await run(client, "c", "c1"))[-1].finish_reason == "length"

    # One loaded model busy, the other with a request on its way (looked up, not yet
    # submitted): "a" is refused, with nothing unloaded.
    monkeypatch.setattr(type(worker.get("b")), "has_requests", lambda self: True)
    age(worker, "c", 10)
    await client.serving_model(spec("c"))
    with pytest.raises(ModelCapacityError, match="memory budget has no room"):
        await client.serving_model(spec("a"))
    status = worker.status("a")
    assert status.state == "not_loaded" and status.failure_code == "model_capacity_exceeded"
    assert {"b", "c"} <= set(worker.names())
    assert worker.memory.used() <= worker.memory.max_bytes


async def test_a_pinned_model_is_never_unloaded(client):
    worker = client.worker
    await client.ensure_model(spec("a", pinned=True))
    await client.ensure_model(spec("b"))
    age(worker, "a", 10_000)
    age(worker, "b", 10_000)
    assert worker.unload_idle() == []  # no idle time set: nothing unloads by age
    await client.ensure_model(spec("c"))  # "b" makes room, not the pinned "a"
    assert worker.status("a").state == "serving"
    assert worker.status("b").state == "not_loaded"
    await client.serving_model(spec("c"))  # a request on its way holds it
    with pytest.raises(ModelCapacityError):
        await client.serving_model(spec("d", pinned=True))  # a pinned load evicts no pinned
    # Pinning changes no spec identity: the serving engine is kept, not reloaded.
    engine = worker.get("c")
    await client.serving_model(spec("c", pinned=True))
    assert worker.get("c") is engine and worker.status("c").pinned


async def test_idle_models_unload_after_their_time_and_load_again_on_use(client):
    worker = client.worker
    await client.ensure_model(spec("a", idle_unload_s=60))
    await client.ensure_model(spec("b"))  # the worker's default: 0, never
    assert (await run(client, "a", "a1"))[-1].finish_reason == "length"
    await eventually(lambda: not worker.get("a").has_requests())
    assert worker.unload_idle(now=time.time() + 30) == []
    assert worker.unload_idle(now=time.time() + 61) == ["a"]
    await eventually(lambda: worker.memory.by_name().keys() == {"b"})
    # The next request loads it again (its first token waits for the load).
    await client.serving_model(spec("a", idle_unload_s=60))
    assert (await run(client, "a", "a2"))[-1].finish_reason == "length"


async def test_preload_only_fills_free_room(client):
    worker = client.worker
    client.place_models([spec("a"), spec("b"), spec("c")])
    await eventually(lambda: worker.status("a").state == worker.status("b").state == "serving")
    assert worker.status("c").state == "not_loaded"  # loads on its first request
    assert worker.status("c").error is None


async def test_the_granted_caches_budget_reaches_the_engine(tiny_llama):
    worker = EngineWorker(
        loader=lambda spec: tiny_llama, memory=HostMemory(1000 * MIB, cache_share=0.3)
    )
    client = LocalEngineClient(worker, render=PoolSize(processes=1))
    try:
        await client.ensure_model(ModelSpec(name="a", path="unused"))
        engine = worker.get("a")
        assert engine.memory.max_bytes == 300 * MIB
        held = worker.memory.held(engine)
        assert held.weights_bytes == engine.weights_bytes > 0  # measured after the load
        assert worker.status("a").memory_bytes == held.total
    finally:
        await client.shutdown()


async def test_three_models_over_the_budget_answer_in_rotation(client):
    """Two fit: the pinned one stays, the other two take turns, every request answered, the
    budget never over-committed (sampled throughout), and an idle one unloads after its time."""
    import threading

    worker = client.worker
    specs = [spec("pinned", pinned=True), spec("one"), spec("two", idle_unload_s=1)]
    held, stop = [], threading.Event()

    def sample() -> None:
        while not stop.wait(0.002):
            held.append(worker.memory.used())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for round_ in range(3):
            for model in specs:
                await client.serving_model(model)
                outputs = await run(client, model.name, f"{model.name}-{round_}")
                assert outputs[-1].finish_reason == "length"
                assert worker.status("pinned").state == "serving"
    finally:
        stop.set()
        sampler.join()
    assert held and max(held) <= worker.memory.max_bytes
    await eventually(lambda: not worker.get("two").has_requests())
    assert worker.unload_idle(now=time.time() + 2) == ["two"]
    assert worker.status("pinned").state == "serving"


def test_a_new_version_takes_over_its_predecessors_caches():
    memory = HostMemory(1000 * MIB, cache_share=1.0)
    old, new = object(), object()
    first = memory.reserve(old, ModelSpec(name="m", path="unused"))
    assert first.cache_bytes == 1000 * MIB  # weights estimated 0: all of it
    # A changed spec of the same model: the old engine keeps serving (its weights) while the
    # new one loads with the old one's caches' budget, and the two never exceed the budget.
    second = memory.reserve(new, ModelSpec(name="m", path="unused", max_num_seqs=3), replacing=old)
    assert second.cache_bytes == 1000 * MIB and first.cache_bytes == 0
    assert memory.used() <= 1000 * MIB
