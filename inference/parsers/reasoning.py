"""Reasoning parsers for `<think>…</think>` models: the block becomes `reasoning_content`,
never `content`.

qwen3: the reply may open the block itself (Qwen3), or the template opened it in the prompt
(Qwen3 thinking-2507 and others end the prompt with `<think>`): the prompt's tail says which.
With `enable_thinking: false` the template closes an empty block in the prompt and the whole
reply is content. deepseek_r1: the reply starts inside the block unless the prompt closed it
(DeepSeek-R1 templates open it; the model may repeat the tag)."""

from __future__ import annotations

from typing import ClassVar

from inference.parsers.base import ParsedDelta, partial_suffix

START, END = "<think>", "</think>"


class ThinkReasoningParser:
    name: ClassVar[str] = "qwen3"
    starts_inside: ClassVar[bool] = False

    def __init__(self, *, prompt_tail: str = "") -> None:
        tail = prompt_tail.rstrip()
        if tail.endswith(START):
            self._mode = "inside"
        elif tail.endswith(END):
            self._mode = "content"  # closed in the prompt (enable_thinking false)
        elif self.starts_inside:
            self._mode = "inside"
        else:
            self._mode = "start"  # the reply may open a block
        self._at_start = True  # inside: a repeated opening tag is dropped
        self._pending = ""

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        self._pending += text
        while self._pending:
            if self._mode == "start":
                stripped = self._pending.lstrip()
                if stripped.startswith(START):
                    self._pending = stripped[len(START) :]
                    self._mode = "inside"
                    self._at_start = False
                elif stripped and START.startswith(stripped):
                    break  # a tag still arriving
                elif not stripped:
                    break  # leading whitespace: wait for what follows
                else:
                    self._mode = "content"
            elif self._mode == "inside":
                if self._at_start:
                    stripped = self._pending.lstrip()
                    if not stripped or (START.startswith(stripped) and stripped != START):
                        break
                    if stripped.startswith(START):
                        self._pending = stripped[len(START) :]
                    self._at_start = False
                at = self._pending.find(END)
                if at < 0:
                    keep = partial_suffix(self._pending, (END,))
                    out.reasoning += self._pending[: len(self._pending) - keep]
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                out.reasoning += self._pending[:at]
                self._pending = self._pending[at + len(END) :]
                self._mode = "after"
            elif self._mode == "after":  # the blank lines after the block are not content
                stripped = self._pending.lstrip()
                if not stripped:
                    self._pending = ""
                    break
                self._pending = stripped
                self._mode = "content"
            else:
                out.content += self._pending
                self._pending = ""
        return out

    def finish(self) -> ParsedDelta:
        pending, self._pending = self._pending, ""
        if self._mode == "inside":
            return ParsedDelta(reasoning=pending)
        if self._mode in ("start", "content"):
            return ParsedDelta(content=pending)
        return ParsedDelta()


class DeepSeekR1ReasoningParser(ThinkReasoningParser):
    name = "deepseek_r1"
    starts_inside = True
