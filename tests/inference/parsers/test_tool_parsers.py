"""Tool-call and reasoning parsers without a model: split tags, tags sharing a piece with text,
several calls, malformed calls, independent state per stream."""

import json
import random

import pytest

from inference.parsers.base import ParsedDelta
from inference.parsers.hermes import HermesToolParser
from inference.parsers.llama3 import Llama3JsonToolParser
from inference.parsers.mistral import MistralToolParser
from inference.parsers.qwen3_coder import Qwen3CoderToolParser
from inference.parsers.reasoning import DeepSeekR1ReasoningParser, ThinkReasoningParser

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}


def splits(text: str, how: str) -> list[str]:
    if how == "whole":
        return [text]
    if how == "chars":
        return list(text)
    rng = random.Random(how)
    pieces, at = [], 0
    while at < len(text):
        step = rng.randint(1, 7)
        pieces.append(text[at : at + step])
        at += step
    return pieces


SPLITS = ["whole", "chars", "seed-1", "seed-2", "seed-3"]


class Result:
    def __init__(self) -> None:
        self.content = ""
        self.reasoning = ""
        self.calls: list[dict] = []
        self.argument_pieces = 0

    def take(self, delta: ParsedDelta) -> None:
        self.content += delta.content
        self.reasoning += delta.reasoning
        for call in delta.tool_calls:
            if call.id is not None:
                assert call.index == len(self.calls)
                assert call.id.startswith("call_") and call.name
                self.calls.append({"id": call.id, "name": call.name, "arguments": ""})
            if call.arguments:
                self.argument_pieces += 1
            self.calls[call.index]["arguments"] += call.arguments

    def parsed_calls(self) -> list[tuple[str, dict]]:
        return [(c["name"], json.loads(c["arguments"])) for c in self.calls]


def run(parser, pieces) -> Result:
    result = Result()
    for piece in pieces:
        result.take(parser.feed(piece))
    result.take(parser.finish())
    return result


def hermes_call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@pytest.mark.parametrize("how", SPLITS)
def test_hermes_text_then_calls_however_the_text_is_split(how):
    text = (
        "Let me check."
        + hermes_call("get_weather", {"city": "Paris", "days": 3})
        + "\n"
        + hermes_call("get_weather", {"city": 'Zürich "Nord" <tag>', "days": 1})
    )
    result = run(HermesToolParser([WEATHER]), splits(text, how))
    assert result.content == "Let me check."
    assert result.parsed_calls() == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_weather", {"city": 'Zürich "Nord" <tag>', "days": 1}),
    ]
    assert "<tool_call>" not in result.content and "</tool_call" not in result.content
    if how == "chars":  # arguments stream as they are generated, not at the end
        assert result.argument_pieces > 10


def test_hermes_arguments_stream_before_the_call_ends():
    parser = HermesToolParser([WEATHER])
    first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [c.name for c in first.tool_calls] == ["get_weather"]
    assert "".join(c.arguments for c in first.tool_calls) == '{"city": "Pa'
    second = parser.feed('ris"}}\n</tool_call>')
    assert "".join(c.arguments for c in second.tool_calls) == 'ris"}'
    assert not parser.finish()


def test_hermes_a_tag_sharing_a_piece_with_text_and_a_lone_angle_bracket():
    parser = HermesToolParser([WEATHER])
    pieces = ["a < b and <tool", "_call>", '{"name": "f", "arguments": {}}</tool_call>']
    result = run(parser, pieces)
    assert result.content == "a < b and"  # whitespace before a call is dropped
    assert result.parsed_calls() == [("f", {})]


def test_hermes_malformed_call_becomes_content_as_generated():
    text = "<tool_call>\nnot json at all\n</tool_call>"
    result = run(HermesToolParser([WEATHER]), splits(text, "chars"))
    assert result.calls == []
    assert result.content == text


def test_hermes_json_broken_after_the_arguments_began_still_gives_arguments_that_parse():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", !!}}</tool_call>'
    result = run(HermesToolParser([WEATHER]), splits(text, "chars"))
    assert result.parsed_calls() == [("get_weather", {"city": "Paris"})]


