"""Structured output at the edge: what a request asks its output to follow, as one llguidance
grammar, checked here (a grammar the library refuses is a 400 naming the field it came from),
then enforced by the engine token by token (engine/text/grammar.py).

- `response_format` (chat) / `text.format` (responses): `json_object` is any JSON object,
  `json_schema` the caller's schema.
- `structured_outputs` (an Orchard extension, `extra_body`; vLLM's name and shape): exactly one
  of `json` (a schema), `regex`, `grammar` (Lark, llguidance's dialect) or `choice` (strings).
- `tool_choice: "required"` or a named function: a grammar over the model's own tool-call
  syntax (`tool_call_grammar`), so the reply is a call its tool-call parser reads.

Checking a grammar costs time that grows with its size (about 0.3 s a megabyte, the same again
for the engine's compile), so a grammar larger than ORCHARD_GRAMMAR_MAX_BYTES is refused (a 400
that names the limit) before it is checked, and llguidance's own limits (lexer fuel, grammar
size) bound what a small grammar can cost. These functions are synchronous and run off the event
loop, on the preparation threads (inference/services/prework.py). A grammar's verdict is cached
by a digest of its text, so a schema sent again costs a hash.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import llguidance
from django.conf import settings

from inference.errors import APIError
from inference.parsers.json_prefix import MAX_WHITESPACE_RUN

# Whitespace JSON may hold between tokens: what models write (a space after ":" and ",",
# newlines and indentation), bounded so a model cannot pad forever (the same bound as the
# tool-call parsers' JSON reader).
JSON_OPTIONS = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE_RUN}}}"}
CALL_WHITESPACE = r"[\x20\x0A]{0,4}"
# An integer a schema leaves unbounded gets I-JSON's range (RFC 7493: what every JSON reader
# holds exactly): without a bound a small model writes digits until max_tokens (8,138 were
# seen; Python's json reads at most 4,300). llguidance compares bounds as doubles, which is
# exact here and not at 2**63.
MAX_SAFE_INTEGER = 2**53 - 1
# Keys whose values are JSON data rather than schemas.
_DATA_KEYS = frozenset({"const", "enum", "default", "examples", "x-guidance"})
EXTENSION_KINDS = ("json", "regex", "grammar", "choice")
ERROR_TOO_LARGE = (
    "the grammar it makes is {size} bytes, over the limit of {limit} bytes for one request."
)
CHECKED_GRAMMARS = 4096  # verdicts kept (32-byte digests and short messages)
_checked_grammars: collections.OrderedDict[bytes, str] = collections.OrderedDict()
_checked_lock = threading.Lock()


def _refused(param: str, detail: str) -> APIError:
    return APIError(400, f"Invalid '{param}': {detail}", param=param, code="invalid_grammar")


def _checked(grammar: str, param: str) -> str:
    """`grammar` if llguidance takes it within the grammar budget, else a 400 naming `param`."""
    text = grammar.encode()
    limit = settings.ORCHARD_GRAMMAR_MAX_BYTES
    if len(text) > limit:
        raise _refused(param, ERROR_TOO_LARGE.format(size=len(text), limit=limit))
    digest = hashlib.sha256(text).digest()
    with _checked_lock:
        error = _checked_grammars.get(digest)
        if error is not None:
            _checked_grammars.move_to_end(digest)
    if error is None:
        error = llguidance.LLMatcher.validate_grammar(grammar)
        error = error.strip().splitlines()[0][:500] if error else ""
        with _checked_lock:
            _checked_grammars[digest] = error
            while len(_checked_grammars) > CHECKED_GRAMMARS:
                _checked_grammars.popitem(last=False)
    if error:
        raise _refused(param, error)
    return grammar


def json_schema_grammar(schema: Any, param: str) -> str:
    if not isinstance(schema, dict | bool):
        raise _refused(param, "the schema must be a JSON object.")
    # The grammar holds the schema: one whose JSON alone passes the limit is refused before
    # llguidance builds a grammar of it.
    limit = settings.ORCHARD_GRAMMAR_MAX_BYTES
    size = json_size_past(schema, limit)
    if size is not None:
        raise _refused(param, ERROR_TOO_LARGE.format(size=f"at least {size}", limit=limit))
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            bounded_integers(schema), defaults=JSON_OPTIONS
        )
    except (ValueError, TypeError) as exc:
        raise _refused(param, str(exc)) from None
    return _checked(grammar, param)


def json_size_past(value: Any, limit: int) -> int | None:
    """A lower bound of the size of `value` as compact JSON, once that passes `limit` (None if
    it never does). The walk stops there: a schema of 250,000 enum entries is refused after
    the first part of them, not after serializing all of them (46 ms holding the interpreter
    lock, measured here, while every other request of the process waits). Characters, not
    UTF-8 bytes or escapes, so never more than the JSON's size."""
    size = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            size += len(item) + 2  # its quotes
        elif isinstance(item, dict):
            size += 2 + 2 * len(item) - 1 if item else 2  # braces, colons, commas
            for key, child in item.items():
                size += len(key) + 2
                stack.append(child)
        elif isinstance(item, list):
            size += 2 + len(item) - 1 if item else 2  # brackets, commas
            stack.extend(item)
        else:
            size += 4 if item is None or isinstance(item, bool) else len(str(item))
        if size > limit:
            return size
    return None


