"""Greedy and seeded output do not depend on what else runs (ARCHITECTURE.md invariants).

Float32 tiny models: a flipped token means a real bug, not rounding (FACTS.md). Each test runs on
a dense llama and on a hybrid qwen3_next (ArraysCache + KVCache layers).
"""

import random
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from engine.protocol import SamplingParams
from tests.engine.conftest import greedy, make_request, run_batched, run_simple

MAX_TOKENS = 10


def prompts(count: int, vocab_size: int) -> list[list[int]]:
    rng = random.Random(1234)
    return [
        [rng.randrange(1000, vocab_size - 1000) for _ in range(3 + 5 * i)] for i in range(count)
    ]


def mlx_lm_greedy(loaded, prompt: list[int], max_tokens: int) -> list[int]:
    steps = generate_step(
        mx.array(prompt),
        loaded.model,
        max_tokens=max_tokens,
        sampler=lambda x: mx.argmax(x, axis=-1),
    )
    return [int(token) for token, _ in steps]


@pytest.mark.slow
def test_greedy_is_identical_alone_batched_chunked_and_simple(tiny_model):
    batch = prompts(10, tiny_model.info.vocab_size)
    requests = [
        make_request(f"r{i}", p, greedy(MAX_TOKENS, ignore_eos=True)) for i, p in enumerate(batch)
    ]

    alone = {r.request_id: run_batched(tiny_model, [r]).tokens(r.request_id) for r in requests}
    # Ten requests joining at different steps; a 16-token budget splits the longer prompts
    # into prefill chunks that run alongside other requests' decode steps.
    batched = run_batched(
        tiny_model, requests, join_at=[0, 0, 1, 2, 3, 3, 5, 8, 9, 12], max_num_batched_tokens=16
    )
    simple = run_simple(tiny_model, requests)

    for request, prompt in zip(requests, batch, strict=True):
        rid = request.request_id
        assert alone[rid] == mlx_lm_greedy(tiny_model, prompt, MAX_TOKENS), rid
        assert batched.tokens(rid) == alone[rid], rid
        assert simple.tokens(rid) == alone[rid], rid
        assert batched.finish_reason(rid) == "length"


@pytest.mark.slow
def test_seeded_sampling_is_identical_alone_and_batched(tiny_model):
    batch = prompts(6, tiny_model.info.vocab_size)
    seeded = SamplingParams(
        temperature=0.9, top_p=0.95, max_tokens=MAX_TOKENS, ignore_eos=True, n=2
    )
    requests = [
        make_request(
            f"s{i}",
            p,
            greedy(MAX_TOKENS, ignore_eos=True) if i % 3 == 0 else replace(seeded, seed=i),
        )
        for i, p in enumerate(batch)
    ]
    alone = {r.request_id: run_batched(tiny_model, [r]) for r in requests}
    batched = run_batched(tiny_model, requests, join_at=[0, 1, 1, 2, 4, 6])
    for request in requests:
        rid = request.request_id
        for index in range(request.sampling.n):
            assert batched.tokens(rid, index) == alone[rid].tokens(rid, index), (rid, index)
    assert alone["s1"].tokens("s1", 0) != alone["s1"].tokens("s1", 1), "choices use their own keys"
    again = run_batched(tiny_model, [requests[1]])
    assert again.tokens("s1", 1) == alone["s1"].tokens("s1", 1)
