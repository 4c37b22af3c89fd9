"""Engines in `runengine` worker processes, reached over the Channels layer on Redis: streaming,
least-loaded routing, a worker killed mid-stream, a SIGTERM drain, cancellation across
processes, the registry followed without a restart, and embeddings served by the workers (equal
to the in-process engine's, stopped between forwards when the client leaves, bad calls answered,
a worker stopping mid-call a 503), on the real Redis and the test database.

The tests share one layout, in an order that spares it work: the registry test after those of
embeddings (a nudge after it would load the tiny model again, on the registry's default spec),
and those that end a worker last, each leaving the others serving: a worker started with
--models joins the two, the drain ends one of the three, the kill one of the two left."""

import asyncio
import signal
import time

import httpx
import numpy as np
import openai
import pytest
from tokenizers import Tokenizer

from inference.models import ModelEntry, UsageRecord
from tests.inference.api.test_embeddings import post_and_keep_open
from tests.inference.conftest import TINY, TINY_SIMPLE
from tests.inference.workers.conftest import REDIS_URL, TIMEOUT_S, nudge

pytestmark = [pytest.mark.redis, pytest.mark.django_db(transaction=True)]
MESSAGES = [{"role": "user", "content": "Tell me a story"}]
TEXTS = ["A man is playing a guitar.", "Someone is playing an instrument.", "Stocks fell today."]


@pytest.fixture
def key(make_key, served):
    return make_key()


def client_for(layout, key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{layout.url}/v1", api_key=key, max_retries=0, timeout=120)


def finished_rows(count: int, timeout: float = 20) -> list[UsageRecord]:
    deadline = time.monotonic() + timeout
    while True:
        rows = list(UsageRecord.objects.exclude(status=UsageRecord.Status.IN_PROGRESS))
        if len(rows) >= count or time.monotonic() > deadline:
            return rows
        time.sleep(0.05)


def test_streaming_through_a_remote_worker_matches_the_in_process_engine(
    layout, key, live_server_url
):
    body = dict(
        model=TINY, messages=MESSAGES, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
    )
    stream = client_for(layout, key).chat.completions.create(
        **body, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 5
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 40

    # The same greedy tokens as the engine inside a web process.
    local = openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=key, max_retries=0)
    reply = local.chat.completions.create(**body)
    assert reply.choices[0].message.content == text

    rows = finished_rows(2)
    assert {r.status for r in rows} == {UsageRecord.Status.COMPLETED}
    assert all(r.completion_tokens == 40 and r.prompt_tokens > 0 for r in rows)


def test_a_prompt_too_long_for_the_model_is_refused_through_a_remote_worker(layout, key):
    long = [{"role": "user", "content": "apple " * 5000}]
    with pytest.raises(openai.BadRequestError) as caught:
        client_for(layout, key).chat.completions.create(model=TINY, messages=long, max_tokens=3)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.body["param"] == "messages"
    assert "in the messages, 3 in the completion)" in caught.value.message


def test_requests_go_to_the_least_loaded_worker(layout, key):
    workers = layout.live(TINY)
    before = {w: layout.stats(w, TINY).get("num_generated_tokens", 0) for w in workers}

    async def burst():
        async with openai.AsyncOpenAI(
            base_url=f"{layout.url}/v1", api_key=key, max_retries=0, timeout=120
        ) as client:
            return await asyncio.gather(
                *(
                    client.chat.completions.create(
                        model=TINY,
                        messages=MESSAGES,
                        max_tokens=40,
                        extra_body={"ignore_eos": True},
                    )
                    for _ in range(8)
                )
            )

    replies = asyncio.run(burst())
    assert all(r.usage.completion_tokens == 40 for r in replies)

    def counted():
        after = {w: layout.stats(w, TINY).get("num_generated_tokens", 0) for w in workers}
        return {w: (after[w] - before[w]) / 40 for w in after}

    layout.wait_for(lambda: sum(counted().values()) == 8, "both workers' beats to count")
    # Each request went where the fewest were: about an even split of a burst (the workers'
    # beats, which count other processes' work, lag by up to a beat, so one may take two more).
    split = counted()
    assert sorted(split) == sorted(workers) and min(split.values()) >= 3, split


def test_a_client_leaving_aborts_the_request_in_the_worker(layout, key):
    async def leave_early():
        async with httpx.AsyncClient(base_url=layout.url, timeout=60) as http:
            body = {
                "model": TINY,
                "messages": MESSAGES,
                "max_tokens": 4000,
                "ignore_eos": True,
                "stream": True,
            }
            headers = {"Authorization": f"Bearer {key}"}
            async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
                lines = 0
                async for _ in r.aiter_lines():
                    lines += 1
                    if lines >= 6:
                        break

    asyncio.run(leave_early())
    left = time.monotonic()
    layout.wait_for(lambda: not layout.running(TINY), "the workers to stop generating", 10)
    assert time.monotonic() - left < 3
    rows = finished_rows(1)
    assert [r.status for r in rows] == [UsageRecord.Status.CANCELLED]
    assert rows[0].completion_tokens < 4000


def tokens_embedded(layout, model: str) -> int:
    return sum(layout.stats(w, model).get("num_prompt_tokens", 0) for w in layout.live(model))


def test_embeddings_through_remote_workers_match_the_in_process_engine(
    layout, embedded, key, live_server_url, minilm_path
):
    before = tokens_embedded(layout, embedded)
    remote = client_for(layout, key).embeddings.create(model=embedded, input=TEXTS)
    local = openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=key, max_retries=0)
    expected = np.array(
        [d.embedding for d in local.embeddings.create(model=embedded, input=TEXTS).data]
    )
    vectors = np.array([d.embedding for d in remote.data])
    assert vectors.shape == (3, 384) and np.abs(vectors - expected).max() < 1e-6
    # Token ids go to a worker as they are.
    tokenizer = Tokenizer.from_file(str(minilm_path / "tokenizer.json"))
    tokenizer.no_padding()
    ids = tokenizer.encode(TEXTS[0]).ids
    by_ids = client_for(layout, key).embeddings.create(model=embedded, input=ids)
    assert np.abs(np.array(by_ids.data[0].embedding) - vectors[0]).max() < 1e-6
    # The workers ran the model, not the web process: their beats count every token of both.
    layout.wait_for(
        lambda: tokens_embedded(layout, embedded) - before == remote.usage.prompt_tokens + len(ids),
        "the workers' beats to count the tokens",
    )
    rows = finished_rows(3)
    assert [r.status for r in rows] == [UsageRecord.Status.COMPLETED] * 3
    assert {r.endpoint for r in rows} == {"embeddings"}


