"""JSON mode: the validator's grammar, and engine output that always parses to one object.

The tiny random-weight model produces garbage left to itself, so every completion here leans
on the constraint: a wrong token is replaced, and the object is closed before max_tokens.
"""

import json
import random
from dataclasses import replace

import pytest

from engine.constraints import (
    INITIAL,
    MAX_WHITESPACE_RUN,
    JsonConstraint,
    advance_text,
    closing_text,
)
from engine.protocol import SamplingParams
from tests.engine.conftest import greedy, make_request, run_batched, run_simple

VALID = [
    "{}",
    '  \n{ "a" : 1 }',
    '{"a":[1,-2.5e+3,0.0,1E-2,true,false,null,"x"],"b":{"c":{}},"d":[]}',
    '{"esc":"\\"\\\\\\/\\b\\f\\n\\r\\t\\u00e9\\uD83D\\uDE00","k":"日本 😀"}',
    '{"n":-0,"m":[[],[[]],{"x":[{}]}]}',
]
INVALID = [
    "[1]",
    "x",
    '{"a" 1}',
    "{,}",
    '{"a":1,}',
    '{"a":01}',
    '{"a":-}',
    '{"a":1.}',
    '{"a":1e}',
    '{"a":tru}',
    '{"a":True}',
    '{"a":"\\q"}',
    '{"a":"\\u12g4"}',
    '{"a":"tab\there"}',
    "{} {}",
    '{"a":1]',
    '{"a":[1}',
    "{'a':1}",
    '{"a":+1}',
    '{"a":.5}',
]


def prefixes_accepted(text: str) -> bool:
    return all(advance_text(INITIAL, text[:i]) is not None for i in range(len(text) + 1))


@pytest.mark.parametrize("text", VALID)
def test_every_prefix_of_a_valid_object_is_accepted_and_closes(text):
    assert json.loads(text) is not None
    for i in range(len(text) + 1):
        state = advance_text(INITIAL, text[:i])
        assert state is not None, text[:i]
        # The shortest completion of any prefix is a valid object.
        assert isinstance(json.loads(text[:i] + closing_text(state)), dict), text[:i]
    assert closing_text(advance_text(INITIAL, text)) == ""


@pytest.mark.parametrize("text", INVALID)
def test_invalid_documents_are_rejected_at_the_first_wrong_character(text):
    with pytest.raises(ValueError):
        result = json.loads(text)
        if not isinstance(result, dict):
            raise ValueError("not an object")
    state = advance_text(INITIAL, text)
    assert state is None or closing_text(state) != "", text


def test_whitespace_runs_are_bounded_outside_strings():
    indent = "\n" + " " * (MAX_WHITESPACE_RUN - 1)
    assert advance_text(INITIAL, "{" + indent + '"a":' + indent + "1" + indent + "}") is not None
    assert advance_text(INITIAL, "{" + indent + " ") is None
    assert advance_text(INITIAL, '{"' + " " * 100) is not None, "strings hold any spaces"


def test_random_text_is_accepted_only_as_a_prefix_of_some_object():
    rng = random.Random(0)
    alphabet = '{}[]":,- 0123456789.eE+truefalsn\\u"ab'
    num_accepted = 0
    for _ in range(3000):
        text = "{" + "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 12)))
        state = advance_text(INITIAL, text)
        if state is not None:
            num_accepted += 1
            assert isinstance(json.loads(text + closing_text(state)), dict), text
    assert num_accepted > 100


def test_constraint_handles_characters_split_across_tokens():
    day = "日".encode()
    pieces = {1: b'{"', 2: day[:2], 3: day[2:] + b'"', 4: b":1}", 5: b"\xe6", 9: b""}
    constraint = JsonConstraint(pieces.__getitem__, lambda text: [0], banned={9})
    constraint.accept(1)
    assert not constraint.allows(9), "special tokens add no text and are never allowed"
    constraint.accept(2)
    assert not constraint.is_complete
    constraint.accept(3)
    assert not constraint.allows(5), "half a character outside a string"
    constraint.accept(4)
    assert constraint.is_complete


