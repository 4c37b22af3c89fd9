"""The workers as a web process sees them (fleet.py), without processes: least-loaded routing
with prefix affinity, what this process has in flight counted, and waiting for the workers to
place a model."""

import dataclasses

import pytest
from channels_redis.serializers import registry

from engine.protocol import (
    EmbeddingInfo,
    GenerationOutput,
    GenerationRequest,
    ModelInfo,
    ModelSpec,
    ModelUnavailableError,
    SamplingParams,
)
from inference.workers.beats import ModelBeat, WorkerBeat
from inference.workers.client import RemoteEngineClient
from inference.workers.fleet import Worker
from inference.workers.replies import Call
from inference.workers.wire import worker_channel
from tests.inference.workers.test_replies import make_client

SPEC = ModelSpec("m", "/nowhere")
MSGPACK = registry.get_serializer("msgpack")  # what channels-redis puts on the wire


def test_a_continued_prompt_goes_back_to_its_worker_unless_that_one_is_much_busier():
    client = make_client()

    def worker(worker_id: str, running: int) -> Worker:
        stats = {"num_waiting": 0, "num_running": running}
        models = {"m": ModelBeat("m", "serving", stats=stats)}
        return Worker(WorkerBeat(worker_id, "h", 1, 0.0, seq=1, models=models), 1, 0.0, True)

    client.fleet.workers = {"w1": worker("w1", 0), "w2": worker("w2", 1)}
    conversation = tuple(range(300))
    assert client._route("m", set(), conversation).beat.worker_id == "w1"  # least loaded
    client.fleet.affinity.remember("m", conversation, "w2")
    # The next turn starts with the whole previous prompt: its prefix cache is on w2.
    continued = conversation + tuple(range(1000, 1100))
    assert client._route("m", set(), continued).beat.worker_id == "w2"
    # Unrelated prompts still go to the least loaded worker...
    assert client._route("m", set(), tuple(range(5000, 5300))).beat.worker_id == "w1"
    # ...and so does the continuation once w2 is busier by more than the slack.
    client.fleet.workers["w2"] = worker("w2", 4)
    assert client._route("m", set(), continued).beat.worker_id == "w1"


async def test_a_request_travels_with_its_cache_scope_and_follows_only_its_scopes_affinity(
    monkeypatch,
):
    client = make_client()
    sent: list[tuple[str, dict]] = []

    class Layer:
        """Hands each message through the channel layer's own serializer, as Redis would, and
        answers it at once."""

        async def send(self, channel: str, message: dict) -> None:
            wire = MSGPACK.deserialize(MSGPACK.serialize(message))
            sent.append((channel, wire))
            request_id = wire["request"]["request_id"]
            done = GenerationOutput(0, "", (), finish_reason="stop")
            client.replies.flights[request_id].queue.put_nowait(done)

    async def started() -> None:
        pass

    monkeypatch.setattr(client, "_started", started)
    client._layer, client.replies.channel = Layer(), "reply!1"

    def worker(worker_id: str, running: int) -> Worker:
        stats = {"num_waiting": 0, "num_running": running}
        models = {"m": ModelBeat("m", "serving", stats=stats)}
        return Worker(WorkerBeat(worker_id, "h", 1, 0.0, seq=1, models=models), 1, 0.0, True)

    client.fleet.workers = {"w1": worker("w1", 0), "w2": worker("w2", 1)}
    conversation = tuple(range(300))
    client.fleet.affinity.remember("m", conversation, "w2", "team:1")
    request = GenerationRequest(
        "r1", "m", (*conversation, 7), SamplingParams(max_tokens=1), cache_scope="team:1"
    )
    outputs = [o async for o in client.generate(request)]
    assert outputs[-1].finish_reason == "stop"
    channel, message = sent[-1]
    # Where team 1's conversation ran, and the scope arrives for the worker's engine.
    assert channel == worker_channel("unit", "w2")
    assert GenerationRequest.from_dict(message["request"]) == request
    # Team 2's identical prompt could not reuse w2's cache: the least loaded worker takes it.
    other = dataclasses.replace(request, request_id="r2", cache_scope="team:2")
    assert [o.finish_reason async for o in client.generate(other)] == ["stop"]
    channel, message = sent[-1]
    assert channel == worker_channel("unit", "w1")
    assert GenerationRequest.from_dict(message["request"]).cache_scope == "team:2"


def test_a_teams_request_goes_where_its_team_holds_least():
    """Each worker's scheduler shares between teams, so a team waits mostly behind its own
    work: its own load on a worker counts twice."""
    client = make_client()

    def worker(worker_id: str, tenants: dict[str, int]) -> Worker:
        shares = {t: {"waiting": n, "running": 0} for t, n in tenants.items()}
        stats = {"num_waiting": sum(tenants.values()), "num_running": 0, "tenants": shares}
        models = {"m": ModelBeat("m", "serving", stats=stats)}
        return Worker(WorkerBeat(worker_id, "h", 1, 0.0, seq=1, models=models), 1, 0.0, True)

    client.fleet.workers = {"w1": worker("w1", {"team:1": 10}), "w2": worker("w2", {"team:2": 8})}
    assert client._route("m", set(), (), "", "team:2").beat.worker_id == "w1"
    assert client._route("m", set(), (), "", "team:1").beat.worker_id == "w2"
    assert client._route("m", set(), (), "", "team:3").beat.worker_id == "w2"  # least loaded


