"""What a web process waits for from its workers (replies.py), without processes: events put
back in their order, a gap skipped, a reply that lost events ending in an error, a dead worker's
requests ended (or handed on when nothing came back yet) and its calls failed, events from a
worker a request left ignored, a request its worker stops listing settled."""

import asyncio

import pytest

from engine.protocol import GenerationOutput, GenerationRequest, ModelNotLoadedError, SamplingParams
from inference.workers.beats import BeatStore, ModelBeat, WorkerBeat
from inference.workers.client import RemoteEngineClient
from inference.workers.fleet import Worker
from inference.workers.ordering import GAP_TIMEOUT_S
from inference.workers.replies import Call, Flight
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


def flight(client: RemoteEngineClient, n: int = 1, worker: str = "w1") -> Flight:
    request = GenerationRequest("r1", "m", (1, 2, 3), SamplingParams(max_tokens=5, n=n))
    client.replies.flights["r1"] = f = Flight(request, worker)
    return f


def drained(queue: asyncio.Queue) -> list:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def test_events_are_put_back_in_the_order_the_worker_sent_them():
    client = make_client()
    f = flight(client)
    client.replies.arrived(message(1, out(0, "b", (2,))))
    assert f.queue.empty()  # 0 has not come yet
    client.replies.arrived(message(0, out(0, "a", (1,))))
    client.replies.arrived(
        message(2, out(0, "c", (3,), finish_reason="length", num_generated_tokens=3))
    )
    items = drained(f.queue)
    assert [i.text for i in items] == ["a", "b", "c"]
    assert items[-1].finish_reason == "length"


async def test_a_message_that_never_comes_is_skipped_and_the_reply_ends_in_an_error(monkeypatch):
    client = make_client()
    f = flight(client)
    client.replies.arrived(message(0, out(0, "a", (1,))))
    client.replies.arrived(
        message(2, out(0, "c", (3,), finish_reason="length", num_generated_tokens=3))
    )
    assert [i.text for i in drained(f.queue)] == ["a"]
    order = client.replies.orders[("w1", "")]
    order.gap_since -= GAP_TIMEOUT_S + 0.1
    client.replies.close_gaps()
    (last,) = drained(f.queue)
    # Two tokens arrived of three generated: not passed off as a complete reply.
    assert last.finish_reason == "error" and "lost" in last.error
    assert last.num_generated_tokens == 3
    # The late message, should it still come, is dropped.
    client.replies.arrived(message(1, out(0, "b", (2,))))
    assert f.queue.empty()


async def test_a_dead_workers_requests_end_with_an_error_or_go_elsewhere():
    client = make_client()
    beat = WorkerBeat("w1", "host", 1, 0.0, at=0.0, seq=1, models={"m": ModelBeat("m", "serving")})
    client.fleet.workers["w1"] = Worker(beat, 1, 0.0, confirmed=True)
    started = flight(client, n=2)
    client.replies.arrived(message(0, out(0, "a", (1,))))
    client.replies.arrived(
        message(1, out(1, "x", (9,), finish_reason="stop", num_generated_tokens=1))
    )
    drained(started.queue)
    client._update([])  # its beat is gone
    (ended,) = drained(started.queue)  # choice 1 had finished; choice 0 ends with an error
    assert (ended.index, ended.finish_reason) == (0, "error")
    assert "stopped responding" in ended.error
    assert "w1" not in client.fleet.workers

    client.fleet.workers["w1"] = Worker(beat, 1, 0.0, confirmed=True)
    waiting = flight(client)  # nothing came back for it yet: another worker may take it
    client._update([])
    (handed_on,) = drained(waiting.queue)
    assert handed_on.error["retry"] is True


async def test_a_call_ends_with_its_result_or_with_its_worker():
    client = make_client()
    beat = WorkerBeat("w1", "host", 1, 0.0, at=0.0, seq=1, models={"e": ModelBeat("e", "serving")})
    client.fleet.workers["w1"] = Worker(beat, 1, 0.0, confirmed=True)
    loop = asyncio.get_running_loop()
    answered, waiting = loop.create_future(), loop.create_future()
    client.replies.calls["c1"] = Call(answered, "w1", "e")
    client.replies.calls["c2"] = Call(waiting, "w1", "e")
    client.replies.arrived(message(0, ["res", "c1", {"value": [[101, 102]]}]))
    assert answered.result() == {"value": [[101, 102]]} and not waiting.done()
    client._update([])  # the worker stopped beating mid-call
    with pytest.raises(ModelNotLoadedError, match="stopped responding"):
        waiting.result()


async def test_events_from_a_worker_the_request_left_are_ignored():
    client = make_client()
    f = flight(client, worker="w2")
    client.replies.arrived(message(0, out(0, "stale", (1,)), worker="w1"))
    assert f.queue.empty()


def test_errors_cross_with_their_kind_parameter_and_code():
    from engine.protocol import EngineOverloadedError, InvalidRequestError

    error = decode_error(encode_error(InvalidRequestError("too long", param="messages", code="c")))
    assert isinstance(error, InvalidRequestError)
    assert (str(error), error.param, error.code) == ("too long", "messages", "c")
    data = encode_error(EngineOverloadedError("busy"), retry=True)
    assert isinstance(decode_error(data), EngineOverloadedError) and data["retry"]


async def test_a_request_its_worker_no_longer_lists_is_settled(monkeypatch):
    import inference.workers.replies as replies_module

    client = make_client()
    client.replies.channel = "reply!1"

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

    client.fleet.workers["w1"] = Worker(beat(1, ["r1"]), 1, 0.0, confirmed=True)
    f = flight(client)
    f.run_id = "a"
    f.sent_at -= 10  # sent well before the beats below were taken
    client.replies.arrived({**message(0, out(0, "a", (1,))), "run": "a"})
    drained(f.queue)
    clock = [1000.0]
    monkeypatch.setattr(replies_module.time, "monotonic", lambda: clock[0])
    f.sent_at = clock[0] - 10
    client._update([beat(2, ["r1"])])
    assert f.missing_since is None  # still listed: still running there
    clock[0] += 1
    client._update([beat(3, [])])  # the worker finished it; its last event never came
    assert f.missing_since is not None and f.queue.empty()
    clock[0] += replies_module.SETTLE_GRACE_S + 1
    client._update([beat(4, [])])
    (ended,) = drained(f.queue)
    assert ended.finish_reason == "error" and "lost" in ended.error

    # A worker restarted under the same id is another run: what the old run held has died.
    other = flight(client)
    other.run_id = "a"
    client.replies.arrived({**message(1, out(0, "b", (2,))), "run": "a"})
    drained(other.queue)
    client._update([beat(5, [], run="b")])
    (died,) = drained(other.queue)
    assert died.finish_reason == "error" and "stopped responding" in died.error
    assert client.fleet.workers["w1"].beat.run_id == "b"
