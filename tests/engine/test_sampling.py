"""Batched sampling: semantics per parameter, seeded reproducibility, penalties, logprobs."""

import engine  # noqa: F401  (first: it preloads OpenBLAS for mlx)

# isort: split
import math

import mlx.core as mx
import pytest

from engine.core.sampling import SamplingState, sample_batch
from engine.protocol import SamplingParams

VOCAB = 64
EOS = 0


def state(prompt=(), choice_index=0, **params):
    return SamplingState(
        SamplingParams(**params),
        prompt_token_ids=list(prompt),
        eos_token_ids=[EOS],
        vocab_size=VOCAB,
        choice_index=choice_index,
    )


def random_logits(rows, seed=0, scale=3.0):
    return mx.random.normal((rows, VOCAB), key=mx.random.key(seed)) * scale


def sample(logits, states):
    result = sample_batch(logits, states)
    mx.eval(result.token_ids)
    return result


def generate(states, steps, same_logits=False):
    """Run `steps` steps over fresh random logits each step; return tokens per row."""
    out = [[] for _ in states]
    for step in range(steps):
        logits = random_logits(1 if same_logits else len(states), seed=step, scale=1.0)
        logits = mx.broadcast_to(logits, (len(states), VOCAB))
        for row, token in enumerate(sample(logits, states).token_ids.tolist()):
            states[row].append(token)
            out[row].append(token)
    return out


def test_greedy_is_argmax_and_results_are_lazy():
    logits = random_logits(8).astype(mx.bfloat16)
    result = sample_batch(logits, [state(temperature=0.0) for _ in range(8)])
    assert result.logprobs is None and result.top_ids is None
    assert result.token_ids.dtype == mx.int32 and result.token_ids.shape == (8,)
    assert result.token_ids.tolist() == mx.argmax(logits, axis=-1).tolist()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_top_k_one_is_greedy(temperature):
    logits = random_logits(8, seed=1)
    states = [state(temperature=temperature, top_k=1, seed=i) for i in range(8)]
    assert sample(logits, states).token_ids.tolist() == mx.argmax(logits, -1).tolist()


def test_top_k_samples_only_from_the_k_best():
    logits = random_logits(1, seed=2, scale=0.1)  # near flat: without top_k anything goes
    best_two = set(mx.argsort(-logits[0])[:2].tolist())
    drawn = {
        sample(logits, [state(temperature=2.0, top_k=2, seed=s)]).token_ids.item()
        for s in range(40)
    }
    assert drawn == best_two


def test_tiny_top_p_keeps_only_the_best_token():
    logits = random_logits(4, seed=3, scale=0.5)
    states = [state(temperature=1.5, top_p=1e-6, seed=i) for i in range(4)]
    assert sample(logits, states).token_ids.tolist() == mx.argmax(logits, -1).tolist()


def test_top_p_keeps_the_nucleus():
    # Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps the first two, top_p 0.85 three.
    logits = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    for top_p, expected in [(0.7, {0, 1}), (0.85, {0, 1, 2})]:
        drawn = {sample(logits, [state(top_p=top_p, seed=s)]).token_ids.item() for s in range(60)}
        assert drawn == expected
    # With top_k the nucleus is taken within the top_k tokens, renormalised (0.5, 0.3, 0.15 ->
    # 0.53, 0.32, 0.16): top_p 0.84 now keeps only two.
    for top_k, expected in [(3, {0, 1}), (2, {0, 1}), (10, {0, 1, 2})]:
        states = [state(top_p=0.84, top_k=top_k, seed=s) for s in range(60)]
        drawn = set(sample(mx.repeat(logits, 60, axis=0), states).token_ids.tolist())
        assert drawn == expected


def test_min_p_drops_tokens_below_the_scaled_maximum():
    # min_p 0.2 of the top probability 0.5 is 0.1: tokens 0..2 stay, token 3 (0.05) goes.
    logits = mx.log(mx.array([[0.5, 0.3, 0.15, 0.05] + [1e-9] * (VOCAB - 4)]))
    drawn = {sample(logits, [state(min_p=0.2, seed=s)]).token_ids.item() for s in range(80)}
    assert drawn == {0, 1, 2}


