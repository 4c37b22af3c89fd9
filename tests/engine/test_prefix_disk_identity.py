"""The prefix cache's disk tier in the engines, on a dense llama and a hybrid qwen3_next (float32:
docs/architecture.md): greedy output is token-identical with the tier on and off, batched; a
new engine over the same folder (a restart) finds what the last one kept; a full disk fails no
request; and the engine's stats show both tiers."""

import errno
import threading
from dataclasses import replace

import pytest

from engine.cache.disk import PrefixDiskConfig, files
from engine.core.batched import BatchedEngine
from engine.core.simple import SimpleEngine
from engine.protocol import GenerationOutput, GenerationRequest, ModelSpec
from tests.engine.conftest import drive, manual_engine, run_batched, run_simple
from tests.engine.test_prefix_identity import COLD, assert_same, request, tokens
from tests.fixtures.tiny_models import build_tiny_model

SYSTEM = 40
BLOCK = 16  # the system prompt: two whole blocks and an end of 8 tokens


@pytest.fixture
def model_path(tiny_model) -> str:
    """The tiny model's folder (the disk tier's entries are keyed by its files)."""
    model_type = "qwen3_next" if tiny_model.info.name == "tiny-next" else "llama"
    return str(build_tiny_model(model_type=model_type, tokenizer="qwen3"))


@pytest.fixture
def disk(tmp_path) -> PrefixDiskConfig:
    return PrefixDiskConfig(tmp_path / "prefix-cache", 10**9, block_tokens=BLOCK)


def conversation(vocab: int, count: int) -> list[GenerationRequest]:
    """`count` requests sharing a system prompt (a checkpoint at its end), each its own ask."""
    system = tokens(vocab, SYSTEM, seed=31)
    return [
        request(f"ask{i}", [*system, *tokens(vocab, 5 + 3 * i, seed=40 + i)], checkpoints=[SYSTEM])
        for i in range(count)
    ]


@pytest.mark.slow
def test_hits_read_back_from_disk_change_no_token_batched(tiny_model, model_path, disk):
    vocab = tiny_model.info.vocab_size
    first, *batch = conversation(vocab, 4)
    cold = run_batched(tiny_model, batch, **COLD)
    engine = manual_engine(tiny_model, BatchedEngine, path=model_path, prefix_disk=disk)
    drive(engine, [first])
    engine.prefix_cache.evict(engine.prefix_cache.nbytes)  # all of it to disk
    assert engine.prefix_cache.disk.flush(30)
    assert engine.prefix_cache.nbytes == 0
    warm = drive(engine, batch)  # admitted together: each one's hit read back from disk
    stats = engine.prefix_cache.stats()
    assert stats.disk_hits == len(batch) and stats.disk_read_errors == 0
    for ask in batch:
        assert warm.cached(ask.request_id) == SYSTEM  # a checkpoint on the hybrid model
        assert_same(warm, ask.request_id, cold, ask.request_id)
    # A resent prompt resumes one token before its end, read back as far as disk holds it.
    engine.prefix_cache.evict(engine.prefix_cache.nbytes)
    assert engine.prefix_cache.disk.flush(30)
    again = drive(engine, [replace(batch[0], request_id="again")])
    assert again.cached("again") == len(batch[0].prompt_token_ids) - 1
    assert_same(again, "again", cold, batch[0].request_id)
    engine.prefix_cache.close()


@pytest.mark.slow
def test_the_simple_engine_reads_back_from_disk_too(tiny_model, model_path, disk):
    vocab = tiny_model.info.vocab_size
    first, second = conversation(vocab, 2)
    cold = run_simple(tiny_model, [second], engine=manual_engine(tiny_model, SimpleEngine, **COLD))
    engine = manual_engine(tiny_model, SimpleEngine, path=model_path, prefix_disk=disk)
    run_simple(tiny_model, [first], engine=engine)
    engine.prefix_cache.evict(engine.prefix_cache.nbytes)
    assert engine.prefix_cache.disk.flush(30)
    warm = run_simple(tiny_model, [second], engine=engine)
    assert warm.cached("ask1") == SYSTEM and engine.prefix_cache.stats().disk_hits == 1
    assert_same(warm, "ask1", cold, "ask1")
    engine.prefix_cache.close()


def run_threaded(engine: BatchedEngine, requests: list[GenerationRequest]) -> dict:
    """Submit to a started engine and wait: each request's (cached tokens, token ids)."""
    results = {r.request_id: [None, []] for r in requests}
    done = threading.Semaphore(0)

    def emit_for(rid: str):
        def emit(output: GenerationOutput) -> None:
            if results[rid][0] is None:
                results[rid][0] = output.num_cached_tokens
            results[rid][1] += output.token_ids
            if output.finish_reason is not None:
                done.release()

        return emit

    for r in requests:
        engine.submit(r, emit_for(r.request_id))
    for _ in requests:
        assert done.acquire(timeout=120)
    return {rid: (cached, ids) for rid, (cached, ids) in results.items()}


@pytest.mark.slow
def test_a_restarted_engine_finds_what_the_last_one_kept(tiny_model, model_path, disk):
    vocab = tiny_model.info.vocab_size
    first, second = conversation(vocab, 2)
    cold = run_batched(tiny_model, [second], **COLD)

    def start() -> BatchedEngine:
        engine = BatchedEngine(ModelSpec(name="tiny", path=model_path), lambda: tiny_model)
        engine.prefix_disk = disk
        engine.start().result(timeout=120)
        return engine

    before = start()
    run_threaded(before, [first])
    assert before.stats().prefix_cache["disk_entries"] == 0  # nothing evicted yet
    before.stop()  # the engine ends: what its prefix cache holds goes to disk
    after = start()
    stats = after.stats().prefix_cache
    assert stats["disk_entries"] > 0 and stats["bytes"] == 0
    try:
        cached, ids = run_threaded(after, [second])["ask1"]
        assert cached == SYSTEM and ids == cold.tokens("ask1")
        stats = after.stats()
        assert stats.prefix_cache["disk_hits"] == 1 and stats.num_cached_prompt_tokens == SYSTEM
    finally:
        after.stop()


@pytest.mark.slow
def test_a_full_disk_fails_no_request(tiny_model, model_path, disk, monkeypatch):
    def full(out, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "_write", full)
    vocab = tiny_model.info.vocab_size
    first, second = conversation(vocab, 2)
    cold = run_batched(tiny_model, [first, second], **COLD)
    engine = manual_engine(tiny_model, BatchedEngine, path=model_path, prefix_disk=disk)
    drive(engine, [first])
    engine.prefix_cache.evict(engine.prefix_cache.nbytes)
    assert engine.prefix_cache.disk.flush(30)
    warm = drive(engine, [second])  # nothing on disk: computed again, the same tokens
    assert warm.cached("ask1") == 0
    assert_same(warm, "ask1", cold, "ask1")
    stats = engine.prefix_cache.stats()
    assert (stats.disk_spilling, stats.disk_write_errors, stats.disk_entries) == (0, 1, 0)
    assert not list(disk.root.rglob("*" + files.SUFFIX))
    engine.prefix_cache.close()
