"""Prompts into token ids: chat messages through the model's template, text through its
tokenizer, under a time limit. Tokenizers and templates only (no MLX), so a web process that
reaches its engines over the network renders here too, without a round trip.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging

from jinja2 import TemplateError

from engine.protocol import InvalidRequestError, PromptInput, RenderedPrompt
from engine.text.templates import ERROR_TIMEOUT, apply_chat_template, with_deadline

logger = logging.getLogger(__name__)

# Prompts render on threads of their own, so a burst of slow renders never holds the threads
# the rest of the process runs blocking work on.
RENDER_THREADS = 4


class PromptRenderer:
    """Renders prompts on a pool of its own threads, each under a deadline."""

    def __init__(self, threads: int = RENDER_THREADS):
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="orchard-render"
        )

    async def render(
        self,
        tokenizer,
        prompt: PromptInput,
        *,
        checkpoints: bool = False,
        timeout_s: float | None = None,
    ) -> RenderedPrompt:
        loop = asyncio.get_running_loop()
        work = functools.partial(render, tokenizer, prompt, checkpoints=checkpoints)
        if timeout_s is None:
            return await loop.run_in_executor(self._pool, work)
        param = "messages" if prompt.messages is not None else "prompt"
        running = loop.run_in_executor(
            self._pool, functools.partial(with_deadline, work, timeout_s, param=param)
        )
        try:
            # The deadline stops Python code; this stops waiting for C code that runs on.
            return await asyncio.wait_for(asyncio.shield(running), timeout_s + 1.0)
        except TimeoutError:
            raise InvalidRequestError(
                ERROR_TIMEOUT.format(seconds=timeout_s), param=param
            ) from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


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