def test_calls_in_flight_count_toward_a_workers_load():
    client = make_client()
    client.replies.channel = "reply!1"
    beat = {"num_waiting": 1, "num_running": 0}  # one of them is this process's own call

    def worker(worker_id: str, mine: int) -> Worker:
        models = {"e": ModelBeat("e", "serving", stats=beat, by_reply={"reply!1": mine})}
        return Worker(WorkerBeat(worker_id, "h", 1, 0.0, seq=1, models=models), 1, 0.0, True)

    client.fleet.workers = {"w1": worker("w1", 1), "w2": worker("w2", 0)}
    future = None  # never resolved here: only counted
    client.replies.calls["c1"] = Call(future, "w1", "e")
    # w1: nothing from others, one call of ours; w2: one request from another web process.
    routes = {client._route("e", set()).beat.worker_id for _ in range(20)}
    assert routes == {"w1", "w2"}  # even: chosen at random
    client.replies.calls["c2"] = Call(future, "w1", "e")
    assert {client._route("e", set()).beat.worker_id for _ in range(20)} == {"w2"}


async def test_waiting_for_an_embedding_model_takes_a_worker_serving_it_as_one(monkeypatch):
    client = make_client()
    embedding = ModelSpec("m", "/minilm", kind="embedding")
    chat = ModelInfo("m", 4096, 100, (0,))
    vectors = EmbeddingInfo("m", 384, 256, 30522, True, "mean")

    def worker(worker_id: str, spec: ModelSpec) -> Worker:
        models = {"m": ModelBeat("m", "serving", spec=spec.to_dict())}
        return Worker(WorkerBeat(worker_id, "h", 1, 0.0, seq=1, models=models), 1, 0.0, True)

    async def info(worker, model):
        return chat if worker.beat.worker_id == "old" else vectors

    monkeypatch.setattr(client.fleet, "info", info)
    # A worker still serving the name as a chat model is passed over.
    client.fleet.workers = {"old": worker("old", SPEC), "new": worker("new", embedding)}
    assert await client.fleet.wait_for(embedding, exact=False) == vectors
    assert await client.fleet.wait_for(SPEC, exact=False) == chat


def _scripted_world(monkeypatch, client: RemoteEngineClient, script):
    """Drive `Fleet.wait_for` on a fake clock: each look at the live workers moves the clock 0.1 s
    and shows the worker as `script(now)` has it ("loading", "serving" or None: no beat)."""
    import inference.workers.fleet as fleet_module

    clock = [0.0]
    monkeypatch.setattr(fleet_module.time, "monotonic", lambda: clock[0])
    client.fleet.refresh_s = 0.0
    nudges = []

    async def nudge(model=""):
        nudges.append(clock[0])

    async def info(worker, model):
        return ModelInfo(model, 4096, 100, (0,))

    live = client.fleet.live

    def scripted_live():
        clock[0] = round(clock[0] + 0.1, 6)
        state = script(clock[0])
        client.fleet.workers.clear()
        if state is not None:
            spec = SPEC.to_dict() if state == "serving" else None
            beat = WorkerBeat("w1", "h", 1, 0.0, models={"m": ModelBeat("m", state, spec=spec)})
            client.fleet.workers["w1"] = Worker(beat, 1, clock[0], confirmed=True)
        return live()

    monkeypatch.setattr(client.fleet, "nudge", nudge)
    monkeypatch.setattr(client.fleet, "info", info)
    monkeypatch.setattr(client.fleet, "live", scripted_live)
    return clock, nudges


async def test_a_loading_worker_out_of_routing_for_moments_does_not_turn_into_a_refusal(
    monkeypatch,
):
    import inference.workers.fleet as fleet_module

    client = make_client()
    grace = fleet_module.PLACEMENT_GRACE_S

    def script(now: float) -> str | None:
        # Two short gaps (beats late while the worker loads), further apart than the grace.
        if 1.0 <= now < 1.5 or 1.5 + grace + 1 <= now < 2.0 + grace + 1:
            return None
        return "serving" if now >= 3.0 + grace + 1 else "loading"

    clock, nudges = _scripted_world(monkeypatch, client, script)
    info = await client.fleet.wait_for(SPEC, exact=False)
    assert info.name == "m" and clock[0] >= 3.0 + grace + 1
    assert nudges  # the first gap asked the workers to look at the registry

    # A model no worker lists is refused once the grace after the nudge has passed.
    client = make_client()
    clock, nudges = _scripted_world(monkeypatch, client, lambda now: None)
    with pytest.raises(ModelUnavailableError, match="No engine worker serves"):
        await client.fleet.wait_for(SPEC, exact=False)
    assert grace < clock[0] - nudges[0] < grace + 1
