"""harmony: gpt-oss replies in OpenAI's harmony format, parsed by `openai-harmony` from the
token ids (engine/text/harmony.py loads its encoding offline). Channel `analysis` is reasoning,
`final` is content, a message addressed `to=functions.NAME` is a call of NAME whose message is
its arguments (streamed as generated); commentary without a recipient (a preamble) is
content."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from engine import harmony_encoding
from inference.parsers.base import ParsedDelta, ToolCallDelta, ToolParser

logger = logging.getLogger(__name__)


class HarmonyParser(ToolParser):
    name = "harmony"
    uses_token_ids = True
    also_reasoning = True

    def __init__(self, tools=(), *, parallel: bool = True, model_path: str = "", calls=True):
        super().__init__(tools, parallel=parallel)
        from openai_harmony import Role, StreamableParser

        self._parser = StreamableParser(harmony_encoding(model_path), role=Role.ASSISTANT)
        self._calls = calls  # False: tool calls are not parsed (tool_choice none): content
        self._message = -1  # the index of the message the current call belongs to
        self._call: ToolCallDelta | None = None
        self._broken = False

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        out = ParsedDelta()
        if self._broken:
            out.content += text  # no longer harmony: the text as decoded
            return out
        for token_id in token_ids:
            try:
                self._parser.process(token_id)
            except Exception as exc:  # HarmonyError: not harmony after all
                logger.warning("harmony parsing stopped: %s", exc)
                self._broken = True
                break
            self._route(out, self._parser.last_content_delta or "")
        return out

    def _route(self, out: ParsedDelta, delta: str) -> None:
        channel = self._parser.current_channel
        recipient = self._parser.current_recipient
        if channel is None:
            return
        if recipient and self._calls:
            message = len(self._parser.messages)
            if message != self._message:
                self._message = message
                self._call = self.start_call(recipient.removeprefix("functions."))
                if self._call is not None:
                    out.add(ParsedDelta(tool_calls=[self._call]))
            if delta and self._call is not None:
                out.add(
                    ParsedDelta(tool_calls=[ToolCallDelta(index=self._call.index, arguments=delta)])
                )
        elif channel == "analysis":
            out.reasoning += delta
        else:  # final, or commentary meant for the user
            out.content += delta

    def finish(self) -> ParsedDelta:
        if not self._broken:
            try:
                self._parser.process_eos()
            except Exception:
                pass
        return ParsedDelta()