def test_forced_token_starts_closing_when_tokens_run_out():
    encoded = []
    constraint = JsonConstraint(
        {1: b'{"a":[tr'}.__getitem__, lambda text: encoded.append(text) or [7], banned=()
    )
    constraint.accept(1)
    assert constraint.forced_token(num_tokens_left=5) is None
    assert constraint.forced_token(num_tokens_left=4) == 7
    assert encoded == ["ue]}"]


def completions(collector, request, n=1):
    for index in range(n):
        yield (
            collector.text(request.request_id, index),
            collector.finish_reason(request.request_id, index),
        )


@pytest.mark.slow
def test_json_mode_output_is_one_object_for_any_seed_and_temperature(tiny_llama):
    vocab = tiny_llama.info.vocab_size
    rng = random.Random(7)
    requests = [
        make_request(
            f"j{i}",
            [rng.randrange(1000, vocab - 1000) for _ in range(4 + i)],
            SamplingParams(
                temperature=temperature, seed=i, max_tokens=24, json_mode=True, n=2, top_p=0.9
            ),
        )
        for i, temperature in enumerate([0.0, 0.5, 1.0, 1.5, 2.0])
    ]
    batched = run_batched(tiny_llama, requests, join_at=[0, 0, 1, 3, 4])
    for request in requests:
        for text, finish_reason in completions(batched, request, n=2):
            assert isinstance(json.loads(text), dict), text
            assert finish_reason == "stop", text
    # Unconstrained, the same requests are not JSON: the constraint did the work.
    free = [replace(r, sampling=replace(r.sampling, json_mode=False)) for r in requests]
    plain = run_batched(tiny_llama, free)
    assert not any(text.lstrip().startswith("{") for r in free for text, _ in completions(plain, r))


@pytest.mark.slow
def test_json_mode_greedy_is_identical_alone_batched_and_simple(tiny_llama):
    vocab = tiny_llama.info.vocab_size
    rng = random.Random(3)
    prompts = [[rng.randrange(1000, vocab - 1000) for _ in range(5 + 3 * i)] for i in range(4)]
    requests = [
        make_request(
            f"g{i}", p, greedy(30, json_mode=True, logprobs=True, top_logprobs=2, ignore_eos=i == 1)
        )
        for i, p in enumerate(prompts)
    ]
    others = [make_request(f"o{i}", p, greedy(30, ignore_eos=True)) for i, p in enumerate(prompts)]
    batched = run_batched(tiny_llama, requests + others, join_at=[0, 1, 1, 2, 0, 0, 2, 3])
    simple = run_simple(tiny_llama, requests)
    for request in requests:
        rid = request.request_id
        alone = run_batched(tiny_llama, [request])
        assert batched.tokens(rid) == alone.tokens(rid) == simple.tokens(rid), rid
        assert isinstance(json.loads(alone.text(rid)), dict)
        events = alone.events[(rid, 0)]
        # Logprobs describe the substituted tokens, not the rejected samples.
        assert [lp.token_id for e in events for lp in e.logprobs] == alone.tokens(rid)
        assert all(lp.logprob <= 0.0 for e in events for lp in e.logprobs)


@pytest.mark.slow
def test_json_mode_ends_with_length_only_when_closing_cannot_fit(tiny_llama):
    request = make_request("short", [1000, 2000, 3000], greedy(1, json_mode=True))
    collector = run_batched(tiny_llama, [request])
    text, finish_reason = next(completions(collector, request))
    # One token is enough only if "{}" is a single token; either way the text is a prefix.
    assert finish_reason in ("stop", "length")
    assert advance_text(INITIAL, text) is not None
    for max_tokens in (2, 3, 8):
        request = make_request("fit", [1000, 2000, 3000], greedy(max_tokens, json_mode=True))
        collector = run_batched(tiny_llama, [request])
        text, finish_reason = next(completions(collector, request))
        assert finish_reason == "stop" and isinstance(json.loads(text), dict), (max_tokens, text)
