"""hermes / qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes 2 Pro,
Qwen 2.5 and Qwen 3). Arguments stream as they are generated."""

from __future__ import annotations

from inference.parsers.base import JsonCallStream, ToolCallDelta
from inference.parsers.tagged import CallBody, TaggedToolParser


class _JsonBody(CallBody):
    def __init__(self, parser: TaggedToolParser) -> None:
        self.call = JsonCallStream(parser)

    def feed(self, text: str) -> list[ToolCallDelta]:
        return self.call.feed(text)

    def finish(self, *, complete: bool) -> tuple[list[ToolCallDelta], bool]:
        deltas, raw = self.call.finish(close=complete)
        return deltas, raw is None


class HermesToolParser(TaggedToolParser):
    name = "hermes"

    def new_body(self) -> CallBody:
        return _JsonBody(self)
