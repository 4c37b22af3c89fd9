"""The web side of the worker protocol, without processes: events put back in their order, a
gap skipped, a reply that lost events ending in an error, a dead worker's requests ended (or
handed on when nothing came back yet), events from a worker a request left ignored."""

import asyncio

import pytest

from engine.protocol import (
    GenerationOutput,
    GenerationRequest,
    ModelInfo,
    ModelSpec,
    ModelUnavailableError,
    SamplingParams,
)
from inference.workers.beats import BeatStore, ModelBeat, WorkerBeat
from inference.workers.client import RemoteEngineClient, _Flight, _Worker
from inference.workers.ordering import GAP_TIMEOUT_S
from inference.workers.wire import decode_error, encode_error, encode_output


def make_client() -> RemoteEngineClient:
    return RemoteEngineClient(
        store=BeatStore("redis://127.0.0.1:6379/13", "unit"),
        namespace="unit",
        layer_factory=lambda: None,
    )


def out(index: int, text: str, tokens: tuple[int, ...], **kwargs) -> list:
    return ["out", "r1", encode_output(GenerationOutput(index, text, tokens, **kwargs))]


def message(seq: int, *events, worker: str = "w1") -> dict:
    return {"type": "events", "worker": worker, "seq": seq, "events": list(events)}


def flight(client: RemoteEngineClient, n: int = 1, worker: str = "w1") -> _Flight:
    request = GenerationRequest("r1", "m", (1, 2, 3), SamplingParams(max_tokens=5, n=n))
    client._flights["r1"] = f = _Flight(request, worker)
    return f


