"""Calls wrapped in start and end tags, with content around them (hermes / qwen3 and
qwen3-coder both put each call in `<tool_call>…</tool_call>`; only the body differs)."""

from __future__ import annotations

from collections.abc import Sequence

from inference.parsers.base import ParsedDelta, ToolCallDelta, ToolParser, partial_suffix


class CallBody:
    """One call's body between the tags, streamed."""

    def feed(self, text: str) -> list[ToolCallDelta]:
        raise NotImplementedError

    def finish(self, *, complete: bool) -> tuple[list[ToolCallDelta], bool]:
        """The deltas still due when the body ends (`complete`: at its end tag, not cut off by
        the end of the reply), and whether it was a call at all (if not, the block is shown as
        content, as generated)."""
        raise NotImplementedError


class TaggedToolParser(ToolParser):
    """Text outside the tags is content (whitespace between and around calls is dropped);
    each tagged block is a call, streamed by the subclass's `CallBody`."""

    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, tools=(), *, parallel: bool = True):
        super().__init__(tools, parallel=parallel)
        self._pending = ""  # text not yet parsed (a possible partial tag at its end)
        self._body: CallBody | None = None
        self._raw = ""  # the current block as generated, shown if it is no call
        self._space = ""  # whitespace-only content, held: dropped if a call follows
        self._dropped_space = ""  # restored if the block turns out to be no call

    def new_body(self) -> CallBody:
        raise NotImplementedError

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        out = ParsedDelta()
        self._pending += text
        while self._pending:
            if self._body is None:
                at = self._pending.find(self.start_tag)
                if at < 0:
                    keep = partial_suffix(self._pending, (self.start_tag,))
                    self._content(out, self._pending[: len(self._pending) - keep])
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                self._content(out, self._pending[:at])
                self._pending = self._pending[at + len(self.start_tag) :]
                self._dropped_space, self._space = self._space, ""
                self._body = self.new_body()
                self._raw = self.start_tag
            else:
                at = self._pending.find(self.end_tag)
                if at < 0:
                    keep = partial_suffix(self._pending, (self.end_tag,))
                    body = self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    self._raw += body
                    out.add(ParsedDelta(tool_calls=self._body.feed(body)))
                    break
                body = self._pending[:at]
                self._pending = self._pending[at + len(self.end_tag) :]
                self._raw += body + self.end_tag
                out.add(ParsedDelta(tool_calls=self._body.feed(body)))
                out.add(self._end_block(complete=True))
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self._body is not None:  # the reply ended inside a call (a length stop, or no end tag)
            self._raw += self._pending
            out.add(ParsedDelta(tool_calls=self._body.feed(self._pending)))
            self._pending = ""
            out.add(self._end_block(complete=False))
        else:
            self._content(out, self._pending, final=True)
            self._pending = ""
        return out

    def _end_block(self, *, complete: bool) -> ParsedDelta:
        deltas, was_call = self._body.finish(complete=complete)
        self._body = None
        if was_call:
            return ParsedDelta(tool_calls=deltas)
        return ParsedDelta(content=self._dropped_space + self._raw)

    def _content(self, out: ParsedDelta, text: str, *, final: bool = False) -> None:
        """Content, with trailing whitespace held: a call that follows drops it."""
        body = text.rstrip()
        if body:
            out.content += self._space + body
            self._space = ""
        self._space += text[len(body) :]
        if final and not self.num_calls:
            out.content += self._space
            self._space = ""
