"""Greedy and seeded output do not depend on what else runs (docs/architecture.md, invariants).

Float32 tiny models: a flipped token means a real bug, not rounding (docs/architecture.md). Each
test runs on a dense llama and on a hybrid qwen3_next (ArraysCache + KVCache layers).
"""

import random
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from engine.core.batched import BatchedEngine
from engine.core.runner import BatchRunner
from engine.core.scheduler import Scheduler
from engine.protocol import SamplingParams
from tests.engine.conftest import (
    Collector,
    greedy,
    make_request,
    manual_engine,
    run_batched,
    run_simple,
)

MAX_TOKENS = 10


def prompts(count: int, vocab_size: int, *, short: tuple[int, ...] = (1, 2)) -> list[list[int]]:
    """Prompts of 3, 8, 13, ... tokens, except that those at the positions in `short` have one
    and two tokens: a one-token prompt has no body to prefill and joins the batch on its own."""
    rng = random.Random(1234)
    lengths = [3 + 5 * i for i in range(count)]
    for position, length in zip(short, (1, 2), strict=False):
        if position < count:
            lengths[position] = length
    return [[rng.randrange(1000, vocab_size - 1000) for _ in range(n)] for n in lengths]


def assert_same_events(ours, theirs) -> None:
    """The same outputs, with log-probabilities equal to float32 rounding: a step's batch shape
    (which rows ran ahead) changes the order of summation, not a token."""

    def exact(outputs):
        return [
            replace(
                o,
                logprobs=tuple(
                    (lp.token_id, tuple(t.token_id for t in lp.top_logprobs))
                    for lp in o.logprobs or ()
                ),
            )
            for o in outputs
        ]

    def values(outputs):
        return [
            value
            for o in outputs
            for lp in o.logprobs or ()
            for value in (lp.logprob, *(t.logprob for t in lp.top_logprobs))
        ]

    assert exact(ours) == exact(theirs)
    assert values(ours) == pytest.approx(values(theirs), abs=1e-5)


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


@pytest.mark.slow
def test_running_ahead_changes_nothing(tiny_llama, monkeypatch):
    """Steps started before the previous tokens reach the host give the same tokens and
    logprobs, also when rows finish at different steps, need min_tokens, or use penalties."""
    batch = prompts(6, tiny_llama.info.vocab_size)
    variants = [
        greedy(4, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=1, max_tokens=9, min_tokens=5, n=2),
        greedy(7, logprobs=True, top_logprobs=2),
        SamplingParams(temperature=1.2, seed=2, top_k=20, max_tokens=MAX_TOKENS, ignore_eos=True),
        greedy(MAX_TOKENS, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(temperature=0.5, seed=3, max_tokens=3),
    ]
    requests = [
        make_request(f"a{i}", p, v) for i, (p, v) in enumerate(zip(batch, variants, strict=True))
    ]
    join_at = [0, 0, 1, 4, 4, 6]
    ahead_steps = []
    original = BatchRunner.execute

    def spy(self, plan, *, run_ahead=False):
        ahead_steps.append(self._ahead is not None)
        return original(self, plan, run_ahead=run_ahead)

    monkeypatch.setattr(BatchRunner, "execute", spy)
    monkeypatch.setattr(BatchedEngine, "RUN_AHEAD", True)  # off by default on the CPU backend
    ahead = run_batched(tiny_llama, requests, join_at=join_at)
    assert sum(ahead_steps) >= 3, "some decode steps ran ahead"
    monkeypatch.setattr(Scheduler, "decodes_only_after", lambda self, plan: False)
    ahead_steps.clear()
    lockstep = run_batched(tiny_llama, requests, join_at=join_at)
    assert not any(ahead_steps)
    for request in requests:
        for index in range(request.sampling.n):
            key = (request.request_id, index)
            assert_same_events(ahead.events[key], lockstep.events[key])


@pytest.mark.slow
def test_prompts_prefilled_together_match_prompts_prefilled_alone(tiny_model, monkeypatch):
    batch = prompts(4, tiny_model.info.vocab_size, short=())
    requests = [
        make_request(f"t{i}", p, greedy(6, ignore_eos=True, n=2 if i == 1 else 1))
        for i, p in enumerate(batch)
    ]
    together = []
    original = BatchRunner._prefill_together

    def spy(self, group):
        together.append(len(group))
        return original(self, group)

    monkeypatch.setattr(BatchRunner, "_prefill_together", spy)
    batched = run_batched(tiny_model, requests)
    assert together == [4], "one padded prefill of all four prompts"
    for request in requests:
        rid = request.request_id
        alone = run_batched(tiny_model, [replace(request, sampling=replace(request.sampling, n=1))])
        for index in range(request.sampling.n):
            assert batched.tokens(rid, index) == alone.tokens(rid), (rid, index)


@pytest.mark.slow
def test_one_token_prompt_admitted_with_longer_ones_changes_no_row(tiny_model):
    """The hardening regression: prompts of 4, 1 and 3 tokens admitted in one step used to trip
    the runner's row order (the one-token prompt joins before the ones prefilled together) and
    fail the whole batch."""
    vocab = tiny_model.info.vocab_size
    rng = random.Random(7)
    batch = [[rng.randrange(1000, vocab - 1000) for _ in range(n)] for n in (4, 1, 3, 1)]
    requests = [
        make_request(f"o{i}", p, greedy(MAX_TOKENS, ignore_eos=True)) for i, p in enumerate(batch)
    ]
    together = run_batched(tiny_model, requests)
    staggered = run_batched(tiny_model, requests, join_at=[0, 0, 0, 3])
    for request, prompt in zip(requests, batch, strict=True):
        rid = request.request_id
        expected = mlx_lm_greedy(tiny_model, prompt, MAX_TOKENS)
        assert together.tokens(rid) == expected, rid
        assert staggered.tokens(rid) == expected, rid
        assert together.finish_reason(rid) == "length"


def test_a_prompts_last_logits_are_projected_alone_and_equal_the_models_own(tiny_model):
    from engine.cache.mlx_caches import make_cache
    from engine.core.forward import last_logits

    model = tiny_model.model
    forward = last_logits(model)
    assert forward.__name__ == "split"  # the backbone-then-head path was verified and taken
    tokens = mx.array([[5, 6, 7, 8, 9], [10, 11, 12, 13, 14]])
    got = forward(tokens, make_cache(model), [4, 2])
    full = model(tokens, cache=make_cache(model))
    assert mx.allclose(got[0], full[0, 4], atol=1e-5) and mx.allclose(got[1], full[1, 2], atol=1e-5)


def test_the_runner_times_each_steps_prefill_alone_for_the_pacer(tiny_llama):
    engine = manual_engine(tiny_llama)
    collector = Collector()
    for i, length in enumerate((40, 3)):
        request = make_request(f"r{i}", range(1000, 1000 + length), greedy(3, ignore_eos=True))
        engine.scheduler.add(engine.make_request(request, collector.emit_for(request.request_id)))
    engine.step()  # both prompts prefill (and sample their first tokens)
    assert engine.runner.prefill_seconds is not None and engine.runner.prefill_seconds > 0
    engine.step()  # decode only
    assert engine.runner.prefill_seconds is None