def test_hermes_arguments_before_the_name_are_read_whole():
    text = '<tool_call>{"arguments": {"city": "Oslo"}, "name": "get_weather"}</tool_call>'
    result = run(HermesToolParser([WEATHER]), splits(text, "chars"))
    assert result.parsed_calls() == [("get_weather", {"city": "Oslo"})]


def test_hermes_reply_cut_inside_a_call_keeps_what_was_generated():
    result = run(HermesToolParser([WEATHER]), ['<tool_call>{"name": "f", "arguments": {"a": 1'])
    assert result.calls[0]["name"] == "f" and result.calls[0]["arguments"] == '{"a": 1'


def test_hermes_plain_text_passes_through_unchanged():
    text = "No tools needed:\n\n  indented <b>bold</b> and a trailing newline\n"
    assert run(HermesToolParser([WEATHER]), splits(text, "chars")).content == text


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    text = hermes_call("a", {}) + hermes_call("b", {})
    result = run(HermesToolParser([], parallel=False), splits(text, "seed-1"))
    assert [name for name, _ in result.parsed_calls()] == ["a"]


def test_concurrent_streams_keep_their_own_state():
    one, two = HermesToolParser([WEATHER]), HermesToolParser([WEATHER])
    text_one = "x" + hermes_call("get_weather", {"city": "Rome"})
    text_two = "plain text <tool_ca" + "ll-ish> no call"
    results = [Result(), Result()]
    for a, b in zip(
        splits(text_one, "chars"), splits(text_two, "chars") + [""] * 100, strict=False
    ):
        results[0].take(one.feed(a))
        results[1].take(two.feed(b))
    results[0].take(one.finish())
    results[1].take(two.finish())
    assert results[0].parsed_calls() == [("get_weather", {"city": "Rome"})]
    assert results[0].content == "x"
    assert results[1].calls == [] and results[1].content == text_two


@pytest.mark.parametrize("how", SPLITS)
def test_qwen3_coder_xml_calls_typed_by_the_schema(how):
    text = (
        "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "</function>\n</tool_call>"
    )
    result = run(Qwen3CoderToolParser([WEATHER]), splits(text, how))
    assert result.content == "Checking."
    assert result.parsed_calls() == [
        ("get_weather", {"city": "New York", "days": 3}),
        ("get_weather", {"city": "42"}),  # a string by its schema
    ]


def test_qwen3_coder_malformed_block_is_content():
    text = "<tool_call>\n<not-a-function>\n</tool_call>"
    result = run(Qwen3CoderToolParser([WEATHER]), splits(text, "chars"))
    assert result.calls == [] and result.content == text


@pytest.mark.parametrize("how", SPLITS)
@pytest.mark.parametrize("prefix", ["", "<|python_tag|>", "  "])
def test_llama3_json_calls(how, prefix):
    text = (
        prefix
        + '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
        + '{"name": "get_weather", "parameters": {"city": "Lyon", "days": 2}}'
    )
    result = run(Llama3JsonToolParser([WEATHER]), splits(text, how))
    assert result.content == ""
    assert result.parsed_calls() == [
        ("get_weather", {"city": "Paris"}),
        ("get_weather", {"city": "Lyon", "days": 2}),
    ]


@pytest.mark.parametrize("text", ["Hello there.", '{"answer": 42}', "{ not json", "  spaced"])
def test_llama3_json_replies_that_are_not_calls_are_content(text):
    assert run(Llama3JsonToolParser([WEATHER]), splits(text, "chars")).content == text


@pytest.mark.parametrize("how", SPLITS)
def test_mistral_list_and_args_forms(how):
    listed = (
        'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Nice"}}, '
        '{"name": "get_weather", "arguments": {"city": "Metz"}}]'
    )
    result = run(MistralToolParser([WEATHER]), splits(listed, how))
    assert result.content == "Sure."
    assert [a["city"] for _, a in result.parsed_calls()] == ["Nice", "Metz"]
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Brest"}[TOOL_CALLS]get_weather[ARGS]{"days": 4}'
    result = run(MistralToolParser([WEATHER]), splits(v11, how))
    assert result.content == ""
    assert result.parsed_calls() == [
        ("get_weather", {"city": "Brest"}),
        ("get_weather", {"days": 4}),
    ]


