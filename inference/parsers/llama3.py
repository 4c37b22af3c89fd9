"""llama3_json: Llama 3.1 / 3.2 / 3.3 custom tool calls, a JSON object as the whole reply,
`{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`, several separated by
`;`. A reply that does not start like a call is content."""

from __future__ import annotations

import re
from collections.abc import Sequence

from inference.parsers.base import JsonCallStream, ParsedDelta, ToolParser

PYTHON_TAG = "<|python_tag|>"
CALL_START = '{"name"'
_SPACE = re.compile(r"\s+")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)

    def __init__(self, tools=(), *, parallel: bool = True):
        super().__init__(tools, parallel=parallel)
        self._mode = "start"  # start | call | between | content
        self._held = ""
        self._call: JsonCallStream | None = None

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        out = ParsedDelta()
        while text:
            if self._mode == "content":
                out.content += text
                return out
            if self._mode in ("start", "between"):
                self._held += text
                text = ""
                probe = _SPACE.sub("", self._held.replace(PYTHON_TAG, "", 1))
                if self._mode == "between":
                    probe = probe.lstrip(";")
                if not probe or PYTHON_TAG.startswith(self._held.lstrip()):
                    continue
                if CALL_START.startswith(probe[: len(CALL_START)]) and len(probe) < len(CALL_START):
                    continue  # could still be a call
                if probe.startswith(CALL_START):
                    held = self._held.replace(PYTHON_TAG, "", 1)
                    if self._mode == "between":
                        held = held.lstrip().lstrip(";")
                    self._held = ""
                    self._call = JsonCallStream(self)
                    self._mode = "call"
                    text = held
                    continue
                # Not a call: everything so far is content.
                out.content += self._held if self._mode == "start" else self._held.lstrip()
                self._held = ""
                self._mode = "content"
            elif self._mode == "call":
                out.add(ParsedDelta(tool_calls=self._call.feed(text)))
                text = ""
                if self._call.closed:
                    text = self._call.after
                    self._call = None
                    self._mode = "between"
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode == "call" and self._call is not None and not self._call.streaming:
            deltas, raw = self._call.finish()
            if raw is not None:
                out.content += raw
            out.add(ParsedDelta(tool_calls=deltas))
        elif self._mode == "start" or (self._mode == "between" and self._held.strip(" \n;")):
            out.content += self._held
        self._held = ""
        return out
