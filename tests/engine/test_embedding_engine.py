"""EmbeddingEngine (engine/core/embedding.py) on the real all-MiniLM-L6-v2: concurrent requests
share forwards and get their own rows, bad inputs fail their own request only, a drain finishes
what is queued and a stop fails it, and the stats count what ran."""

import concurrent.futures

import numpy as np
import pytest

from engine.core.embedding import EmbeddingEngine
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
    futures = [engine.submit(ids) for ids in requests]
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
    futures = [engine.submit(good), engine.submit(token_ids), engine.submit(good)]
    with pytest.raises(InvalidRequestError):
        futures[1].result(timeout=30)
    assert np.array_equal(futures[0].result(timeout=30), futures[2].result(timeout=30))
    assert engine.is_serving and engine.is_alive()
    with pytest.raises(InvalidRequestError):
        engine.tokenize([1, 2])


def test_a_drain_finishes_what_is_queued_and_a_stop_fails_it(model):
    drained = EmbeddingEngine(SPEC, lambda: model)
    drained.start().result(timeout=60)
    futures = [drained.submit(model.tokenize(SENTENCES)) for _ in range(20)]
    drained.drain()
    assert not drained.is_serving
    assert all(f.result(timeout=60).shape == (4, 384) for f in futures)
    # `ended` resolves as the thread's last act: the thread itself is gone a moment later.
    assert drained.ended.result(timeout=10) is None
    drained._thread.join(timeout=10)
    assert not drained.is_alive()
    with pytest.raises(ModelNotLoadedError, match="replaced or retired"):
        drained.submit(model.tokenize(["late"])).result(timeout=5)

    stopped = EmbeddingEngine(SPEC, lambda: model)
    stopped.start().result(timeout=60)
    futures = [stopped.submit(model.tokenize(SENTENCES)) for _ in range(200)]
    stopped.stop(10)
    # What ran has its vectors; the rest failed at once rather than wait for a thread gone.
    assert all(f.done() for f in futures) and not stopped.is_alive()
    assert not stopped.has_requests()
    failed = [f for f in futures if f.exception() is not None]
    assert failed and all(isinstance(f.exception(), ModelNotLoadedError) for f in failed)
    assert all(f.result().shape == (4, 384) for f in futures if f not in failed)
