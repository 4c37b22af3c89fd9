"""mistral: `[TOOL_CALLS]` then either a JSON list of `{"name", "arguments"}` objects (older
tokenizers) or `name[ARGS]{...}` per call (v11 and later; `[CALL_ID]id` may sit between)."""

from __future__ import annotations

from collections.abc import Sequence

from inference.parsers.base import (
    JsonArguments,
    JsonCallStream,
    ParsedDelta,
    ToolCallDelta,
    ToolParser,
    partial_suffix,
)

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (TOOL_CALLS, ARGS, CALL_ID)

    def __init__(self, tools=(), *, parallel: bool = True):
        super().__init__(tools, parallel=parallel)
        self._pending = ""
        self._mode = "content"  # content | after_marker | list | name | arguments
        self._call: JsonCallStream | None = None
        self._arguments: JsonArguments | None = None
        self._current: ToolCallDelta | None = None

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        out = ParsedDelta()
        self._pending += text
        while self._pending:
            mode = self._mode
            if mode == "content":
                at = self._pending.find(TOOL_CALLS)
                if at < 0:
                    keep = partial_suffix(self._pending, (TOOL_CALLS,))
                    out.content += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                out.content += self._pending[:at].rstrip() if self.num_calls else self._pending[:at]
                self._pending = self._pending[at + len(TOOL_CALLS) :]
                self._mode = "after_marker"
            elif mode == "after_marker":
                stripped = self._pending.lstrip()
                if not stripped:
                    self._pending = ""
                    break
                if stripped.startswith("["):
                    self._pending = stripped[1:]
                    self._mode = "list"
                else:
                    self._pending = stripped
                    self._mode = "name"
            elif mode == "list":
                if self._call is None:
                    stripped = self._pending.lstrip().lstrip(",").lstrip()
                    if not stripped:
                        self._pending = ""
                        break
                    if stripped.startswith("]"):
                        self._pending = stripped[1:]
                        self._mode = "content"
                        continue
                    self._call = JsonCallStream(self)
                    self._pending = stripped
                out.add(ParsedDelta(tool_calls=self._call.feed(self._pending)))
                self._pending = ""
                if self._call.closed:
                    self._pending = self._call.after
                    self._call = None
            elif mode == "name":
                at = self._pending.find(ARGS)
                if at < 0:
                    break  # the name is short: wait for [ARGS]
                name = self._pending[:at].split(CALL_ID)[0].strip()
                self._pending = self._pending[at + len(ARGS) :]
                self._current = self.start_call(name)
                if self._current is not None:
                    out.add(ParsedDelta(tool_calls=[self._current]))
                self._arguments = JsonArguments()
                self._mode = "arguments"
            elif mode == "arguments":
                piece, rest = self._arguments.feed(self._pending)
                if piece and self._current is not None:
                    out.add(
                        ParsedDelta(
                            tool_calls=[ToolCallDelta(index=self._current.index, arguments=piece)]
                        )
                    )
                self._pending = rest
                if not self._arguments.done:
                    break
                # What follows broken arguments is dropped, however the text is split.
                self._mode = "dropped" if self._arguments.broken else "content"
            elif mode == "dropped":
                self._pending = ""
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode in ("content", "name"):  # (a name never followed by [ARGS]: no call)
            out.content += self._pending
        elif self._mode == "list" and self._call is not None and not self._call.streaming:
            deltas, raw = self._call.finish()
            out.add(ParsedDelta(tool_calls=deltas))
            if raw:
                out.content += raw
        self._pending = ""
        return out