def test_temperature_shapes_the_distribution():
    probs = [0.6, 0.3, 0.1]
    logits = mx.log(mx.array([probs + [1e-12] * (VOCAB - 3)] * 16))
    num_draws = 2000

    def frequencies(temperature):
        states = [state(temperature=temperature, seed=1000 * row) for row in range(16)]
        counts = [0] * VOCAB
        for _ in range(num_draws // 16):
            for row, token in enumerate(sample(logits, states).token_ids.tolist()):
                counts[token] += 1
                states[row].append(token)
        return [c / num_draws for c in counts]

    at_one = frequencies(1.0)
    assert sum(at_one[3:]) == 0
    for observed, expected in zip(at_one[:3], probs, strict=True):
        assert abs(observed - expected) < 0.04  # ~4 standard deviations
    # T=0.5 squares the probabilities: 0.6^2 / (0.36 + 0.09 + 0.01) = 0.78.
    assert abs(frequencies(0.5)[0] - 0.36 / 0.46) < 0.04


def test_seeded_row_is_the_same_alone_and_inside_a_mixed_batch():
    seeded = dict(temperature=0.9, top_p=0.9, seed=1234)
    alone = generate([state(**seeded)], steps=12)[0]

    others = [
        dict(temperature=0.0),
        dict(temperature=1.3),
        dict(temperature=0.7, top_k=5, seed=7),
        dict(temperature=1.0, min_p=0.1, logprobs=True, top_logprobs=3),
        dict(temperature=0.5, repetition_penalty=1.3, presence_penalty=1.0),
        dict(temperature=1.0, logit_bias={5: 4.0}),
        dict(temperature=1.0, top_k=1),
    ]
    batch = [state(**p) for p in others[:3]] + [state(**seeded)] + [state(**p) for p in others[3:]]
    tokens = []  # row 3 sees the same logits each step as it did alone
    for step in range(12):
        logits = mx.concatenate(
            [
                random_logits(3, seed=99 + step),
                random_logits(1, seed=step, scale=1.0),
                random_logits(4, seed=199 + step),
            ]
        )
        drawn = sample(logits, batch).token_ids.tolist()
        for row, token in enumerate(drawn):
            batch[row].append(token)
        tokens.append(drawn[3])
    assert tokens == alone


def test_same_seed_reproduces_and_choices_differ():
    # Every row sees the same logits, so only the choice index can tell the rows apart.
    first = generate([state(temperature=1.0, seed=5, choice_index=i) for i in range(3)], 20, True)
    again = generate([state(temperature=1.0, seed=5, choice_index=i) for i in range(3)], 20, True)
    assert first == again
    assert first[0] != first[1] and first[1] != first[2] and first[0] != first[2]


def test_unseeded_rows_differ():
    runs = generate([state(temperature=1.0) for _ in range(2)], 20, same_logits=True)
    assert runs[0] != runs[1]


def test_penalties_change_logits_as_specified():
    # Repetition over prompt + generated (sign-aware), presence/frequency over generated only.
    base = [2.0, -2.0, 1.0, 3.0] + [0.0] * (VOCAB - 4)
    logits = mx.array([base])
    st = state(
        prompt=[1, 2],
        temperature=0.0,
        repetition_penalty=2.0,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        logprobs=True,
    )
    for token in (3, 3, 2):
        st.append(token)
    expected = list(base)
    expected[1] = -2.0 * 2.0  # prompt only, negative: multiplied
    expected[2] = 1.0 / 2.0 - 0.5 - 0.25 * 1  # prompt + generated once
    expected[3] = 3.0 / 2.0 - 0.5 - 0.25 * 2  # generated twice
    result = sample(logits, [st])
    # Greedy picks token 0 (2.0) now that token 3 dropped to 0.5.
    assert result.token_ids.item() == 0
    log_total = math.log(sum(math.exp(v) for v in expected))
    assert result.logprobs.item() == pytest.approx(expected[0] - log_total, abs=1e-5)

    # The history grows incrementally: token 0 is penalised from the next step on.
    st.append(0)
    expected[0] = 2.0 / 2.0 - 0.5 - 0.25
    result = sample(logits, [st])
    assert result.token_ids.item() == 3
    log_total = math.log(sum(math.exp(v) for v in expected))
    assert result.logprobs.item() == pytest.approx(expected[3] - log_total, abs=1e-5)


def test_logit_bias_forces_a_token():
    logits = random_logits(4, seed=4)
    states = [state(temperature=t, logit_bias={17: 100.0}, seed=1) for t in (0.0, 0.7, 1.0, 2.0)]
    assert sample(logits, states).token_ids.tolist() == [17] * 4


@pytest.mark.parametrize("params", [dict(min_tokens=2), dict(ignore_eos=True)])
def test_eos_and_stop_token_ids_are_masked(params):
    logits = mx.array([[10.0, 0.0, 9.0] + [-5.0] * (VOCAB - 3)])  # EOS, then stop id 2
    st = state(temperature=0.0, stop_token_ids=(2,), **params)
    assert sample(logits, [st]).token_ids.item() == 1
    st.append(1)
    assert sample(logits, [st]).token_ids.item() == 1
    st.append(1)
    expected = 1 if params.get("ignore_eos") else EOS
    assert sample(logits, [st]).token_ids.item() == expected


def test_logprobs_match_log_softmax_and_top_logprobs_are_ordered():
    logits = random_logits(3, seed=5)
    states = [
        state(temperature=0.0, logprobs=True, top_logprobs=5),
        state(temperature=1.0),
        state(temperature=0.8, seed=3, logprobs=True, top_logprobs=2),
    ]
    result = sample_batch(logits, states)
    log_softmax = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tokens = result.token_ids.tolist()
    assert result.top_ids.shape == (3, 5)
    for row in (0, 2):
        assert result.logprobs[row].item() == pytest.approx(
            log_softmax[row, tokens[row]].item(), abs=1e-5
        )
        expected_ids = mx.argsort(-log_softmax[row])[:5].tolist()
        assert result.top_ids[row].tolist() == expected_ids
        values = result.top_logprobs[row].tolist()
        assert values == sorted(values, reverse=True)
        assert values[0] == pytest.approx(log_softmax[row].max().item(), abs=1e-5)
    assert tokens[0] == result.top_ids[0, 0].item()
