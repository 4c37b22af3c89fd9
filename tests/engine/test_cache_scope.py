"""The engines keep the prefix cache per scope (GenerationRequest.cache_scope): a request never
reuses what another scope's requests computed, on a dense and a hybrid model, batched and
simple; within its scope it does, and a hit changes no token."""

import random

import pytest

from engine.core.batched import BatchedEngine
from engine.core.simple import SimpleEngine
from engine.protocol import GenerationRequest
from tests.engine.conftest import drive, greedy, manual_engine, run_simple

SYSTEM = 40


def tokens(vocab: int, count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, vocab - 1000) for _ in range(count)]


@pytest.mark.parametrize("engine_class", [BatchedEngine, SimpleEngine])
def test_a_request_reuses_only_what_its_own_scope_computed(tiny_model, engine_class):
    vocab = tiny_model.info.vocab_size
    system = tokens(vocab, SYSTEM, seed=21)

    def request(rid: str, seed: int, scope: str) -> GenerationRequest:
        prompt = (*system, *tokens(vocab, 6, seed=seed))
        return GenerationRequest(rid, "tiny", prompt, greedy(4), (SYSTEM,), scope)

    engine = manual_engine(tiny_model, engine_class)

    def run(request: GenerationRequest):
        if engine_class is SimpleEngine:
            return run_simple(tiny_model, [request], engine=engine)
        return drive(engine, [request])

    run(request("a1", seed=22, scope="team:1"))
    other_team = run(request("b1", seed=23, scope="team:2"))
    assert other_team.cached("b1") == 0  # team 1's system prompt: not reused, not timed
    same_team = run(request("a2", seed=23, scope="team:1"))
    assert same_team.cached("a2") == SYSTEM  # a checkpoint on the hybrid model
    assert same_team.tokens("a2") == other_team.tokens("b1")
    # Team 2's own prompt, resent: its own entry.
    again = run(request("b2", seed=23, scope="team:2"))
    assert again.cached("b2") == SYSTEM + 6 - 1
    assert again.tokens("b2") == other_team.tokens("b1")
    stats = engine.prefix_cache.stats()
    assert stats.hits == 2 and stats.hit_tokens == SYSTEM + SYSTEM + 6 - 1