def bounded_integers(schema: Any) -> Any:
    """A copy of `schema` in which every integer has a minimum and a maximum: ±MAX_SAFE_INTEGER
    on a side the schema leaves open, unless its own bound on the other side is beyond it."""
    if isinstance(schema, list):
        return [bounded_integers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    bounded = {k: v if k in _DATA_KEYS else bounded_integers(v) for k, v in schema.items()}
    kind = schema.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        lower = [schema.get(k) for k in ("minimum", "exclusiveMinimum") if k in schema]
        upper = [schema.get(k) for k in ("maximum", "exclusiveMaximum") if k in schema]
        if not upper and not any(_numeric(b) and b > MAX_SAFE_INTEGER for b in lower):
            bounded["maximum"] = MAX_SAFE_INTEGER
        if not lower and not any(_numeric(b) and b < -MAX_SAFE_INTEGER for b in upper):
            bounded["minimum"] = -MAX_SAFE_INTEGER
    return bounded


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def response_format_grammar(response_format: Mapping[str, Any] | None, param: str) -> str | None:
    """The grammar of a chat `response_format` or a responses `text.format` (whose json_schema
    fields sit at the top level rather than under `json_schema`)."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return json_schema_grammar({"type": "object"}, param)
    spec = response_format.get("json_schema", response_format)
    if not isinstance(spec, dict):
        raise _refused(param, "json_schema must be an object with a 'schema'.")
    schema = spec.get("schema", {"type": "object"})
    return json_schema_grammar(schema, param)


def extension_grammar(value: Any, param: str = "structured_outputs") -> str | None:
    if value is None:
        return None
    kinds = [k for k in EXTENSION_KINDS if isinstance(value, dict) and value.get(k) is not None]
    if len(kinds) != 1:
        raise _refused(param, f"give exactly one of {', '.join(EXTENSION_KINDS)}.")
    kind, spec = kinds[0], value[kinds[0]]
    where = f"{param}.{kind}"
    if kind == "json":
        return json_schema_grammar(spec, where)
    if kind == "choice":
        if not isinstance(spec, list) or not spec or not all(isinstance(c, str) for c in spec):
            raise _refused(where, "choice must be a non-empty list of strings.")
        spec, kind = "|".join(re.escape(choice) for choice in spec), "regex"
    if not isinstance(spec, str) or not spec:
        raise _refused(where, f"{kind} must be a non-empty string.")
    try:
        if kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        else:
            grammar = llguidance.LLMatcher.grammar_from_lark(spec)
    except (ValueError, TypeError) as exc:
        raise _refused(where, str(exc)) from None
    return _checked(grammar, where)


def _literal(text: str, added_tokens: Mapping[str, int]) -> str:
    """Lark for `text`: a reference to the token by id when the tokenizer has it as one token
    of its own (<tool_call>, [TOOL_CALLS], ...: such tokens never match as text), else a
    string."""
    if text in added_tokens:
        return f"<[{int(added_tokens[text])}]>"
    return json.dumps(text)


def _call_object(tools: Sequence[Mapping[str, Any]], arguments_key: str) -> dict[str, Any]:
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"const": tool["function"]["name"]},
                arguments_key: tool["function"].get("parameters") or {"type": "object"},
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for tool in tools
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def _json_rule(schema: Mapping[str, Any]) -> str:
    """A JSON value of `schema` inside a Lark grammar, with the little whitespace tool calls
    have (models write them on one line)."""
    guided = {**bounded_integers(schema), "x-guidance": {"whitespace_pattern": CALL_WHITESPACE}}
    return "%json " + json.dumps(guided, separators=(",", ":"))


def tool_call_grammar(
    parser: str,
    tools: Sequence[Mapping[str, Any]],
    *,
    parallel: bool,
    added_tokens: Mapping[str, int],
) -> str | None:
    """A Lark grammar whose every sentence is one call (several with `parallel`) of one of
    `tools` in the syntax `parser` reads; None for a parser with no such grammar here."""
    lit = lambda text: _literal(text, added_tokens)  # noqa: E731
    more = "*" if parallel else ""
    if parser == "hermes":
        call = f'{lit("<tool_call>")} "\\n" body "\\n" {lit("</tool_call>")}'
        lark = f'start: call ("\\n" call){more}\ncall: {call}\n'
        lark += f"body: {_json_rule(_call_object(tools, 'arguments'))}\n"
    elif parser == "llama3_json":
        lark = (
            f'start: body (";" body){more}\nbody: {_json_rule(_call_object(tools, "parameters"))}\n'
        )
    elif parser == "mistral":
        calls = {"type": "array", "items": _call_object(tools, "arguments"), "minItems": 1}
        if not parallel:
            calls["maxItems"] = 1
        lark = f"start: {lit('[TOOL_CALLS]')} body\nbody: {_json_rule(calls)}\n"
    elif parser == "qwen3_coder":
        lark = f'start: call ("\\n" call){more}\n'
        lark += f'call: {lit("<tool_call>")} "\\n" function "\\n" {lit("</tool_call>")}\n'
        functions = []
        for index, tool in enumerate(tools):
            name = tool["function"]["name"]
            names = list((tool["function"].get("parameters") or {}).get("properties") or {})
            parameter = f"p{index}"
            functions.append(f"f{index}")
            lark += f'f{index}: "<function=" {json.dumps(name)} ">\\n" {parameter}* "</function>"\n'
            choices = " | ".join(json.dumps(n) for n in names) or '"_"'
            lark += f'{parameter}: "<parameter=" ({choices}) ">\\n" VALUE "</parameter>\\n"\n'
        lark += f"function: {' | '.join(functions)}\nVALUE: /[^<]*/\n"
    elif parser == "harmony":
        alternatives, rules = [], ""
        for index, tool in enumerate(tools):
            schema = tool["function"].get("parameters") or {"type": "object"}
            recipient = json.dumps(f"commentary to=functions.{tool['function']['name']} ")
            head = f'{lit("<|channel|>")} {recipient} {lit("<|constrain|>")} "json"'
            alternatives.append(f"c{index}")
            rules += f"c{index}: {head} {lit('<|message|>')} a{index} {lit('<|call|>')}\n"
            rules += f"a{index}: {_json_rule(schema)}\n"
        lark = f"start: {' | '.join(alternatives)}\n" + rules
    else:
        return None
    return _checked(llguidance.LLMatcher.grammar_from_lark(lark), "tool_choice")
