"""Speculative decoding by prompt lookup (engine/core/speculative.py): the drafter, the policy, and
outputs identical with and without speculation (greedy, seeded sampling, logprobs, stops)."""

import random
from dataclasses import replace

import pytest

from engine.core.batched import BatchedEngine
from engine.core.speculative import NgramDrafter, Speculator
from engine.protocol import SamplingParams
from tests.engine.conftest import drive, greedy, make_request, manual_engine, run_batched
from tests.engine.test_identity import assert_same_events


def test_drafter_proposes_what_followed_the_latest_longest_match():
    drafter = NgramDrafter(min_ngram=2, max_ngram=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 4, 6, 7]
    # The suffix (6, 7) last occurred ending at 6 (then 9, 4, ...); (4, 6, 7) never did.
    assert drafter.propose(tokens, 3) == (9, 4, 6)
    # Longer matches win over more recent shorter ones: (5, 6, 7) -> 8.
    assert drafter.propose([*tokens, 2, 5, 6, 7], 2) == (8, 1)
    assert drafter.propose([1, 2, 3, 4], 4) == ()  # no earlier occurrence
    assert drafter.propose([1, 2, 1, 2], 0) == ()
    # The suffix is never its own match; a draft stops at the end of what is known.
    assert NgramDrafter(min_ngram=2, max_ngram=4).propose([3, 3, 3], 5) == (3,)


def test_drafter_index_is_incremental():
    rng = random.Random(7)
    tokens = [rng.randrange(6) for _ in range(300)]
    drafter = NgramDrafter(min_ngram=2, max_ngram=4)
    for end in range(2, len(tokens)):
        fresh = NgramDrafter(min_ngram=2, max_ngram=4).propose(tokens[:end], 4)
        assert drafter.propose(tokens[:end], 4) == fresh, end


def _repeating_prompts(vocab_size: int, count: int) -> list[list[int]]:
    rng = random.Random(5)
    out = []
    for i in range(count):
        unit = [rng.randrange(1000, vocab_size - 1000) for _ in range(4 + i)]
        out.append(unit * 3 + unit[: 1 + i % 3])
    return out


def _run(loaded, requests, join_at, speculative_tokens, **kwargs):
    engine = manual_engine(loaded, BatchedEngine, speculative_tokens=speculative_tokens, **kwargs)
    if engine.speculator is not None:
        engine.speculator.adaptive = False  # drafts whatever the step times say
        engine.speculator.max_rows = 64  # and at any batch size: the mechanism is tested
    return engine, drive(engine, requests, join_at)


@pytest.mark.slow
def test_outputs_are_identical_with_and_without_speculation(tiny_llama, monkeypatch):
    """Greedy, seeded top-p sampling with logprobs, n=2, a stop token and penalties (which
    never draft) in one batch, joining at different steps: the same events with drafts of up
    to 4 tokens as without, while drafts are really accepted and rejected."""
    vocab = tiny_llama.info.vocab_size
    batch = _repeating_prompts(vocab, 6)
    seeded = SamplingParams(
        temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True, logprobs=True
    )
    params = [
        greedy(24, ignore_eos=True),
        replace(seeded, seed=11, n=2),
        greedy(24, ignore_eos=True, logprobs=True, top_logprobs=2),
        replace(seeded, seed=3, temperature=1.5, logprobs=False),
        greedy(24, ignore_eos=True, frequency_penalty=0.5),
        greedy(17, ignore_eos=True),
    ]
    requests = [
        make_request(f"r{i}", p, q) for i, (p, q) in enumerate(zip(batch, params, strict=True))
    ]
    join_at = [0, 0, 1, 3, 3, 6]
    _, off = _run(tiny_llama, requests, join_at, 0)
    engine, on = _run(tiny_llama, requests, join_at, 4)
    for request in requests:
        for index in range(request.sampling.n):
            key = (request.request_id, index)
            assert_same_events(on.events[key], off.events[key])
    speculator = engine.speculator
    assert speculator.num_accepted > 0
    assert speculator.num_accepted < speculator.num_drafted, "some drafts are rejected"
    assert engine.scheduler.speculator is speculator
    # Where the device overlaps (Metal, CUDA) steps without drafts run ahead: mixed with
    # drafted steps, still the same events.
    monkeypatch.setattr(BatchedEngine, "RUN_AHEAD", True)
    engine, ahead = _run(tiny_llama, requests, join_at, 4)
    assert engine.overlaps
    for request in requests:
        for index in range(request.sampling.n):
            key = (request.request_id, index)
            assert_same_events(ahead.events[key], off.events[key])
    assert engine.speculator.num_accepted > 0


