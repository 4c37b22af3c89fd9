"""Greedy output is token-identical with and without a prefix-cache hit: on a dense llama and a
hybrid qwen3_next (float32: docs/architecture.md), with chunked prefill forced small, with both,
for a multi-turn conversation, and through the simple engine. Every warm run also proves it hit."""

import random
from dataclasses import replace

import pytest

from engine.core.batched import BatchedEngine
from engine.core.simple import SimpleEngine
from engine.protocol import GenerationRequest
from tests.engine.conftest import drive, greedy, manual_engine, run_batched, run_simple

MAX_TOKENS = 8
COLD = {"prefix_cache_bytes": 0}


def tokens(vocab: int, count: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, vocab - 1000) for _ in range(count)]


def request(rid: str, prompt: list[int], checkpoints=()) -> GenerationRequest:
    params = greedy(MAX_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=5)
    return GenerationRequest(rid, "tiny", tuple(prompt), params, tuple(checkpoints))


def assert_same(warm, warm_id: str, cold, cold_id: str) -> None:
    """Same tokens, and the same distributions to float32 rounding: a random tiny model's
    greedy tokens alone can survive a slightly wrong cache, its logprobs cannot."""
    assert warm.tokens(warm_id) == cold.tokens(cold_id)
    ours = [
        (t.token_id, t.logprob)
        for o in warm.events[(warm_id, 0)]
        for lp in o.logprobs or ()
        for t in lp.top_logprobs
    ]
    theirs = [
        (t.token_id, t.logprob)
        for o in cold.events[(cold_id, 0)]
        for lp in o.logprobs or ()
        for t in lp.top_logprobs
    ]
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    assert [lp for _, lp in ours] == pytest.approx([lp for _, lp in theirs], abs=1e-4)


@pytest.mark.slow
def test_a_shared_prefix_hit_changes_no_token(tiny_model):
    vocab = tiny_model.info.vocab_size
    system = tokens(vocab, 40, seed=1)
    first = request("first", [*system, *tokens(vocab, 7, seed=2)], checkpoints=[40])
    second = request("second", [*system, *tokens(vocab, 11, seed=3)], checkpoints=[40])
    cold = run_batched(tiny_model, [second], **COLD)
    engine = manual_engine(tiny_model, BatchedEngine)
    drive(engine, [first])
    warm = drive(engine, [second])
    assert warm.cached("second") == 40  # the system prompt (a checkpoint on the hybrid model)
    assert_same(warm, "second", cold, "second")
    # The same prompt again resumes one token before its end.
    again = drive(engine, [replace(second, request_id="again")])
    assert again.cached("again") == len(second.prompt_token_ids) - 1
    assert_same(again, "again", cold, "second")


@pytest.mark.slow
def test_hits_with_chunked_prefill_beside_running_streams_change_no_token(tiny_model):
    vocab = tiny_model.info.vocab_size
    system = tokens(vocab, 50, seed=4)
    long = request("long", [*system, *tokens(vocab, 60, seed=5)], checkpoints=[50])
    runner = GenerationRequest(
        "runner", "tiny", tuple(tokens(vocab, 5, seed=6)), greedy(60, ignore_eos=True)
    )
    small = {"prefill_chunk_tokens": 16, "max_num_batched_tokens": 64}
    cold = run_batched(tiny_model, [long], **COLD)
    chunked = run_batched(tiny_model, [runner, long], join_at=[0, 2], **COLD, **small)
    assert_same(chunked, "long", cold, "long")
    engine = manual_engine(tiny_model, BatchedEngine, **small)
    drive(engine, [request("warmup", [*system, *tokens(vocab, 3, seed=7)], checkpoints=[50])])
    both = drive(engine, [replace(runner, request_id="runner2"), long], join_at=[0, 2])
    assert both.cached("long") == 50
    assert_same(both, "long", cold, "long")
    assert both.tokens("runner2") == chunked.tokens("runner")