def test_a_client_that_leaves_stops_its_embedding_on_the_worker(layout, embedded, key):
    """2048 inputs, 32 forwards' worth; the client leaves once a worker's beats count the first.
    The web process asks the worker to stop, the worker stops the job between forwards and
    answers with the tokens computed: the row bills those, and no more are computed after."""
    large = [[101, 2000 + i % 500, 102] for i in range(2048)]
    before = tokens_embedded(layout, embedded)
    leaving = post_and_keep_open(layout.url, {"model": embedded, "input": large}, key)
    try:
        layout.wait_for(lambda: tokens_embedded(layout, embedded) > before, "a first forward")
    finally:
        leaving.close()
    [row] = finished_rows(1)
    assert (row.status, row.error_code) == ("cancelled", "client_disconnected")
    assert 0 < row.prompt_tokens < 3 * len(large)
    layout.wait_for(lambda: not layout.running(embedded), "the worker to let go of it", 10)
    assert tokens_embedded(layout, embedded) - before == row.prompt_tokens


def test_a_worker_answers_bad_calls_with_errors_and_keeps_serving(layout, embedded):
    from channels_redis.core import RedisChannelLayer

    from inference.workers.wire import worker_channel

    channel_layer = RedisChannelLayer(hosts=[{"address": REDIS_URL, "socket_timeout": 15}])
    calls = {
        "vocab": ("embed", {"model": embedded, "token_ids": [[101, 99999, 102]]}),
        "ids": ("embed", {"model": embedded, "token_ids": "not token ids"}),
        "texts": ("tokenize", {"model": embedded, "texts": [1, 2]}),
        "chat": ("embed", {"model": TINY, "token_ids": [[1]]}),
        "op": ("nope", {}),
        "args": ("embed", ["not", "a", "mapping"]),
        "good": ("embed", {"model": embedded, "token_ids": [[101, 7592, 102]]}),
    }

    target = layout.live(embedded)[0]

    async def exchange() -> dict:
        worker = worker_channel(layout.namespace, target)
        reply = await channel_layer.new_channel("test.reply")
        await channel_layer.send(worker, {"type": "call", "op": "embed"})  # no one to answer
        for call_id, (op, args) in calls.items():
            message = {"type": "call", "op": op, "args": args, "reply": reply, "call_id": call_id}
            await channel_layer.send(worker, message)
        results: dict = {}
        async with asyncio.timeout(30):
            while len(results) < len(calls):
                events = (await channel_layer.receive(reply))["events"]
                results.update({ident: payload for kind, ident, payload in events if kind == "res"})
        return results

    results = asyncio.run(exchange())
    kinds = {name: result["error"]["kind"] for name, result in results.items() if name != "good"}
    assert kinds == {
        "vocab": "invalid",
        "ids": "invalid",
        "texts": "invalid",
        "chat": "not_loaded",
        "op": "engine",
        "args": "engine",
    }
    vectors = np.frombuffer(results["good"]["value"]["vectors"], dtype="<f4")
    assert results["good"]["value"]["shape"] == [1, 384] and vectors.shape == (384,)
    assert abs(np.linalg.norm(vectors) - 1.0) < 1e-5
    assert layout.workers[target].poll() is None and target in layout.serving(embedded)


