"""Structured output in the engine (llguidance): over many seeds, temperatures and schemas, on
tiny random-weight models with the real Qwen3 and Llama 3 tokenizers, every completion that
ends with "stop" parses and validates; regexes match; rows under a grammar beside free ones
leave those unchanged; greedy output is the same alone, batched and on the simple engine."""

import json
import random
import re
from dataclasses import replace

import jsonschema
import pytest

from engine.models.loader import load_model
from engine.protocol import SamplingParams
from inference.services.structured import extension_grammar, json_schema_grammar
from tests.engine.conftest import (
    drive,
    greedy,
    make_request,
    manual_engine,
    run_batched,
    run_simple,
)
from tests.fixtures.tiny_models import build_tiny_model

SCHEMAS = [
    {"type": "object"},
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
            "score": {"type": "number", "minimum": -1, "maximum": 1},
        },
        "required": ["colour", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            },
            "label": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 6}]},
            "ok": {"type": "boolean"},
        },
        "required": ["point", "label", "ok"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module", params=["qwen3", "llama3_1"])
def loaded(request):
    if request.param == "qwen3":
        return request.getfixturevalue("tiny_llama")  # this model, already loaded for the suite
    return load_model(build_tiny_model(model_type="llama", tokenizer=request.param))


def prompts(loaded, count, seed):
    rng = random.Random(seed)
    vocab = loaded.info.vocab_size
    return [[rng.randrange(1000, vocab // 2) for _ in range(3 + i % 5)] for i in range(count)]


@pytest.mark.slow
def test_every_completion_that_stops_validates_against_its_schema(loaded):
    """Two choices per sampled request (each its own draw under its own grammar state), one
    for greedy ones (their choices are the same tokens). A random model closes a free-form
    object (SCHEMAS[0]) at once or never: its rows stop earlier, the others get the room to
    close (up to ~100 tokens for the nested SCHEMAS[3])."""
    requests, schemas = [], {}
    for index, schema in enumerate(SCHEMAS):
        grammar = json_schema_grammar(schema, "response_format")
        for j, prompt in enumerate(prompts(loaded, 4, seed=index)):
            rid = f"s{index}-{j}"
            schemas[rid] = schema
            temperature = [0.0, 0.7, 1.0, 1.5][j]
            params = SamplingParams(
                temperature=temperature,
                seed=j,
                max_tokens=24 if index == 0 else 120,
                n=2 if temperature else 1,
                grammar=grammar,
            )
            requests.append(make_request(rid, prompt, params))
    collector = run_batched(loaded, requests, join_at=[i % 3 for i in range(len(requests))])
    completions = stopped = 0
    for request in requests:
        rid = request.request_id
        for choice in range(request.sampling.n):
            completions += 1
            text, reason = collector.text(rid, choice), collector.finish_reason(rid, choice)
            assert reason in ("stop", "length"), (rid, reason)
            if reason == "stop":
                stopped += 1
                jsonschema.validate(json.loads(text), schemas[rid])
    assert stopped >= completions / 2  # most of the completions close within their tokens


@pytest.mark.slow
def test_regex_and_choice_outputs_match(loaded):
    pattern = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
    regex = extension_grammar({"regex": pattern})
    choice = extension_grammar({"choice": ["yes", "no", "maybe"]})
    requests = [
        make_request(f"r{i}", p, SamplingParams(temperature=1.0, seed=i, max_tokens=40, grammar=g))
        for i, (p, g) in enumerate(
            zip(prompts(loaded, 8, seed=9), [regex, choice] * 4, strict=True)
        )
    ]
    collector = run_batched(loaded, requests)
    for index, request in enumerate(requests):
        text = collector.text(request.request_id)
        assert collector.finish_reason(request.request_id) == "stop", text
        if index % 2 == 0:
            assert re.fullmatch(pattern, text), text
        else:
            assert text in ("yes", "no", "maybe")


@pytest.mark.slow
def test_constrained_rows_leave_free_rows_unchanged_and_greedy_is_identical(loaded):
    grammar = json_schema_grammar(SCHEMAS[1], "response_format")
    batch = prompts(loaded, 4, seed=4)
    constrained = [
        make_request(f"c{i}", p, greedy(16, grammar=grammar, logprobs=True, top_logprobs=2))
        for i, p in enumerate(batch[:2])
    ]
    free = [make_request(f"f{i}", p, greedy(16, ignore_eos=True)) for i, p in enumerate(batch[2:])]
    together = run_batched(loaded, constrained + free, join_at=[0, 1, 0, 2])
    simple = run_simple(loaded, constrained)
    for request in free:
        rid = request.request_id
        assert together.tokens(rid) == run_batched(loaded, [request]).tokens(rid)
    for request in constrained:
        rid = request.request_id
        alone = run_batched(loaded, [request])
        assert together.tokens(rid) == alone.tokens(rid) == simple.tokens(rid), rid
        if alone.finish_reason(rid) == "stop":
            jsonschema.validate(json.loads(alone.text(rid)), SCHEMAS[1])
        logprobs = [lp for event in alone.events[(rid, 0)] for lp in event.logprobs]
        assert [lp.token_id for lp in logprobs] == alone.tokens(rid)


def test_a_length_stop_may_cut_the_output(loaded):
    grammar = json_schema_grammar(SCHEMAS[1], "response_format")
    request = make_request("short", [1000, 2000, 3000], greedy(3, grammar=grammar))
    collector = run_batched(loaded, [request])
    assert collector.finish_reason("short") == "length"
    assert collector.text("short").startswith("{")


def test_chunked_prefill_and_a_prefix_hit_keep_the_grammar(loaded):
    grammar = json_schema_grammar(SCHEMAS[2], "response_format")
    prompt = [token for row in prompts(loaded, 6, seed=11) for token in row] * 4
    request = make_request("long", prompt, greedy(30, grammar=grammar))
    whole = run_batched(loaded, [request])
    engine = manual_engine(loaded, prefill_chunk_tokens=8)
    running = make_request("running", prompt[:5], greedy(40, ignore_eos=True))
    chunked = drive(engine, [running, request], join_at=[0, 1])
    again = drive(engine, [replace(request, request_id="again")])
    assert chunked.tokens("long") == whole.tokens("long") == again.tokens("again")
    assert again.cached("again") >= len(prompt) // 2  # resumed from the prefix cache
    if whole.finish_reason("long") == "stop":
        jsonschema.validate(json.loads(whole.text("long")), SCHEMAS[2])
