"""What every tool-call and reasoning parser shares: the deltas they produce and the streaming
helpers they are built from.

A parser instance belongs to one choice of one response (the output stage makes a fresh one
per choice), so parsers keep per-stream state freely and nothing is shared between streams.
`feed` takes the text (and token ids) one engine output adds and returns what is final by now;
text that could still turn out to be markup (the start of a tag split across tokens) is held
back until the next feed or `finish`.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from inference.parsers.json_prefix import (
    AFTER_VALUE,
    ARRAY_OPEN,
    DONE,
    ESCAPE,
    INITIAL,
    LITERAL,
    NUMBER,
    OBJECT_OPEN,
    STRING,
    UNICODE,
    advance,
    closing_text,
)

_CLEAN_MODES = frozenset({AFTER_VALUE, ARRAY_OPEN, DONE, LITERAL, NUMBER, OBJECT_OPEN})
_IN_STRING = frozenset({STRING, ESCAPE, UNICODE})


@dataclass
class ToolCallDelta:
    """A piece of one tool call: the first piece of a call carries its id and name, later ones
    more of its arguments (JSON text; the pieces of one call join into its arguments)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def add(self, other: ParsedDelta) -> ParsedDelta:
        self.content += other.content
        self.reasoning += other.reasoning
        for call in other.tool_calls:
            last = self.tool_calls[-1] if self.tool_calls else None
            if last is not None and last.index == call.index and call.id is None:
                last.arguments += call.arguments  # one piece per call and feed
            else:
                self.tool_calls.append(call)
        return self

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser:
    """Base of tool-call parsers: `feed` the reply's text, get content and tool-call deltas.

    `markers` are special tokens the parser reads that tokenizers mark as special (skipped
    from text unless the engine is told to keep them). `uses_token_ids`: the parser reads the
    token ids (harmony) and ignores the text. `also_reasoning`: it splits reasoning itself."""

    name: ClassVar[str]
    markers: ClassVar[tuple[str, ...]] = ()
    uses_token_ids: ClassVar[bool] = False
    also_reasoning: ClassVar[bool] = False

    def __init__(self, tools: Sequence[dict[str, Any]] = (), *, parallel: bool = True):
        self.tools = {
            t["function"]["name"]: t["function"]
            for t in tools
            if isinstance(t, dict) and "function" in t
        }
        self.parallel = parallel
        self.num_calls = 0

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        return ParsedDelta()

    # Helpers for subclasses.
    def start_call(self, name: str) -> ToolCallDelta | None:
        """The first delta of a new call, or None when the call is dropped (a second call with
        parallel_tool_calls false)."""
        if not self.parallel and self.num_calls >= 1:
            return None
        self.num_calls += 1
        return ToolCallDelta(index=self.num_calls - 1, id=new_call_id(), name=name)