def test_a_worker_that_stops_mid_call_fails_the_request_with_a_503(layout, embedded, key):
    stopped = layout.live(embedded)  # whichever the request goes to
    for name in stopped:
        layout.workers[name].send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        response = httpx.post(
            f"{layout.url}/v1/embeddings",
            json={"model": embedded, "input": [101, 7592, 102]},
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        )
        took = time.monotonic() - started
    finally:
        for name in stopped:
            layout.workers[name].send_signal(signal.SIGCONT)
    assert response.status_code == 503, response.text
    assert "stopped responding" in response.json()["error"]["message"]
    assert took < TIMEOUT_S + 4  # noticed by its beats, not by a call's timeout
    assert [r.status for r in finished_rows(1)] == [UsageRecord.Status.FAILED]
    layout.wait_for(lambda: layout.serving(embedded) == stopped, "all to beat again")


def test_workers_follow_the_registry(layout, key):
    client = client_for(layout, key)
    # Disabled: both workers retire the model (its requests would finish first)...
    ModelEntry.objects.filter(name=TINY).update(enabled=False)
    nudge(layout)
    layout.wait_for(lambda: layout.serving(TINY) == [], "the workers to retire it")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=2)
    # ...enabled with another batch size: loaded again with the new spec, no restart.
    ModelEntry.objects.filter(name=TINY).update(enabled=True, max_num_seqs=4)
    nudge(layout)
    layout.wait_for(lambda: layout.serving(TINY) == layout.live(TINY), "the workers to serve it")
    specs = {b.models[TINY].spec["max_num_seqs"] for b in layout.beats().values()}
    assert specs == {4}
    reply = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=2)
    assert reply.usage.completion_tokens == 2


def test_a_worker_serves_only_the_models_it_is_given(layout, served, tiny_model_path, minilm_path):
    from engine.models.embeddings import DEFAULT_EMBEDDING_MODEL
    from inference.services.registry import model_register

    others = layout.live(TINY)
    model_register(name=TINY_SIMPLE, path=tiny_model_path, engine="simple")
    model_register(name=DEFAULT_EMBEDDING_MODEL, path=minilm_path, kind=ModelEntry.Kind.EMBEDDING)
    # The new worker reads the registry as it starts: three models enabled, one given. It stays,
    # serving beside the others (the tests below end a worker each).
    (given,) = layout.start_workers(1, models=[TINY])
    layout.wait_for(lambda: given in layout.serving(TINY), "it to serve the model it is given")
    beat = layout.beats()[given]
    assert beat.model_filter == [TINY]
    assert set(beat.models) == {TINY}
    assert layout.serving(TINY) == sorted([*others, given])


def test_sigterm_drains_a_worker(layout, key):
    client = client_for(layout, key)
    stream = client.chat.completions.create(
        model=TINY,
        messages=MESSAGES,
        max_tokens=200,
        extra_body={"ignore_eos": True},
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = []
    for chunk in stream:
        chunks.append(chunk)
        if len(chunks) == 3:
            layout.wait_for(lambda: layout.running(TINY), "the stream's worker to report it")
            (draining,) = layout.running(TINY)
            layout.workers[draining].send_signal(signal.SIGTERM)
            layout.wait_for(
                lambda w=draining: layout.beats()[w].draining, "the worker to say it drains"
            )
            # New requests go to the others while this one finishes its stream.
            reply = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=3)
            assert reply.usage.completion_tokens == 3
            assert layout.workers[draining].poll() is None
    # The stream ran to its end, untouched by the drain.
    assert chunks[-1].usage.completion_tokens == 200
    assert chunks[-2].choices[0].finish_reason == "length"
    assert layout.workers[draining].wait(timeout=30) == 0
    assert "stopped" in layout.log(draining)
    layout.wait_for(lambda: draining not in layout.beats(), "the beat to be removed", 5)
    rows = finished_rows(2)
    assert {r.status for r in rows} == {UsageRecord.Status.COMPLETED}


def test_a_worker_killed_mid_stream_fails_its_request_and_the_next_goes_elsewhere(layout, key):
    client = client_for(layout, key)
    stream = client.chat.completions.create(
        model=TINY,
        messages=MESSAGES,
        max_tokens=4000,
        extra_body={"ignore_eos": True},
        stream=True,
    )
    seen = 0
    started = None
    with pytest.raises(openai.APIError) as failure:
        for _chunk in stream:
            seen += 1
            if seen == 3:
                layout.wait_for(lambda: layout.running(TINY), "the stream's worker to report it")
                (victim,) = layout.running(TINY)
                layout.workers[victim].send_signal(signal.SIGKILL)
                started = time.monotonic()
    assert started is not None and time.monotonic() - started < 10
    assert "engine failed" in str(failure.value)

    rows = finished_rows(1)
    assert [r.status for r in rows] == [UsageRecord.Status.FAILED]
    assert 0 < rows[0].completion_tokens < 4000

    # The dead worker has left routing: the next request runs on the other one at once.
    reply = client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=5)
    assert reply.usage.completion_tokens == 5
    layout.wait_for(lambda: victim not in layout.beats(), "the dead worker's beat to expire", 10)