def drained(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def test_events_are_put_back_in_the_order_the_worker_sent_them():
    client = make_client()
    f = flight(client)
    client._arrived(message(1, out(0, "b", (2,))))
    assert f.queue.empty()  # 0 has not come yet
    client._arrived(message(0, out(0, "a", (1,))))
    client._arrived(message(2, out(0, "c", (3,), finish_reason="length", num_generated_tokens=3)))
    items = drained(f.queue)
    assert [i.text for i in items] == ["a", "b", "c"]
    assert items[-1].finish_reason == "length"


async def test_a_message_that_never_comes_is_skipped_and_the_reply_ends_in_an_error(monkeypatch):
    client = make_client()
    f = flight(client)
    client._arrived(message(0, out(0, "a", (1,))))
    client._arrived(message(2, out(0, "c", (3,), finish_reason="length", num_generated_tokens=3)))
    assert [i.text for i in drained(f.queue)] == ["a"]
    order = client._orders[("w1", "")]
    order.gap_since -= GAP_TIMEOUT_S + 0.1
    client._close_gaps()
    (last,) = drained(f.queue)
    # Two tokens arrived of three generated: not passed off as a complete reply.
    assert last.finish_reason == "error" and "lost" in last.error
    assert last.num_generated_tokens == 3
    # The late message, should it still come, is dropped.
    client._arrived(message(1, out(0, "b", (2,))))
    assert f.queue.empty()


async def test_a_dead_workers_requests_end_with_an_error_or_go_elsewhere():
    client = make_client()
    beat = WorkerBeat("w1", "host", 1, 0.0, at=0.0, seq=1, models={"m": ModelBeat("m", "serving")})
    client._workers["w1"] = _Worker(beat, 1, 0.0, confirmed=True)
    started = flight(client, n=2)
    client._arrived(message(0, out(0, "a", (1,))))
    client._arrived(message(1, out(1, "x", (9,), finish_reason="stop", num_generated_tokens=1)))
    drained(started.queue)
    client._update([])  # its beat is gone
    (ended,) = drained(started.queue)  # choice 1 had finished; choice 0 ends with an error
    assert (ended.index, ended.finish_reason) == (0, "error")
    assert "stopped responding" in ended.error
    assert "w1" not in client._workers

    client._workers["w1"] = _Worker(beat, 1, 0.0, confirmed=True)
    waiting = flight(client)  # nothing came back for it yet: another worker may take it
    client._update([])
    (handed_on,) = drained(waiting.queue)
    assert handed_on.error["retry"] is True


async def test_events_from_a_worker_the_request_left_are_ignored():
    client = make_client()
    f = flight(client, worker="w2")
    client._arrived(message(0, out(0, "stale", (1,)), worker="w1"))
    assert f.queue.empty()


def test_errors_cross_with_their_kind_parameter_and_code():
    from engine.protocol import EngineOverloadedError, InvalidRequestError

    error = decode_error(encode_error(InvalidRequestError("too long", param="messages", code="c")))
    assert isinstance(error, InvalidRequestError)
    assert (str(error), error.param, error.code) == ("too long", "messages", "c")
    data = encode_error(EngineOverloadedError("busy"), retry=True)
    assert isinstance(decode_error(data), EngineOverloadedError) and data["retry"]


def test_a_continued_prompt_goes_back_to_its_worker_unless_that_one_is_much_busier():
    client = make_client()

    def worker(worker_id: str, running: int) -> _Worker:
        stats = {"num_waiting": 0, "num_running": running}
        models = {"m": ModelBeat("m", "serving", stats=stats)}
        return _Worker(WorkerBeat(worker_id, "h", 1, 0.0, seq=1, models=models), 1, 0.0, True)

    client._workers = {"w1": worker("w1", 0), "w2": worker("w2", 1)}
    conversation = tuple(range(300))
    assert client._route("m", set(), conversation).beat.worker_id == "w1"  # least loaded
    client._affinity.remember("m", conversation, "w2")
    # The next turn starts with the whole previous prompt: its prefix cache is on w2.
    continued = conversation + tuple(range(1000, 1100))
    assert client._route("m", set(), continued).beat.worker_id == "w2"
    # Unrelated prompts still go to the least loaded worker...
    assert client._route("m", set(), tuple(range(5000, 5300))).beat.worker_id == "w1"
    # ...and so does the continuation once w2 is busier by more than the slack.
    client._workers["w2"] = worker("w2", 4)
    assert client._route("m", set(), continued).beat.worker_id == "w1"


async def test_a_request_its_worker_no_longer_lists_is_settled(monkeypatch):
    import inference.workers.client as client_module

    client = make_client()
    client._reply = "reply!1"

    def beat(seq: int, open_ids: list[str], run: str = "a") -> WorkerBeat:
        models = {"m": ModelBeat("m", "serving")}
        return WorkerBeat(
            "w1",
            "h",
            1,
            0.0,
            at=0.0,
            seq=seq,
            run_id=run,
            models=models,
            open_requests={"reply!1": open_ids},
        )

    client._workers["w1"] = _Worker(beat(1, ["r1"]), 1, 0.0, confirmed=True)
    f = flight(client)
    f.run_id = "a"
    f.sent_at -= 10  # sent well before the beats below were taken
    client._arrived({**message(0, out(0, "a", (1,))), "run": "a"})
    drained(f.queue)
    clock = [1000.0]
    monkeypatch.setattr(client_module.time, "monotonic", lambda: clock[0])
    f.sent_at = clock[0] - 10
    client._update([beat(2, ["r1"])])
    assert f.missing_since is None  # still listed: still running there
    clock[0] += 1
    client._update([beat(3, [])])  # the worker finished it; its last event never came
    assert f.missing_since is not None and f.queue.empty()
    clock[0] += client_module.SETTLE_GRACE_S + 1
    client._update([beat(4, [])])
    (ended,) = drained(f.queue)
    assert ended.finish_reason == "error" and "lost" in ended.error

    # A worker restarted under the same id is another run: what the old run held has died.
    other = flight(client)
    other.run_id = "a"
    client._arrived({**message(1, out(0, "b", (2,))), "run": "a"})
    drained(other.queue)
    client._update([beat(5, [], run="b")])
    (died,) = drained(other.queue)
    assert died.finish_reason == "error" and "stopped responding" in died.error
    assert client._workers["w1"].beat.run_id == "b"


def _scripted_world(monkeypatch, client: RemoteEngineClient, script):
    """Drive `_wait_for` on a fake clock: each look at the live workers moves the clock 0.1 s
    and shows the worker as `script(now)` has it ("loading", "serving" or None: no beat)."""
    import inference.workers.client as client_module

    clock = [0.0]
    monkeypatch.setattr(client_module.time, "monotonic", lambda: clock[0])
    client.refresh_s = 0.0
    nudges = []

    async def nudge(model=""):
        nudges.append(clock[0])

    async def info(worker, model):
        return ModelInfo(model, 4096, 100, (0,))

    live = client._live

    def scripted_live():
        clock[0] = round(clock[0] + 0.1, 6)
        state = script(clock[0])
        client._workers.clear()
        if state is not None:
            beat = WorkerBeat("w1", "h", 1, 0.0, models={"m": ModelBeat("m", state)})
            client._workers["w1"] = _Worker(beat, 1, clock[0], confirmed=True)
        return live()

    monkeypatch.setattr(client, "_nudge", nudge)
    monkeypatch.setattr(client, "_info", info)
    monkeypatch.setattr(client, "_live", scripted_live)
    return clock, nudges


async def test_a_loading_worker_out_of_routing_for_moments_does_not_turn_into_a_refusal(
    monkeypatch,
):
    import inference.workers.client as client_module

    client = make_client()
    grace = client_module.PLACEMENT_GRACE_S

    def script(now: float) -> str | None:
        # Two short gaps (beats late while the worker loads), further apart than the grace.
        if 1.0 <= now < 1.5 or 1.5 + grace + 1 <= now < 2.0 + grace + 1:
            return None
        return "serving" if now >= 3.0 + grace + 1 else "loading"

    clock, nudges = _scripted_world(monkeypatch, client, script)
    info = await client._wait_for(ModelSpec("m", "/nowhere"), exact=False)
    assert info.name == "m" and clock[0] >= 3.0 + grace + 1
    assert nudges  # the first gap asked the workers to look at the registry

    # A model no worker lists is refused once the grace after the nudge has passed.
    client = make_client()
    clock, nudges = _scripted_world(monkeypatch, client, lambda now: None)
    with pytest.raises(ModelUnavailableError, match="No engine worker serves"):
        await client._wait_for(ModelSpec("m", "/nowhere"), exact=False)
    assert grace < clock[0] - nudges[0] < grace + 1
