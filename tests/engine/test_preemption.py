"""Preemption (engine/core/scheduler.py): a lower tier's sequences taken out of a full batch for a
higher tier's request resume with token-identical greedy output, on a dense llama and on a
hybrid qwen3_next, with the prefix cache keeping what they computed or without one."""

import random
from dataclasses import replace

import pytest

from engine.core.batched import BatchedEngine
from engine.protocol import GenerationRequest, ServiceClass
from tests.engine.conftest import drive, greedy, manual_engine, run_batched
from tests.engine.test_prefix_identity import assert_same

MAX_TOKENS = 12


def request(rid: str, prompt: list[int], tier: str, tenant: str) -> GenerationRequest:
    params = greedy(MAX_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=5)
    service = ServiceClass(tenant=tenant, tier=tier)
    return GenerationRequest(rid, "tiny", tuple(prompt), params, service=service)


def prompt(vocab: int, count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, vocab - 1000) for _ in range(count)]


@pytest.mark.parametrize("prefix_cache", [True, False], ids=["cache-kept", "recomputed"])
def test_preempted_sequences_resume_token_for_token(tiny_model, prefix_cache):
    vocab = tiny_model.info.vocab_size
    flex = [request(f"f{i}", prompt(vocab, 9 + 3 * i, seed=i), "flex", "A") for i in range(3)]
    urgent = [request(f"p{i}", prompt(vocab, 6, seed=10 + i), "priority", "B") for i in range(2)]
    spec = {"max_num_seqs": 3, "tier_min_share": 0.0}
    if not prefix_cache:
        spec["prefix_cache_bytes"] = 0
    alone = {
        r.request_id: run_batched(tiny_model, [replace(r, service=ServiceClass())], **spec)
        for r in [*flex, *urgent]
    }
    engine = manual_engine(tiny_model, BatchedEngine, **spec)
    # The flex requests fill the batch and decode a few tokens; the priority ones arrive.
    together = drive(engine, [*flex, *urgent], join_at=[0, 0, 0, 4, 6])
    assert engine.scheduler.num_preemptions >= 2
    for req in [*flex, *urgent]:
        rid = req.request_id
        assert_same(together, rid, alone[rid], rid)
        assert together.finish_reason(rid) == "length"
        # cached_tokens reports the caller's prompt hits, never a resumed request's own state.
        assert together.cached(rid) == alone[rid].cached(rid) == 0
    if prefix_cache:
        hits = engine.prefix_cache.stats().hit_tokens
        assert hits >= 2 * 9, "the preempted sequences found their state in the prefix cache"


def test_a_request_preempted_while_its_prompt_is_prefilled_in_chunks_resumes(tiny_model):
    vocab = tiny_model.info.vocab_size
    flex = [request(f"f{i}", prompt(vocab, 30, seed=20 + i), "flex", "A") for i in range(2)]
    urgent = request("p", prompt(vocab, 5, seed=30), "priority", "B")
    spec = {"max_num_seqs": 1, "max_num_batched_tokens": 8, "tier_min_share": 0.0}
    alone = {
        r.request_id: run_batched(tiny_model, [replace(r, service=ServiceClass())], **spec)
        for r in [*flex, urgent]
    }
    engine = manual_engine(tiny_model, BatchedEngine, **spec)
    together = drive(engine, [*flex, urgent], join_at=[0, 0, 2])
    assert engine.scheduler.num_preemptions >= 1
    for req in [*flex, urgent]:
        assert_same(together, req.request_id, alone[req.request_id], req.request_id)


@pytest.mark.parametrize(("yield_share", "flex_rows"), [(0.5, 2), (1.0, 3)])
def test_the_specs_flex_yield_share_is_what_a_batch_keeps_beside_interactive_work(
    tiny_model, yield_share, flex_rows
):
    """ModelSpec.flex_yield_share (ORCHARD_FLEX_YIELD_SHARE) reaches the engine's scheduler:
    4 flex rows fill the batch, a default request comes; the flex tier keeps half the rows, or
    (1: no yielding) every row but the one the default request needs."""
    vocab = tiny_model.info.vocab_size
    spec = {"max_num_seqs": 4, "tier_min_share": 0.0, "flex_yield_share": yield_share}
    engine = manual_engine(tiny_model, BatchedEngine, **spec)
    flex = [request(f"f{i}", prompt(vocab, 8, seed=40 + i), "flex", "A") for i in range(4)]
    for req in flex:
        engine.scheduler.add(engine.make_request(req, lambda output: None))
    engine.step()
    engine.step()
    urgent = request("d", prompt(vocab, 6, seed=50), "default", "B")
    engine.scheduler.add(engine.make_request(urgent, lambda output: None))
    engine.step()
    running = {r.request_id: r.service.tier for r in engine.scheduler.running}
    assert list(running.values()).count("flex") == flex_rows
    assert "d" in running
