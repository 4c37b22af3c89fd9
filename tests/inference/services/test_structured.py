"""The grammars structured output builds: every tool-call syntax's forced-call grammar accepts
the model's own call text through the real tokenizer (token by token, added tokens as
tokens), and refused schemas or grammars name their field."""

import functools
import json

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from inference.errors import APIError
from inference.services.structured import (
    MAX_SAFE_INTEGER,
    bounded_integers,
    extension_grammar,
    json_schema_grammar,
    json_size_past,
    response_format_grammar,
    tool_call_grammar,
)
from tests.fixtures.tiny_models import build_tiny_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
CALLS = [
    (
        "qwen3",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    ),
    (
        "qwen3",
        "qwen3_coder",
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "</function>\n</tool_call>",
    ),
    ("llama3_1", "llama3_json", '{"name": "get_time", "parameters": {"zone": "UTC"}}'),
    (
        "gptoss",
        "harmony",
        "<|channel|>commentary to=functions.get_weather <|constrain|>json"
        '<|message|>{"city": "Berlin"}<|call|>',
    ),
]


@functools.cache
def tokenizers(name: str) -> tuple:
    """The real tokenizer and llguidance's view of it, built once per tokenizer (~2 s each,
    mostly llguidance's): the parsers that share a tokenizer share them, as a model's do."""
    hf = AutoTokenizer.from_pretrained(str(build_tiny_model(model_type="llama", tokenizer=name)))
    return hf, llguidance.hf.from_tokenizer(hf, n_vocab=len(hf))


@pytest.mark.parametrize(("tokenizer", "parser", "text"), CALLS)
def test_forced_call_grammars_accept_the_models_own_calls(tokenizer, parser, text):
    hf, ll_tokenizer = tokenizers(tokenizer)
    grammar = tool_call_grammar(
        parser, [WEATHER, TIME], parallel=True, added_tokens=hf.get_added_vocab()
    )
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
    ids = hf.encode(text, add_special_tokens=False)
    assert not matcher.is_error(), matcher.get_error()
    assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()
    other = hf.encode(text.replace("get_", "set_"), add_special_tokens=False)
    fresh = llguidance.LLMatcher(ll_tokenizer, grammar)
    assert fresh.try_consume_tokens(other) < len(other)  # no call of an unknown function


def test_the_mistral_grammar_names_its_marker_token_by_id():
    grammar = tool_call_grammar(
        "mistral", [WEATHER], parallel=False, added_tokens={"[TOOL_CALLS]": 9}
    )
    assert "<[9]>" in grammar and not llguidance.LLMatcher.validate_grammar(grammar)
    assert tool_call_grammar("unknown", [WEATHER], parallel=True, added_tokens={}) is None


@pytest.mark.parametrize(
    ("call", "param"),
    [
        (lambda: json_schema_grammar({"type": "strin"}, "response_format"), "response_format"),
        (lambda: json_schema_grammar([1], "response_format"), "response_format"),
        (lambda: extension_grammar({"regex": "("}), "structured_outputs.regex"),
        (lambda: extension_grammar({"grammar": "start: x"}), "structured_outputs.grammar"),
        (lambda: extension_grammar({"choice": "yes"}), "structured_outputs.choice"),
        (lambda: extension_grammar({"json": {}, "regex": "a"}), "structured_outputs"),
        (lambda: response_format_grammar({"type": "json_schema", "json_schema": 5}, "rf"), "rf"),
    ],
)
def test_refusals_name_their_field(call, param):
    with pytest.raises(APIError) as caught:
        call()
    assert caught.value.status == 400 and caught.value.param == param


def test_a_grammar_over_the_budget_is_refused_naming_the_limit_before_it_is_checked(
    settings, monkeypatch
):
    settings.ORCHARD_GRAMMAR_MAX_BYTES = 10_000
    checked = []
    monkeypatch.setattr(
        llguidance.LLMatcher,
        "validate_grammar",
        staticmethod(lambda grammar: checked.append(grammar) or ""),
    )
    schema = {"enum": [f"value-{i}" for i in range(2000)]}
    with pytest.raises(APIError) as caught:
        json_schema_grammar(schema, "response_format")
    error = caught.value
    assert (error.status, error.param, error.code) == (400, "response_format", "invalid_grammar")
    assert "over the limit of 10000 bytes" in error.message
    assert checked == []
    built = []
    monkeypatch.setattr(
        llguidance.LLMatcher,
        "grammar_from_json_schema",
        staticmethod(lambda schema, **options: built.append(schema) or ""),
    )
    with pytest.raises(APIError, match="at least"):
        json_schema_grammar(schema, "response_format")
    assert built == []  # a schema over the limit by itself is not even turned into a grammar


def test_a_schemas_size_is_bounded_from_below_and_the_walk_stops_past_the_limit():
    """The size check never refuses a schema whose JSON is within the limit, and stops walking
    a huge one once it has seen more than the limit (not a serialization of all of it)."""

    schema = {
        "type": "object",
        "properties": {"é\"name": {"enum": [None, True, 1.5, -20, "a\\b", [], {}]}},
        "required": ["é\"name"],
    }
    exact = len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
    assert json_size_past(schema, exact) is None
    assert exact - 10 <= json_size_past(schema, exact - 10) <= exact

    huge = {"enum": [f"{i:05d}" + "x" * 95 for i in range(1000)]}  # ~103 kB of JSON
    assert 10_000 < json_size_past(huge, 10_000) < 10_200  # it stopped just past the limit


def test_a_grammar_is_checked_once_whatever_the_number_of_requests(monkeypatch):
    real = llguidance.LLMatcher.validate_grammar
    checked = []

    def counting(grammar):
        checked.append(grammar)
        return real(grammar)

    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", staticmethod(counting))
    schema = {"type": "object", "properties": {"tag": {"const": "checked-once"}}}
    grammars = {json_schema_grammar(schema, "response_format") for _ in range(3)}
    assert len(grammars) == 1 and len(checked) == 1
    for _ in range(2):  # refusals are remembered too
        with pytest.raises(APIError):
            extension_grammar({"regex": "(unclosed-once"})
    assert len(checked) == 2


def test_unbounded_integers_get_i_json_bounds_and_the_callers_schema_is_left_alone():
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "m": {"type": ["integer", "null"], "minimum": 5},
            "big": {"type": "integer", "minimum": 10**17},
            "e": {"enum": [{"type": "integer"}]},
        },
        "required": ["n", "m"],
    }
    before = json.dumps(schema)
    grammar = json_schema_grammar(schema, "response_format")
    assert json.dumps(schema) == before
    bounded = bounded_integers(schema)["properties"]
    assert bounded["n"] == {
        "type": "integer",
        "maximum": MAX_SAFE_INTEGER,
        "minimum": -MAX_SAFE_INTEGER,
    }
    assert (bounded["m"]["minimum"], bounded["m"]["maximum"]) == (5, MAX_SAFE_INTEGER)
    assert "maximum" not in bounded["big"]  # its own bound is beyond: left as the caller set it
    assert bounded["e"] == schema["properties"]["e"]  # data, not a schema
    hf, ll_tokenizer = tokenizers("qwen3")

    def accepts(text: str) -> bool:
        ids = hf.encode(text, add_special_tokens=False)
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar)
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    assert accepts(f'{{"n": {MAX_SAFE_INTEGER}, "m": null}}')
    assert accepts(f'{{"n": -{MAX_SAFE_INTEGER}, "m": 5}}')
    assert not accepts(f'{{"n": {MAX_SAFE_INTEGER}0, "m": 5}}')  # 17 digits
