"""Prompts into token ids: chat messages through the model's template, text through its
tokenizer, each in a tokenizer process under a deadline that stops it (processes.py).
Tokenizers and templates only (no MLX), so a web process that reaches its engines over the
network renders here too, without a round trip.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from jinja2 import TemplateError

from engine.protocol import InvalidRequestError, PromptInput, PromptRoom, RenderedPrompt
from engine.text.processes import PoolSize, TokenizerProcesses
from engine.text.templates import ERROR_TIMEOUT, apply_chat_template

logger = logging.getLogger(__name__)

# A job with this much input text runs in the idle-class processes (processes.py): tokenizing is
# about a microsecond a character here, so this is some 50 ms of work and more.
LONG_INPUT_CHARS = 50_000


class PromptRenderer:
    """Renders prompts and encodes texts in tokenizer processes of its own, each job under a
    deadline: a job past it is stopped (its process killed) before the call raises."""

    def __init__(self, size: PoolSize | None = None):
        self.processes = TokenizerProcesses(size)

    async def render(
        self,
        tokenizer,
        prompt: PromptInput,
        *,
        checkpoints: bool = False,
        timeout_s: float | None = None,
        room: PromptRoom | None = None,
    ) -> RenderedPrompt:
        """`prompt`'s token ids; with `room`, a prompt that leaves too little of the context is
        refused in the process (`PromptRoom.check`), its ids never sent back."""
        if prompt.token_ids is not None:
            return RenderedPrompt(tuple(prompt.token_ids))
        param = "messages" if prompt.messages is not None else "prompt"
        return await self.processes.run(
            tokenizer,
            _render_job,
            prompt,
            checkpoints,
            room,
            timeout_s=timeout_s,
            timeout_error=_timeout(timeout_s, param),
            low=_input_chars(prompt) >= LONG_INPUT_CHARS,
        )

    async def encode(
        self, tokenizer, texts: Sequence[str], *, timeout_s: float | None = None
    ) -> list[list[int]]:
        """Each text's token ids by a `tokenizers.Tokenizer` (an embedding model's)."""
        if isinstance(texts, str) or not all(isinstance(text, str) for text in texts):
            raise InvalidRequestError("Only strings can be tokenized.", param="input")
        return await self.processes.run(
            tokenizer,
            encode_texts,
            list(texts),
            timeout_s=timeout_s,
            timeout_error=_timeout(timeout_s, "input"),
            low=sum(len(text) for text in texts) >= LONG_INPUT_CHARS,
        )

    def close(self) -> None:
        self.processes.close()


def _input_chars(prompt: PromptInput) -> int:
    """About how much text a render reads: its messages' text, or its prompt's."""
    if prompt.text is not None:
        return len(prompt.text)
    total = 0
    for message in prompt.messages or ():
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list | tuple):
            total += sum(
                len(part["text"])
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)
            )
    return total


def _timeout(seconds: float | None, param: str) -> InvalidRequestError:
    return InvalidRequestError(ERROR_TIMEOUT.format(seconds=seconds or 0), param=param)


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    return [encoding.ids for encoding in tokenizer.encode_batch(texts)]


def _render_job(
    tokenizer, prompt: PromptInput, checkpoints: bool, room: PromptRoom | None
) -> RenderedPrompt:
    rendered = render(tokenizer, prompt, checkpoints=checkpoints)
    if room is not None:
        room.check(len(rendered.token_ids))
    return rendered


# Tokens at the end of a chat prompt decoded for `RenderedPrompt.tail_text`.
TAIL_TOKENS = 8


def render(tokenizer, prompt: PromptInput, *, checkpoints: bool = False) -> RenderedPrompt:
    if prompt.token_ids is not None:
        return RenderedPrompt(tuple(prompt.token_ids))
    if prompt.messages is not None:
        try:
            ids = _chat(tokenizer, prompt, prompt.messages, prompt.add_generation_prompt)
            tail = tokenizer.decode(ids[-TAIL_TOKENS:]) if ids else ""
            points = _checkpoints(tokenizer, prompt, ids) if checkpoints else ()
            return RenderedPrompt(tuple(ids), points, tail_text=tail)
        except InvalidRequestError:
            raise
        except Exception as exc:
            # Templates raise on conversations they cannot render (roles out of order, a range
            # too large, recursion over a deep tool schema, ...): the caller's input, a 400.
            if not isinstance(exc, ValueError | TypeError | TemplateError):
                logger.warning("chat template failed with %s: %s", type(exc).__name__, exc)
            raise InvalidRequestError(
                f"The messages could not be rendered by the chat template: {exc}", param="messages"
            ) from exc
    if prompt.text is not None:
        return RenderedPrompt(tuple(tokenizer.encode(prompt.text)))
    raise InvalidRequestError("A prompt needs messages, text or token ids.", param="prompt")


def _chat(tokenizer, prompt: PromptInput, messages, add_generation_prompt: bool) -> list[int]:
    return apply_chat_template(
        tokenizer,
        messages,
        tools=prompt.tools,
        add_generation_prompt=add_generation_prompt,
        chat_template_kwargs=prompt.chat_template_kwargs,
    )


def _checkpoints(tokenizer, prompt: PromptInput, ids: list[int]) -> tuple[int, ...]:
    """Where a later request is likely to resume: after the system messages (and the tools the
    template puts there), and after the conversation before the last user turn.

    Rendering those messages alone would not do: templates render a conversation's last
    message differently (Qwen3 gives a final assistant turn an empty think block). So each
    boundary is where the prompt parts from the same conversation cut there and followed by
    an empty user turn: both have the same shape up to the new turn's text."""
    messages = prompt.messages
    num_system = next(
        (i for i, m in enumerate(messages) if m.get("role") != "system"), len(messages)
    )
    last_user = max((i for i, m in enumerate(messages) if m.get("role") == "user"), default=0)
    points = set()
    for end in {num_system, last_user}:
        if 0 < end < len(messages):
            variant = [*messages[:end], {"role": "user", "content": ""}]
            other = _chat(tokenizer, prompt, variant, add_generation_prompt=False)
            common = next(
                (i for i, (a, b) in enumerate(zip(ids, other, strict=False)) if a != b),
                min(len(ids), len(other)),
            )
            if 0 < common < len(ids) - 1:
                points.add(common)
    return tuple(sorted(points))