@pytest.mark.slow
def test_a_stop_inside_an_accepted_draft_ends_the_sequence_there(tiny_llama):
    vocab = tiny_llama.info.vocab_size
    prompt = _repeating_prompts(vocab, 1)[0]
    free = run_batched(tiny_llama, [make_request("a", prompt, greedy(30, ignore_eos=True))])
    # The tiny model repeats itself, so drafts are accepted; a stop string of its first
    # seven tokens' text ends the sequence in the middle of an accepted draft.
    stop = free.text("a")[: len(tiny_llama.tokenizer.decode(free.tokens("a")[:7]))]
    request = make_request("b", prompt, greedy(30, ignore_eos=True, stop=(stop,)))
    _, off = _run(tiny_llama, [request], [0], 0)
    engine, on = _run(tiny_llama, [request], [0], 4)
    assert on.events == off.events
    assert on.finish_reason("b") == "stop"
    assert len(on.tokens("b")) < 30
    assert engine.speculator.num_accepted > 0


@pytest.mark.slow
def test_a_speculated_sequence_is_remembered_by_the_prefix_cache(tiny_llama):
    """A finished row's cache (with rejected positions rolled out) seeds the next turn: the
    continued conversation hits the cache and gives the tokens a cold run gives."""
    vocab = tiny_llama.info.vocab_size
    prompt = _repeating_prompts(vocab, 3)[2]
    engine = manual_engine(
        tiny_llama, BatchedEngine, speculative_tokens=3, prefix_cache_bytes=64 << 20
    )
    engine.speculator.adaptive = False
    first = drive(engine, [make_request("t1", prompt, greedy(20, ignore_eos=True))])
    follow = [*prompt, *first.tokens("t1"), 1500, 1501]
    warm = drive(engine, [make_request("t2", follow, greedy(12, ignore_eos=True))])
    assert warm.cached("t2") >= len(prompt) + 10
    cold = run_batched(tiny_llama, [make_request("t2", follow, greedy(12, ignore_eos=True))])
    assert warm.tokens("t2") == cold.tokens("t2")


def test_policy_drafts_only_small_batches_without_host_decisions(tiny_llama, tiny_qwen3_next):
    vocab = tiny_llama.info.vocab_size
    prompts = _repeating_prompts(vocab, 3)
    engine = manual_engine(tiny_llama, BatchedEngine, speculative_tokens=4)
    engine.speculator.adaptive = False
    requests = [
        engine.make_request(make_request(f"p{i}", p, params), lambda output: None)
        for i, (p, params) in enumerate(
            zip(prompts, [greedy(40), greedy(40, presence_penalty=1.0), greedy(6)], strict=True)
        )
    ]
    for request in requests:
        engine.scheduler.add(request)
    seqs = [request.sequences[0] for request in requests]
    # The tiny model repeats its first token, so once a row has two of them it drafts.
    while len(seqs[2].output_token_ids) < 3:
        engine.step()
    plan = engine.scheduler.schedule()
    drafted = set(plan.drafts)
    assert id(seqs[0]) in drafted
    assert id(seqs[1]) not in drafted  # penalties need the host between positions
    # Never beyond max_tokens: the row's last token comes from its own position.
    assert 0 < len(plan.drafts[id(seqs[2])]) <= 6 - len(seqs[2].output_token_ids) - 1
    engine.speculator.max_rows = 2
    assert engine.speculator.drafts(plan.decode) == {}
    # Recurrent state cannot be rolled back: a hybrid model never speculates.
    assert manual_engine(tiny_qwen3_next, BatchedEngine, speculative_tokens=4).speculator is None
    assert manual_engine(tiny_llama, BatchedEngine).speculator is None


def test_a_batch_size_whose_drafted_steps_are_slower_stops_drafting(tiny_llama):
    engine = manual_engine(tiny_llama, BatchedEngine, speculative_tokens=4)
    prompts = _repeating_prompts(tiny_llama.info.vocab_size, 2)
    for i, prompt in enumerate(prompts):
        request = make_request(f"q{i}", prompt, greedy(200, ignore_eos=True))
        engine.scheduler.add(engine.make_request(request, lambda output: None))
    engine.step()
    while len(engine.scheduler.running[0].sequences[0].output_token_ids) < 4:
        engine.step()
    decode = [request.sequences[0] for request in engine.scheduler.running]
    speculator = Speculator(num_tokens=4)  # no figures from the steps above
    assert speculator.drafts(decode) == {}, "a plain step of this size is measured first"
    speculator.record_step(2, drafted=False, num_tokens=2, seconds=0.01)
    assert speculator.drafts(decode), "then one with drafts"
    # Measured: drafted steps of this batch size give fewer tokens/s than plain ones.
    speculator.record_step(2, drafted=False, num_tokens=2, seconds=0.01)
    speculator.record_step(2, drafted=True, num_tokens=4, seconds=0.05)
    plans = [speculator.drafts(decode) for _ in range(2 * speculator.PROBE_EVERY)]
    assert sum(1 for plan in plans if plan) == 2, "only the probes draft"
    # Drafts that pay off bring it back (and then only probes decode without).
    speculator.record_step(2, drafted=True, num_tokens=10, seconds=0.01)
    speculator.record_step(2, drafted=True, num_tokens=10, seconds=0.01)
    plans = [speculator.drafts(decode) for _ in range(2 * speculator.PROBE_EVERY)]
    assert sum(1 for plan in plans if not plan) == 2
    # Another batch size is measured on its own.
    assert speculator.drafts(decode[:1]) == {}