@pytest.mark.parametrize("how", SPLITS)
def test_think_block_becomes_reasoning(how):
    text = "<think>\nThe user wants 2+2.\n</think>\n\nIt is 4."
    result = run(ThinkReasoningParser(), splits(text, how))
    assert result.reasoning.strip() == "The user wants 2+2."
    assert result.content == "It is 4."


def test_think_block_opened_by_the_template_and_closed_by_thinking_off():
    opened = run(ThinkReasoningParser(prompt_tail="assistant\n<think>\n"), ["why", "</think>ok"])
    assert (opened.reasoning, opened.content) == ("why", "ok")
    off = ThinkReasoningParser(prompt_tail="assistant\n<think>\n\n</think>\n\n")
    assert run(off, ["<think>is content here</think>"]).content.startswith("<think>")
    plain = run(ThinkReasoningParser(), splits("No thinking, just <b>text</b>.", "chars"))
    assert (plain.reasoning, plain.content) == ("", "No thinking, just <b>text</b>.")


def test_a_reply_cut_inside_the_think_block_is_all_reasoning():
    result = run(ThinkReasoningParser(), splits("<think>still going </thi", "chars"))
    assert result.content == "" and result.reasoning == "still going </thi"


def test_deepseek_r1_starts_inside_the_block():
    result = run(DeepSeekR1ReasoningParser(), splits("<think>a</think>b", "chars"))
    assert (result.reasoning, result.content) == ("a", "b")
    result = run(DeepSeekR1ReasoningParser(), splits("a</think>\n\nb", "chars"))
    assert (result.reasoning, result.content) == ("a", "b")


@pytest.mark.parametrize("how", SPLITS)
def test_review_edge_cases_give_the_same_result_however_split(how):
    def parse(parser_class, text, **kwargs):
        result = run(parser_class([WEATHER], **kwargs), splits(text, how))
        whole = run(parser_class([WEATHER], **kwargs), [text])
        assert (result.content, result.calls and result.parsed_calls()) == (
            whole.content,
            whole.calls and whole.parsed_calls(),
        )
        return result

    # A name the JSON decoder refuses: no exception, read as a whole object (and refused).
    bad_name = '<tool_call>{"name": "a\\x", "arguments": {}}</tool_call>'
    assert parse(HermesToolParser, bad_name).content == bad_name
    # Arguments cut short by the end tag are closed so that they parse.
    cut = '<tool_call>{"name": "f", "arguments": {"a": "unterminated</tool_call>'
    assert parse(HermesToolParser, cut).parsed_calls() == [("f", {"a": "unterminated"})]
    # Arguments as a JSON string are read whole.
    encoded = '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>'
    assert parse(HermesToolParser, encoded).parsed_calls() == [("f", {"a": 1})]
    # Long whitespace runs inside valid arguments (indented JSON) are kept.
    indented = json.dumps({"a": {"b": {"c": {"d": {"e": {"f": {}}}}}}, "z": 2}, indent=4)
    call = f'<tool_call>{{"name": "f", "arguments": {indented}}}</tool_call>'
    assert parse(HermesToolParser, call).parsed_calls()[0][1]["z"] == 2
    # A dropped second call (parallel_tool_calls false) never leaks as content.
    two = hermes_call("a", {}) + '<tool_call>{"arguments": {"x": 2}, "name": "g"}</tool_call>end'
    dropped = parse(HermesToolParser, two, parallel=False)
    assert dropped.content == "end" and [n for n, _ in dropped.parsed_calls()] == ["a"]
    # The space before a block that is no call stays.
    assert parse(HermesToolParser, "hi <tool_call>x</tool_call>").content == (
        "hi <tool_call>x</tool_call>"
    )
    # Broken arguments drop what follows them the same way, however split.
    parse(Llama3JsonToolParser, '{"name": "f", "parameters": {"a": bad, "b": 2}}')
    parse(MistralToolParser, '[TOOL_CALLS]f[ARGS]{"a": x}[TOOL_CALLS]g[ARGS]{"b": 2}')
    assert parse(MistralToolParser, "[TOOL_CALLS]not json at all").content == "not json at all"
