"""The per-choice output stage: a choice's engine outputs → what a response says about it.

Every endpoint reads its choices through here, streamed or not (a non-streamed reply is the
stream's deltas joined), so whatever this stage learns to do, every endpoint does the same way.
Today a choice's text is its content; the tool-call and reasoning parsers chosen for the model
plug in as stages with per-choice state (one `ChoiceStage` per choice, never shared between
streams). A failed generation is raised as GenerationFailed, which each endpoint renders in
its own error shape.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.protocol import GenerationOutput, TokenLogprob

# Engine finish reasons that end a choice in failure: what the client is told, and the usage
# row's error code.
FAILURE_MESSAGES = {
    "abort": "The request was aborted by the server (the model was unloaded or the server is "
    "stopping).",
    "error": "The engine failed while generating this response.",
}
FAILURE_CODES = {"abort": "engine_aborted", "error": "engine_error"}


class GenerationFailed(Exception):
    """A choice ended with finish_reason "error" or "abort" (the usage row says failed)."""

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
    finish_reason: str | None = None  # "stop" | "length"


class ChoiceStage:
    """One choice's output handling. The base stage passes text through as content."""

    def __init__(self, choice: int):
        self.choice = choice

    def feed(self, output: GenerationOutput) -> ChoiceDelta:
        if output.finish_reason in FAILURE_MESSAGES:
            raise GenerationFailed(output.finish_reason)
        return ChoiceDelta(
            choice=self.choice,
            content=output.text,
            logprobs=output.logprobs,
            finish_reason=output.finish_reason,
        )


def choice_stages(num_choices: int) -> list[ChoiceStage]:
    """A fresh stage per choice of one response."""
    return [ChoiceStage(choice) for choice in range(num_choices)]
