"""qwen3_coder: calls as XML inside `<tool_call>` (Qwen3-Coder, Qwen3-Next templates)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Arguments become a JSON object, one parameter at a time as each closes; a parameter's value is
typed by the tool's JSON schema (a string unless the schema says otherwise and it parses)."""

from __future__ import annotations

import json
import re
from typing import Any

from inference.parsers.base import ToolCallDelta
from inference.parsers.tagged import CallBody, TaggedToolParser

FUNCTION = re.compile(r"<function=([^>\n]+)>")
PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
FUNCTION_END = "</function>"


def _typed(value: str, schema: dict[str, Any] | None) -> Any:
    kind = (schema or {}).get("type")
    if kind in (None, "string") or (isinstance(kind, list) and "string" in kind):
        return value
    try:
        return json.loads(value)
    except ValueError:
        return value


class _XmlBody(CallBody):
    def __init__(self, parser: TaggedToolParser) -> None:
        self.parser = parser
        self.buffer = ""
        self.call: ToolCallDelta | None = None
        self.dropped = False
        self.num_parameters = 0
        self.closed = False

    def _schema(self, name: str) -> dict[str, Any] | None:
        function = self.parser.tools.get(self.call.name) if self.call is not None else None
        properties = ((function or {}).get("parameters") or {}).get("properties") or {}
        return properties.get(name)

    def feed(self, text: str) -> list[ToolCallDelta]:
        self.buffer += text
        deltas: list[ToolCallDelta] = []
        if self.call is None and not self.dropped:
            head = FUNCTION.search(self.buffer)
            if head is None:
                return deltas
            self.call = self.parser.start_call(head.group(1).strip())
            self.dropped = self.call is None
            self.buffer = self.buffer[head.end() :]
            if self.call is not None:
                self.call.arguments = "{"
                deltas.append(self.call)
        while not self.closed:
            parameter = PARAMETER.search(self.buffer)
            end = self.buffer.find(FUNCTION_END)
            if parameter is not None and (end < 0 or parameter.start() < end):
                name, value = parameter.group(1).strip(), parameter.group(2)
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                piece = (
                    json.dumps(name)
                    + ": "
                    + json.dumps(_typed(value, self._schema(name)), ensure_ascii=False)
                )
                self._emit(deltas, (", " if self.num_parameters else "") + piece)
                self.num_parameters += 1
                self.buffer = self.buffer[parameter.end() :]
            elif end >= 0:
                self._emit(deltas, "}")
                self.closed = True
                self.buffer = ""
            else:
                break
        return deltas

    def _emit(self, deltas: list[ToolCallDelta], arguments: str) -> None:
        if self.call is not None:
            deltas.append(ToolCallDelta(index=self.call.index, arguments=arguments))

    def finish(self, *, complete: bool) -> tuple[list[ToolCallDelta], bool]:
        if self.call is None and not self.dropped:
            return [], False
        deltas: list[ToolCallDelta] = []
        if not self.closed:  # the block ended without </function>: close the object
            self._emit(deltas, "}")
            self.closed = True
        return deltas, True


class Qwen3CoderToolParser(TaggedToolParser):
    name = "qwen3_coder"

    def new_body(self) -> CallBody:
        return _XmlBody(self)