@pytest.mark.slow
@pytest.mark.parametrize("run_ahead", [False, True])
def test_a_second_turn_resumes_where_the_first_turn_ended(tiny_model, run_ahead, monkeypatch):
    # Running ahead, a finished row has also been fed its last token: what it keeps differs.
    monkeypatch.setattr(BatchedEngine, "RUN_AHEAD", run_ahead)
    vocab = tiny_model.info.vocab_size
    system, user1, user2 = (tokens(vocab, n, seed=s) for n, s in ((30, 8), (12, 9), (10, 10)))
    engine = manual_engine(tiny_model, BatchedEngine)
    turn1 = request("turn1", [*system, *user1], checkpoints=[30])
    # Another stream outlives turn 1, so the step in which turn 1 ends still runs ahead
    # (alone at its max_tokens, the engine would not run a wasted step).
    companion = GenerationRequest(
        "companion", "tiny", tuple(tokens(vocab, 6, seed=14)), greedy(3 * MAX_TOKENS)
    )
    reply = drive(engine, [turn1, companion]).tokens("turn1")
    history = [*system, *user1, *reply]
    # As a server renders it: the checkpoints are the end of the system prompt and the
    # conversation before the last user turn.
    turn2 = request("turn2", [*history, *user2], checkpoints=[30, len(history)])
    cold = run_batched(tiny_model, [turn2], **COLD)
    warm = drive(engine, [turn2])
    # The whole first turn, as far as the reply was fed back into the model.
    assert warm.cached("turn2") == len(history) - (0 if run_ahead else 1)
    assert_same(warm, "turn2", cold, "turn2")


@pytest.mark.slow
def test_the_simple_engine_reuses_the_cache_and_changes_no_token(tiny_model):
    vocab = tiny_model.info.vocab_size
    system = tokens(vocab, 40, seed=11)
    first = request("first", [*system, *tokens(vocab, 5, seed=12)], checkpoints=[40])
    second = request("second", [*system, *tokens(vocab, 9, seed=13)], checkpoints=[40])
    cold = run_simple(tiny_model, [second], engine=manual_engine(tiny_model, SimpleEngine, **COLD))
    engine = manual_engine(tiny_model, SimpleEngine)
    run_simple(tiny_model, [first], engine=engine)
    warm = run_simple(tiny_model, [second], engine=engine)
    assert warm.cached("second") == 40
    assert_same(warm, "second", cold, "second")
    assert_same(cold, "second", run_batched(tiny_model, [second], **COLD), "second")


@pytest.mark.slow
def test_prompts_completing_together_from_hits_and_earlier_chunks_change_no_token(
    tiny_model, monkeypatch
):
    """The prompts that complete in one step are prefilled as one padded batch from wherever
    each one's cache stands: a hit on a shared system prompt, an earlier chunk, or nothing
    (a dense model; a hybrid one batches only whole prompts)."""
    from engine.core.runner import BatchRunner

    vocab = tiny_model.info.vocab_size
    system = tokens(vocab, 40, seed=15)
    hits = [request(f"hit{i}", [*system, *tokens(vocab, 5 + 4 * i, seed=16 + i)]) for i in range(3)]
    fresh = request("fresh", tokens(vocab, 9, seed=20))
    # 30 tokens of "long" in the first step, the rest with two short prompts in the next.
    long = request("long", tokens(vocab, 45, seed=21))
    shorts = [request(f"short{i}", tokens(vocab, 6 + i, seed=22 + i)) for i in range(2)]
    groups = []
    original = BatchRunner._prefill_together

    def spy(self, chunks):
        groups.append(sorted((c.request.request_id, c.start) for c in chunks))
        return original(self, chunks)

    monkeypatch.setattr(BatchRunner, "_prefill_together", spy)
    engine = manual_engine(tiny_model, BatchedEngine)
    drive(engine, [request("warmup", [*system, *tokens(vocab, 3, seed=25)], checkpoints=[40])])
    warm = drive(engine, [*hits, fresh])
    chunked = run_batched(
        tiny_model, [long, *shorts], join_at=[0, 1, 1], **COLD, max_num_batched_tokens=30
    )
    dense = not engine.runner.hybrid
    if dense:
        assert groups == [
            [("fresh", 0), ("hit0", 40), ("hit1", 40), ("hit2", 40)],
            [("long", 30), ("short0", 0), ("short1", 0)],
        ]
    else:
        assert groups == [[("short0", 0), ("short1", 0)]]
    for each in hits:
        assert warm.cached(each.request_id) == 40
        cold = run_batched(tiny_model, [each], **COLD)
        assert_same(warm, each.request_id, cold, each.request_id)
    assert_same(warm, "fresh", run_batched(tiny_model, [fresh], **COLD), "fresh")
    for each in (long, *shorts):
        cold = run_batched(tiny_model, [each], **COLD)
        assert_same(chunked, each.request_id, cold, each.request_id)
