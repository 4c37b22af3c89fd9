"""An Anthropic message's content blocks, built from its generation's deltas, and the stream
events that say so.

`MessageBuilder` is the one place blocks are made: the streamed message is its events, the
non-streamed one its final state. Reasoning becomes a `thinking` block, text a `text` block,
each tool call a `tool_use` block whose `input` streams as `input_json_delta` pieces; a new kind
closes the block before it, and whitespace between blocks makes no block of its own.
"""

from __future__ import annotations

import json
from typing import Any

from inference.api.anthropic.convert import tool_use_id
from inference.parsers.base import ToolCallDelta
from inference.services.output import ChoiceDelta

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}


def stop_reason(finish_reason: str | None, stop_sequence: str | None) -> str:
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(finish_reason or "", "end_turn")


class MessageBuilder:
    def __init__(self, message: dict[str, Any]):
        self.message = message  # its "content" fills as blocks close
        self._open: dict[str, Any] | None = None
        self._arguments = ""  # the open tool_use block's input JSON so far
        self._calls: dict[int, dict[str, Any]] = {}
        self._whitespace = ""

    @property
    def content(self) -> list[dict[str, Any]]:
        return self.message["content"]

    def start(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        start = {**self.message, "content": [], "usage": usage}
        return [{"type": "message_start", "message": start}, {"type": "ping"}]

    def feed(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            events += self._delta(
                "thinking", {"type": "thinking_delta", "thinking": delta.reasoning}
            )
        if delta.content:
            if self._kind() == "text":
                events += self._delta("text", {"type": "text_delta", "text": delta.content})
            elif not (self._whitespace + delta.content).strip():
                self._whitespace += delta.content
            else:
                text, self._whitespace = self._whitespace + delta.content, ""
                events += self._delta("text", {"type": "text_delta", "text": text})
        for call in delta.tool_calls:
            events += self._tool_call(call)
        return events

    def finish(self, reason: str, stop_sequence: str | None, usage: dict) -> list[dict[str, Any]]:
        events = self._close()
        self.message.update(stop_reason=reason, stop_sequence=stop_sequence, usage=usage)
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": reason, "stop_sequence": stop_sequence},
                "usage": usage,
            }
        )
        events.append({"type": "message_stop"})
        return events

    def _kind(self) -> str | None:
        return self._open["type"] if self._open is not None else None

    def _delta(self, kind: str, delta: dict[str, Any]) -> list[dict[str, Any]]:
        events = []
        if self._kind() != kind:
            events += self._close()
            block = {"type": "text", "text": ""}
            if kind == "thinking":
                block = {"type": "thinking", "thinking": "", "signature": ""}
            events += self._start_block(block)
        field = "text" if kind == "text" else "thinking"
        self._open[field] += delta[field]
        events.append({"type": "content_block_delta", "index": len(self.content), "delta": delta})
        return events

    def _start_block(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = block
        start = {**block, "input": {}} if block["type"] == "tool_use" else dict(block)
        return [{"type": "content_block_start", "index": len(self.content), "content_block": start}]

    def _tool_call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        events = []
        if call.id is not None:
            events += self._close()
            self._whitespace = ""
            block = {"type": "tool_use", "id": tool_use_id(), "name": call.name, "input": {}}
            self._calls[call.index] = block
            self._arguments = ""
            events += self._start_block(block)
        if self._calls.get(call.index) is not self._open or not call.arguments:
            return events
        self._arguments += call.arguments
        events.append(
            {
                "type": "content_block_delta",
                "index": len(self.content),
                "delta": {"type": "input_json_delta", "partial_json": call.arguments},
            }
        )
        return events

    def _close(self) -> list[dict[str, Any]]:
        block, self._open = self._open, None
        if block is None:
            return []
        events = []
        index = len(self.content)
        if block["type"] == "tool_use":
            try:
                parsed = json.loads(self._arguments or "{}")
            except ValueError:
                parsed = {}
            block["input"] = parsed if isinstance(parsed, dict) else {"value": parsed}
        elif block["type"] == "thinking":
            events.append(
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "signature_delta", "signature": ""},
                }
            )
        self.content.append(block)
        events.append({"type": "content_block_stop", "index": index})
        return events
