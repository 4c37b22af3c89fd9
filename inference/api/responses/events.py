"""A response's output items, built from its generation's deltas, and the stream events that
say so.

`ResponseBuilder` is the one place output items are made: the streamed response is its events,
the non-streamed one its final state (the same deltas, so the two always agree). Reasoning
becomes a `reasoning` item (its text a `reasoning_text` part), text a `message` item (an
`output_text` part), each tool call a `function_call` item; a new kind of output closes the
item before it. Whitespace between items (after a reasoning block, before a call) makes no
message of its own. Every event carries the next `sequence_number`.
"""

from __future__ import annotations

import copy
from typing import Any

from inference.api.responses.items import new_id
from inference.parsers.base import ToolCallDelta
from inference.services.output import ChoiceDelta

# The event that ends a stream, by the response's final status.
FINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
}


class ResponseBuilder:
    def __init__(self, response: dict[str, Any], namespaced: dict[str, tuple[str, str]]):
        self.response = response  # the response object; its "output" fills as items close
        self.namespaced = namespaced
        self.reasoning_tokens = 0
        self._sequence = 0
        self._open: dict[str, Any] | None = None  # the item deltas go to now
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its item
        self._whitespace = ""  # text held until it turns out to start a message

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.response["output"]

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event

    def _snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.response)

    def start(self) -> list[dict[str, Any]]:
        return [
            self._event("response.created", response=self._snapshot()),
            self._event("response.in_progress", response=self._snapshot()),
        ]

    def feed(self, delta: ChoiceDelta) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.reasoning:
            # Tokens of outputs that were all reasoning (an output is about one token).
            self.reasoning_tokens += delta.num_tokens if not delta.content else 0
            events += self._text("reasoning", delta.reasoning)
        if delta.content:
            if self._kind() == "message":
                events += self._text("message", delta.content)
            elif not (self._whitespace + delta.content).strip():
                self._whitespace += delta.content
            else:
                text, self._whitespace = self._whitespace + delta.content, ""
                events += self._text("message", text)
        for call in delta.tool_calls:
            events += self._tool_call(call)
        return events

    def finish(self, status: str, *, error: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        """Close what is open and end the response with `status` (completed, incomplete or
        failed); the last event is the final one."""
        events = self._close("incomplete" if status == "incomplete" else "completed")
        self.response["status"] = status
        if status == "incomplete":
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
        if error is not None:
            self.response["error"] = error
        self.response["output_text"] = output_text(self.output)
        events.append(self._event(FINAL_EVENTS[status], response=self._snapshot()))
        return events

    def error(self, message: str) -> dict[str, Any]:
        """An `error` event: the stream broke outside the generation."""
        return self._event("error", code="server_error", message=message, param=None)

    def _kind(self) -> str | None:
        return self._open["type"] if self._open is not None else None

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._kind() != kind:
            events += self._close("completed")
            events += self._open_text_item(kind)
        item = self._open
        part = item["content"][0]
        part["text"] += text
        delta_type = (
            "response.output_text.delta" if kind == "message" else ("response.reasoning_text.delta")
        )
        extra = {"logprobs": []} if kind == "message" else {}
        events.append(
            self._event(
                delta_type,
                item_id=item["id"],
                output_index=len(self.output),
                content_index=0,
                delta=text,
                **extra,
            )
        )
        return events

    def _open_text_item(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {
                "id": new_id("msg"),
                "type": "message",
                "status": "in_progress",
                "role": "assistant",
                "content": [],
            }
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {
                "id": new_id("rs"),
                "type": "reasoning",
                "status": "in_progress",
                "summary": [],
                "content": [],
            }
            part = {"type": "reasoning_text", "text": ""}
        self._open = item
        index = len(self.output)
        events = [self._event("response.output_item.added", output_index=index, item=_copy(item))]
        item["content"].append(part)
        events.append(
            self._event(
                "response.content_part.added",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=_copy(part),
            )
        )
        return events

    def _tool_call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        events = []
        if call.id is not None:
            events += self._close("completed")
            self._whitespace = ""
            item = {
                "id": new_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": call.id,
                "name": call.name,
                "arguments": "",
            }
            if call.name in self.namespaced:
                item["namespace"], item["name"] = self.namespaced[call.name]
            self._open = self._calls[call.index] = item
            events.append(
                self._event(
                    "response.output_item.added", output_index=len(self.output), item=_copy(item)
                )
            )
        item = self._calls.get(call.index)
        if item is None or not call.arguments:
            return events
        item["arguments"] += call.arguments
        events.append(
            self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=len(self.output),
                delta=call.arguments,
            )
        )
        return events

    def _close(self, status: str) -> list[dict[str, Any]]:
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.output)
        events = []
        if item["type"] == "function_call":
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        else:
            part = item["content"][0]
            done = (
                "response.output_text.done"
                if item["type"] == "message"
                else ("response.reasoning_text.done")
            )
            extra = {"logprobs": []} if item["type"] == "message" else {}
            events.append(
                self._event(
                    done,
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=part["text"],
                    **extra,
                )
            )
            events.append(
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=_copy(part),
                )
            )
        item["status"] = status
        self.output.append(item)
        events.append(
            self._event("response.output_item.done", output_index=index, item=_copy(item))
        )
        return events


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(value)


def output_text(output: list[dict[str, Any]]) -> str:
    """All `output_text` of the response's messages, joined (the SDKs' `output_text`)."""
    return "".join(
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
