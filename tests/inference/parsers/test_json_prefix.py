"""The JSON-object prefix recogniser the tool-call parsers use: every prefix of a valid object is
accepted and closes, invalid documents are refused, whitespace runs are bounded."""

import json
import random

import pytest

from inference.parsers.json_prefix import INITIAL, MAX_WHITESPACE_RUN, advance_text, closing_text

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