def partial_suffix(text: str, tags: Sequence[str]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of one of `tags` (text
    to hold back: the tag may be completed by the next token)."""
    longest = max((len(t) for t in tags), default=1) - 1
    for length in range(min(len(text), longest), 0, -1):
        tail = text[-length:]
        if any(t.startswith(tail) for t in tags):
            return length
    return 0


def _clean(state) -> bool:
    """Whether arguments cut at this state close into what was meant so far: after a value,
    just inside a container, or inside a value (not between a key and its value)."""
    mode = state[0]
    return mode in _CLEAN_MODES or (mode == STRING and state[2] is False)


class JsonArguments:
    """Streams one JSON object (a call's arguments) as it is generated: every piece it passes
    on is a valid prefix of a JSON object; `done` once the object closed. Separators and keys
    are passed on once their value starts. If the model breaks the JSON, the arguments are
    closed after the last value passed on (the rest is dropped), so the call still parses."""

    def __init__(self) -> None:
        self.state = INITIAL
        self.sent_state = INITIAL  # the state after the last character passed on
        self.held = ""  # characters since then (a separator, a key)
        self.after_space = False  # the last character given to the recogniser was whitespace
        self.started = False
        self.done = False
        self.broken = False

    def feed(self, text: str) -> tuple[str, str]:
        """Returns (argument text taken, text left after the object)."""
        taken = []
        for position, ch in enumerate(text):
            if self.done:
                return "".join(taken), text[position:]
            if not self.started and ch in " \t\r\n":
                continue
            space = ch in " \t\r\n" and self.state[0] not in _IN_STRING
            if space and self.after_space:
                # The recogniser limits whitespace runs (for JSON mode); one space is enough.
                self.held += ch
                continue
            self.after_space = space
            state = advance(self.state, ch)
            if state is None:
                self.broken = True
                self.done = True
                taken.append(closing_text(self.sent_state))
                return "".join(taken), ""
            self.started = True
            self.state = state
            self.held += ch
            if _clean(state):
                taken.append(self.held)
                self.held = ""
                self.sent_state = state
            if state[0] == DONE:
                self.done = True
                return "".join(taken), text[position + 1 :]
        return "".join(taken), ""

    def close(self) -> str:
        """The text that closes arguments cut short (after their last value passed on)."""
        if self.done:
            return ""
        self.done = True
        if not self.started:
            return "{}"
        return closing_text(self.sent_state)


# `{"name": "...", "arguments": ` (or "parameters") at the start of a call object, and the
# character after it (only an object streams; a string-encoded one is read whole).
CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(\S)'
)


class JsonCallStream:
    """One `{"name": ..., "arguments": {...}}` object, streamed: the call starts once its name
    is known and its arguments stream as they come. Objects in another shape (arguments first,
    arguments as a JSON string) are read whole when they end."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.buffer = ""
        self.call: ToolCallDelta | None = None
        self.dropped = False  # a call parallel_tool_calls=false leaves out
        self.arguments: JsonArguments | None = None
        self.closed = False  # the call object's own closing brace came
        self.after = ""  # text after the call object
        self.whole = False  # a shape that is read whole when it ends

    @property
    def streaming(self) -> bool:
        return self.arguments is not None

    def feed(self, text: str) -> list[ToolCallDelta]:
        if self.arguments is None:
            self.buffer += text
            head = None if self.whole else CALL_HEAD.match(self.buffer)
            if head is None:
                return []
            try:
                name = json.loads(f'"{head.group(1)}"')
            except ValueError:
                name = None
            if name is None or head.group(2) != "{":
                self.whole = True  # not streamable: read whole at the end
                return []
            self.call = self.parser.start_call(name)
            self.dropped = self.call is None
            self.arguments = JsonArguments()
            text = self.buffer[head.start(2) :]
            deltas = [self.call] if self.call is not None else []
        else:
            deltas = []
        if self.arguments.broken:
            return deltas  # what follows broken arguments is dropped, however it is split
        rest = text
        if not self.arguments.done:
            piece, rest = self.arguments.feed(text)
            if piece and self.call is not None:
                deltas.append(ToolCallDelta(index=self.call.index, arguments=piece))
        if self.arguments.broken:
            return deltas
        if self.arguments.done and not self.closed:
            stripped = rest.lstrip()
            if stripped:
                self.closed = True
                rest = stripped.removeprefix("}")
        if self.closed:
            self.after += rest
        return deltas

    def finish(self, *, close: bool = False) -> tuple[list[ToolCallDelta], str | None]:
        """At the end of the object's text: the deltas still due, or (nothing, the raw text)
        when it was no call at all (the caller shows it as content). With `close` (the model
        ended the call), arguments cut short are closed so that they parse."""
        if self.arguments is not None:
            tail = self.arguments.close() if close else ""
            if tail and self.call is not None:
                return [ToolCallDelta(index=self.call.index, arguments=tail)], None
            return [], None
        try:
            value = json.loads(self.buffer)
        except ValueError:
            return [], self.buffer
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return [], self.buffer
        arguments = value.get("arguments", value.get("parameters", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return [], self.buffer
        if not isinstance(arguments, dict):
            return [], self.buffer
        call = self.parser.start_call(value["name"])
        if call is None:
            return [], None  # a call, left out (parallel_tool_calls false)
        call.arguments = json.dumps(arguments, ensure_ascii=False)
        return [call], None
