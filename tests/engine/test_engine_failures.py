"""A failure while serving ends the requests it touches with "error"; the engine keeps serving,
and an engine whose loop dies says so instead of leaving requests to hang."""

import asyncio
import threading

import mlx.core as mx
import pytest

import engine.core.loop
import engine.core.sampling
from engine.local import LocalEngineClient
from engine.protocol import InvalidRequestError, ModelNotLoadedError, ModelSpec, SamplingParams
from engine.worker import EngineWorker
from tests.engine.conftest import eventually, greedy, make_request

SPEC = ModelSpec(name="tiny", path="unused", max_num_seqs=2)


@pytest.fixture
async def client(tiny_llama):
    client = LocalEngineClient(EngineWorker(loader=lambda spec: tiny_llama))
    await client.ensure_model(SPEC)
    yield client
    await client.shutdown()


async def outputs_of(client, request_id, params, prompt=(1000, 2000, 3000)):
    # A hung engine fails the test instead of hanging it.
    async with asyncio.timeout(20):
        return [o async for o in client.generate(make_request(request_id, prompt, params))]


def finish_reasons(outputs) -> dict[int, str]:
    return {o.index: o.finish_reason for o in outputs if o.finish_reason}


async def test_more_choices_than_the_batch_holds_fail_before_any_output(client):
    with pytest.raises(InvalidRequestError) as info:
        await outputs_of(client, "wide", SamplingParams(n=3, max_tokens=2))
    assert info.value.param == "n"
    outputs = await outputs_of(client, "after", greedy(3, n=2, ignore_eos=True))
    assert finish_reasons(outputs) == {0: "length", 1: "length"}


class _BrokenDetokenizer:
    def __init__(self, *args, **kwargs):
        pass

    def add(self, token_id, match_stop):
        raise RuntimeError("detokenizer broke")


def _break_detokenizer(monkeypatch, client):
    real = engine.core.loop.StreamDetokenizer
    monkeypatch.setattr(
        engine.core.loop,
        "StreamDetokenizer",
        lambda tokenizer, stop, **kwargs: (_BrokenDetokenizer if "boom" in stop else real)(
            tokenizer, stop=stop, **kwargs
        ),
    )


def _break_scheduler_add(monkeypatch, client):
    scheduler = client.worker.get("tiny").scheduler
    real = scheduler.add

    def add(request):
        if "boom" in request.spec.sampling.stop:
            raise ValueError("scheduler broke")
        real(request)

    monkeypatch.setattr(scheduler, "add", add)


def _break_sampling_state(monkeypatch, client):
    real = engine.core.loop.SamplingState

    def build(params, **kwargs):
        if "boom" in params.stop:
            raise MemoryError("no room for the sampling state")
        return real(params, **kwargs)

    monkeypatch.setattr(engine.core.loop, "SamplingState", build)


@pytest.mark.parametrize(
    "break_it", [_break_detokenizer, _break_scheduler_add, _break_sampling_state]
)
async def test_a_failing_request_ends_with_error_and_the_engine_goes_on(
    client, monkeypatch, break_it
):
    break_it(monkeypatch, client)
    good = asyncio.create_task(outputs_of(client, "good", greedy(12, ignore_eos=True)))
    bad = await outputs_of(client, "bad", greedy(12, ignore_eos=True, n=2, stop=("boom",)))
    assert finish_reasons(bad) == {0: "error", 1: "error"} and bad[-1].error
    good = await good
    assert finish_reasons(good) == {0: "length"} and sum(len(o.token_ids) for o in good) == 12
    assert finish_reasons(await outputs_of(client, "later", greedy(2))) == {0: "length"}


async def test_a_failing_emit_ends_only_its_request(client):
    done = asyncio.Event()
    loop = asyncio.get_running_loop()

    def broken_emit(output):
        raise RuntimeError("caller went away")

    def emit(output):
        if output.finish_reason:
            loop.call_soon_threadsafe(done.set)

    client.worker.submit(make_request("bad", [1, 2, 3], greedy(50, ignore_eos=True)), broken_emit)
    client.worker.submit(make_request("ok", [4, 5, 6], greedy(5, ignore_eos=True)), emit)
    async with asyncio.timeout(20):
        await done.wait()
    served = client.worker.get("tiny")
    await eventually(lambda: served.stats().num_running == 0)
    assert finish_reasons(await outputs_of(client, "later", greedy(2))) == {0: "length"}


async def test_a_dead_loop_ends_its_requests_with_error_and_the_worker_restarts_it(
    client, monkeypatch
):
    served = client.worker.get("tiny")
    running = asyncio.create_task(outputs_of(client, "running", greedy(4000, ignore_eos=True)))
    waiting = asyncio.create_task(outputs_of(client, "waiting", greedy(4000, ignore_eos=True, n=2)))
    await eventually(lambda: served.stats().num_running == 1 == served.stats().num_waiting)

    def has_work():
        raise RuntimeError("scheduler bug")

    monkeypatch.setattr(served.scheduler, "has_work", has_work)
    for outputs in (await running, await waiting):
        assert set(finish_reasons(outputs).values()) == {"error"}
        assert "engine stopped" in outputs[-1].error
    await eventually(lambda: not served.is_alive())
    with pytest.raises(ModelNotLoadedError):
        served.submit(make_request("refused", [1, 2], greedy(2)), lambda output: None)

    # Nobody asks for a reload: the worker starts the engine again on its own.
    await eventually(lambda: client.model_status("tiny").state == "serving", timeout=20)
    assert client.worker.get("tiny") is not served
    assert client.model_status("tiny").restarts == 1
    assert finish_reasons(await outputs_of(client, "again", greedy(2))) == {0: "length"}

    # Dying again soon after: restarted again, after a delay that grows.
    restarted = client.worker.get("tiny")
    monkeypatch.setattr(restarted.scheduler, "has_work", has_work)
    assert set(finish_reasons(await outputs_of(client, "dies", greedy(50))).values()) == {"error"}
    await eventually(lambda: client.model_status("tiny").restarts == 2, timeout=20)
    await eventually(lambda: client.model_status("tiny").state == "serving", timeout=20)
    assert client.worker.get("tiny") is not restarted


async def test_mlx_arrays_are_made_only_on_the_servedthread(client, monkeypatch):
    threads: list[threading.Thread] = []

    class SpyMx:
        def __getattr__(self, name):
            return getattr(mx, name)

        def array(self, *args, **kwargs):
            threads.append(threading.current_thread())
            return mx.array(*args, **kwargs)

        def zeros(self, *args, **kwargs):
            threads.append(threading.current_thread())
            return mx.zeros(*args, **kwargs)

    monkeypatch.setattr(engine.core.sampling, "mx", SpyMx())
    params = SamplingParams(temperature=0.7, seed=1, repetition_penalty=1.2, n=2, max_tokens=3)
    await outputs_of(client, "spied", params)
    servedthread = client.worker.get("tiny")._thread
    assert threads and all(thread is servedthread for thread in threads)
