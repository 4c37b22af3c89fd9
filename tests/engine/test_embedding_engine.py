"""EmbeddingEngine (engine/core/embedding.py) on the real all-MiniLM-L6-v2: concurrent requests
share forwards and get their own rows, bad inputs fail their own request only, a drain finishes
what is queued and a stop fails it, the stats count what ran, a cancelled job stops before the
next forward with the count of what it computed, and a small request never waits for a large
one's forwards."""

import concurrent.futures
import threading

import numpy as np
import pytest

from engine.core.embedding import MAX_BATCH_SEQUENCES, EmbeddingEngine
from engine.models.embeddings import EmbeddingModel
from engine.protocol import InvalidRequestError, ModelNotLoadedError, ModelSpec

SENTENCES = [
    "A man is playing a guitar.",
    "Someone is playing an instrument.",
    "The stock market fell sharply today.",
    "Ünïcode, emoji 🎸 and punctuation!? all tokenize.",
]
SPEC = ModelSpec("minilm", "unused", kind="embedding")


@pytest.fixture(scope="module")
def model(minilm_path) -> EmbeddingModel:
    return EmbeddingModel(minilm_path)


@pytest.fixture
def engine(model):
    engine = EmbeddingEngine(SPEC, lambda: model)
    assert engine.start().result(timeout=60) == model.info
    yield engine
    engine.stop(10)


def test_concurrent_requests_share_forwards_and_get_their_own_rows(engine, model):
    requests = [model.tokenize([s]) for s in SENTENCES] * 8
    futures = [engine.submit(ids).future for ids in requests]
    concurrent.futures.wait(futures, timeout=60)
    alone = {tuple(ids[0]): model.embed(ids)[0] for ids in requests[:4]}
    for ids, future in zip(requests, futures, strict=True):
        assert np.abs(future.result()[0] - alone[tuple(ids[0])]).max() < 1e-5
    assert engine.num_forwards < len(requests) // 2  # queued requests ran together
    stats = engine.stats()
    assert stats.num_prompt_tokens == sum(len(ids[0]) for ids in requests)
    assert (stats.num_steps, stats.num_waiting, stats.num_running) == (engine.num_forwards, 0, 0)


@pytest.mark.parametrize(
    "token_ids",
    [[[30522]], [[-1]], [[]], [[1.5]], [["a"]], [[[1, 2]]], ["abc"], [list(range(1, 258))], []],
)
def test_bad_inputs_fail_their_own_request_and_the_engine_goes_on(engine, model, token_ids):
    good = model.tokenize(SENTENCES[:1])
    futures = [engine.submit(ids).future for ids in (good, token_ids, good)]
    with pytest.raises(InvalidRequestError):
        futures[1].result(timeout=30)
    assert np.array_equal(futures[0].result(timeout=30), futures[2].result(timeout=30))
    assert engine.is_serving and engine.is_alive()


def test_a_drain_finishes_what_is_queued_and_a_stop_fails_it(model):
    drained = EmbeddingEngine(SPEC, lambda: model)
    drained.start().result(timeout=60)
    futures = [drained.submit(model.tokenize(SENTENCES)).future for _ in range(20)]
    drained.drain()
    assert not drained.is_serving
    assert all(f.result(timeout=60).shape == (4, 384) for f in futures)
    # `ended` resolves as the thread's last act: the thread itself is gone a moment later.
    assert drained.ended.result(timeout=10) is None
    drained._thread.join(timeout=10)
    assert not drained.is_alive()
    with pytest.raises(ModelNotLoadedError, match="replaced or retired"):
        drained.submit(model.tokenize(["late"])).future.result(timeout=5)

    stopped = EmbeddingEngine(SPEC, lambda: model)
    stopped.start().result(timeout=60)
    jobs = [stopped.submit(model.tokenize(SENTENCES)) for _ in range(200)]
    futures = [job.future for job in jobs]
    stopped.stop(10)
    # What ran has its vectors; the rest failed at once rather than wait for a thread gone.
    assert all(f.done() for f in futures) and not stopped.is_alive()
    assert not stopped.has_requests()
    failed = [f for f in futures if f.exception() is not None]
    assert failed and all(isinstance(f.exception(), ModelNotLoadedError) for f in failed)
    assert all(f.result().shape == (4, 384) for f in futures if f not in failed)
    # The engine let go of each job, with the count of what it computed: all of it for those
    # with their vectors.
    tokens = sum(map(len, model.tokenize(SENTENCES)))
    counts = [job.ended.result(timeout=1) for job in jobs]
    assert all(0 <= count <= tokens for count in counts)
    assert all(c == tokens for c, f in zip(counts, futures, strict=True) if f not in failed)


class Gated:
    """The model, its forwards' sizes recorded; the first forward, done, waits for `go`."""

    def __init__(self, model: EmbeddingModel):
        self.model = model
        self.info = model.info
        self.forwards: list[int] = []
        self.first_done = threading.Event()
        self.go = threading.Event()

    def embed(self, rows, between=None):
        vectors = self.model.embed(rows, between)
        self.forwards.append(len(rows))
        if len(self.forwards) == 1:
            self.first_done.set()
            self.go.wait(30)
        return vectors


@pytest.fixture
def gated(model):
    gated = Gated(model)
    engine = EmbeddingEngine(SPEC, lambda: gated)
    engine.start().result(timeout=60)
    yield gated, engine
    gated.go.set()
    engine.stop(10)


def rows(count: int, length: int) -> list[list[int]]:
    return [[101, *(2000 + (i + j) % 500 for j in range(length - 2)), 102] for i in range(count)]


def test_a_cancelled_job_stops_before_the_next_forward_and_counts_what_it_computed(gated):
    gated, engine = gated
    job = engine.submit(rows(3 * MAX_BATCH_SEQUENCES, 3))  # three forwards' worth
    assert gated.first_done.wait(30)
    assert job.future.cancel()  # what asyncio does when the task awaiting it is cancelled
    gated.go.set()
    # The forward under way counts; none runs after it.
    assert job.ended.result(timeout=30) == job.num_computed_tokens == MAX_BATCH_SEQUENCES * 3
    assert gated.forwards == [MAX_BATCH_SEQUENCES] and engine.num_forwards == 1
    later = engine.submit(rows(2, 3))
    assert later.future.result(timeout=30).shape == (2, 384)
    assert later.ended.result(timeout=1) == 6
    assert engine.stats().num_running == 0 and not engine.has_requests()


def test_a_small_request_takes_its_turn_between_a_large_ones_forwards(gated, model):
    gated, engine = gated
    large = engine.submit(rows(4 * MAX_BATCH_SEQUENCES, 3))  # four forwards' worth
    assert gated.first_done.wait(30)
    small_ids = rows(1, 6)
    small = engine.submit(small_ids)
    forwards_when_done = {}
    for name, job in (("small", small), ("large", large)):
        job.future.add_done_callback(
            lambda _, n=name: forwards_when_done.setdefault(n, len(gated.forwards))
        )
    gated.go.set()
    # The next forward was the small one's (with the large one's rows beside it).
    assert np.abs(small.future.result(timeout=30)[0] - model.embed(small_ids)[0]).max() < 1e-5
    assert large.future.result(timeout=60).shape == (4 * MAX_BATCH_SEQUENCES, 384)
    assert forwards_when_done == {"small": 2, "large": len(gated.forwards)}
    assert len(gated.forwards) >= 5
