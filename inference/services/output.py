"""The per-choice output stage: a choice's engine outputs → what a response says about it.

Every endpoint reads its choices through here, streamed or not (a non-streamed reply is the
stream's deltas joined), so whatever this stage learns to do, every endpoint does the same way.
A choice's text goes through the model's reasoning parser (its reasoning block becomes
`reasoning`), then its tool-call parser (calls become `tool_calls` deltas, the rest content);
harmony does both from the token ids. Each choice has its own `ChoiceStage` and parser
instances, never shared between streams. A failed generation is raised as GenerationFailed,
which each endpoint renders in its own error shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine import GenerationOutput, TokenLogprob
from inference.parsers.base import ParsedDelta, ToolCallDelta
from inference.parsers.registry import OutputParsing

# Engine finish reasons that end a choice in failure: what the client is told, and the usage
# row's error code.
# CANCELLED is the web side's own: an "abort" it asked for (inference/services/running.py).
CANCELLED = "cancelled"
FAILURE_MESSAGES = {
    "abort": "The request was aborted by the server (the model was unloaded or the server is "
    "stopping).",
    "error": "The engine failed while generating this response.",
    CANCELLED: "The request was cancelled by an administrator.",
}
FAILURE_CODES = {
    "abort": "engine_aborted",
    "error": "engine_error",
    CANCELLED: "cancelled_by_staff",
}


class GenerationFailed(Exception):
    """A choice ended with finish_reason "error" or "abort" (the usage row says failed), or was
    cancelled by an administrator (the row says cancelled)."""

    def __init__(self, finish_reason: str):
        super().__init__(FAILURE_MESSAGES[finish_reason])
        self.finish_reason = finish_reason
        self.message = FAILURE_MESSAGES[finish_reason]


@dataclass(frozen=True)
class ChoiceDelta:
    """What one engine output adds to one choice of the response."""

    choice: int
    content: str = ""
    logprobs: tuple[TokenLogprob, ...] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "tool_calls"
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    num_tokens: int = 0  # the tokens this output carried
    stop_sequence: str | None = None  # the stop string that ended the choice, if one did


class ChoiceStage:
    """One choice's output handling: reasoning parser, then tool-call parser (either may be
    absent: text passes through as content)."""

    def __init__(self, choice: int, parsing: OutputParsing | None = None):
        self.choice = choice
        parsing = parsing or OutputParsing()
        self._tools = parsing.new_tool_parser()
        self._reasoning = parsing.new_reasoning_parser()

    def feed(self, output: GenerationOutput) -> ChoiceDelta:
        if output.finish_reason in FAILURE_MESSAGES:
            raise GenerationFailed(output.finish_reason)
        parsed = self._parse(output.text, output.token_ids)
        finish_reason = output.finish_reason
        if finish_reason is not None:
            parsed.add(self._finish())
            if finish_reason == "stop" and self._tools is not None and self._tools.num_calls:
                finish_reason = "tool_calls"
        return ChoiceDelta(
            choice=self.choice,
            content=parsed.content,
            logprobs=output.logprobs,
            finish_reason=finish_reason,
            reasoning=parsed.reasoning,
            tool_calls=tuple(parsed.tool_calls),
            num_tokens=len(output.token_ids),
            stop_sequence=output.stop_sequence,
        )

    def _parse(self, text: str, token_ids: Sequence[int]) -> ParsedDelta:
        if self._tools is not None and self._tools.also_reasoning:
            return self._tools.feed(text, token_ids)
        parsed = self._reasoning.feed(text) if self._reasoning else ParsedDelta(content=text)
        return self._through_tools(parsed, token_ids)

    def _through_tools(self, parsed: ParsedDelta, token_ids: Sequence[int]) -> ParsedDelta:
        if self._tools is None:
            return parsed
        return ParsedDelta(reasoning=parsed.reasoning).add(
            self._tools.feed(parsed.content, token_ids)
        )

    def _finish(self) -> ParsedDelta:
        """What the parsers still hold when the choice ends."""
        parsed = ParsedDelta()
        if self._reasoning is not None and not (self._tools and self._tools.also_reasoning):
            parsed = self._through_tools(self._reasoning.finish(), ())
        if self._tools is not None:
            parsed.add(self._tools.finish())
        return parsed


def choice_stages(num_choices: int, parsing: OutputParsing | None = None) -> list[ChoiceStage]:
    """A fresh stage (and fresh parsers) per choice of one response."""
    return [ChoiceStage(choice, parsing) for choice in range(num_choices)]
