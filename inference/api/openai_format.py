"""OpenAI response shapes for chat completions and completions: streamed chunks (SSE) and the
aggregated body built from the very same deltas."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Any

from engine import TokenLogprob
from inference.api.common import sse
from inference.errors import APIError
from inference.parsers.base import ToolCallDelta
from inference.services.generation import Generation
from inference.services.output import ChoiceDelta, GenerationFailed

SSE_DONE = b"data: [DONE]\n\n"


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(logprobs: Iterable[TokenLogprob] | None) -> list[dict[str, Any]]:
    return [
        {
            "token": lp.token,
            "logprob": lp.logprob,
            "bytes": _token_bytes(lp.token),
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": _token_bytes(t.token)}
                for t in lp.top_logprobs
            ],
        }
        for lp in logprobs or ()
    ]


@dataclass
class CompletionLogprobs:
    """The legacy completions logprobs object, accumulated across a choice's outputs."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    offset: int = 0

    def add(self, logprobs: Iterable[TokenLogprob] | None) -> None:
        for lp in logprobs or ():
            self.tokens.append(lp.token)
            self.token_logprobs.append(lp.logprob)
            self.top_logprobs.append({t.token: t.logprob for t in lp.top_logprobs})
            self.text_offset.append(self.offset)
            self.offset += len(lp.token)

    def as_dict(self, *, offset: int = 0) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": [position + offset for position in self.text_offset],
        }


@dataclass
class ChoiceAggregate:
    content: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add_tool_call(self, delta: ToolCallDelta) -> None:
        if delta.id is not None:
            self.tool_calls.append(
                {
                    "id": delta.id,
                    "type": "function",
                    "function": {"name": delta.name, "arguments": delta.arguments},
                }
            )
        else:
            self.tool_calls[delta.index]["function"]["arguments"] += delta.arguments

    def message(self) -> dict[str, Any]:
        """The chat message these deltas make (content null beside tool calls, as OpenAI)."""
        content = "".join(self.content)
        message: dict[str, Any] = {
            "role": "assistant",
            "content": None if self.tool_calls and not content.strip() else content,
            "refusal": None,
        }
        if self.reasoning:
            message["reasoning_content"] = "".join(self.reasoning)
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


async def aggregate(generation: Generation) -> list[ChoiceAggregate]:
    """Drain the generation: a non-streamed response is its deltas joined. A failed choice is
    a 500 in OpenAI's shape."""
    choices = [ChoiceAggregate() for _ in range(generation.num_choices)]
    try:
        async with generation.deltas() as deltas:
            async for delta in deltas:
                choice = choices[delta.choice]
                choice.content.append(delta.content)
                if delta.reasoning:
                    choice.reasoning.append(delta.reasoning)
                for call in delta.tool_calls:
                    choice.add_tool_call(call)
                choice.logprobs.extend(delta.logprobs or ())
                if delta.finish_reason:
                    choice.finish_reason = delta.finish_reason
    except GenerationFailed as exc:
        raise APIError(500, exc.message) from None
    return choices


def chat_completion_body(
    generation: Generation,
    choices: list[ChoiceAggregate],
    *,
    completion_id: str,
    created: int,
    want_logprobs: bool,
) -> dict[str, Any]:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": generation.model,
        "service_tier": generation.service_tier,
        "system_fingerprint": None,
        "choices": [
            {
                "index": index,
                "message": c.message(),
                "logprobs": {"content": chat_logprobs(c.logprobs)} if want_logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for index, c in enumerate(choices)
        ],
        "usage": generation.usage(),
    }


def text_completion_body(
    generation: Generation,
    choices: list[ChoiceAggregate],
    *,
    completion_id: str,
    created: int,
    want_logprobs: bool,
) -> dict[str, Any]:
    echo = generation.prompt_texts
    per_prompt = generation.choices_per_prompt
    body_choices = []
    for index, choice in enumerate(choices):
        prefix = echo[index // per_prompt] if echo else ""
        logprobs = None
        if want_logprobs:
            collected = CompletionLogprobs()
            collected.add(choice.logprobs)
            logprobs = collected.as_dict(offset=len(prefix))
        body_choices.append(
            {
                "index": index,
                "text": prefix + "".join(choice.content),
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
            }
        )
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": generation.model,
        "service_tier": generation.service_tier,
        "choices": body_choices,
        "usage": generation.usage(),
    }


async def chat_chunks(
    generation: Generation, *, completion_id: str, created: int, include_usage: bool
) -> AsyncIterator[bytes]:
    base = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": generation.model,
        "service_tier": generation.service_tier,
        "system_fingerprint": None,
    }
    if include_usage:
        base["usage"] = None
    started: set[int] = set()
    async with generation.deltas() as deltas:
        async for delta in deltas:
            chunk = _chat_chunk(base, delta, started)
            if chunk is not None:
                yield sse(chunk)
    if include_usage:
        yield sse({**base, "choices": [], "usage": generation.usage()})
    yield SSE_DONE


def _chat_chunk(base: dict, delta: ChoiceDelta, started: set[int]) -> dict | None:
    message: dict[str, Any] = {}
    if delta.choice not in started:
        started.add(delta.choice)
        message["role"] = "assistant"
    if delta.content or "role" in message:
        message["content"] = delta.content
    if delta.reasoning:
        message["reasoning_content"] = delta.reasoning
    if delta.tool_calls:
        message["tool_calls"] = [_tool_call_chunk(call) for call in delta.tool_calls]
    if not message and not delta.finish_reason and not delta.logprobs:
        return None
    choice: dict[str, Any] = {
        "index": delta.choice,
        "delta": message,
        "logprobs": {"content": chat_logprobs(delta.logprobs)} if delta.logprobs else None,
        "finish_reason": delta.finish_reason,
    }
    return {**base, "choices": [choice]}


def _tool_call_chunk(call: ToolCallDelta) -> dict[str, Any]:
    if call.id is None:
        return {"index": call.index, "function": {"arguments": call.arguments}}
    return {
        "index": call.index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


async def completion_chunks(
    generation: Generation,
    *,
    completion_id: str,
    created: int,
    include_usage: bool,
    want_logprobs: bool,
) -> AsyncIterator[bytes]:
    base = {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": generation.model,
        "service_tier": generation.service_tier,
    }
    if include_usage:
        base["usage"] = None
    echo = generation.prompt_texts
    # Per choice: the logprobs text offset runs on across chunks, after any echoed prompt.
    offsets: dict[int, int] = {}
    async with generation.deltas() as deltas:
        async for delta in deltas:
            text = delta.content
            if delta.choice not in offsets:
                prefix = echo[delta.choice // generation.choices_per_prompt] if echo else ""
                text = prefix + text
                offsets[delta.choice] = len(prefix)
            logprobs = None
            if want_logprobs and delta.logprobs:
                chunk_logprobs = CompletionLogprobs(offset=offsets[delta.choice])
                chunk_logprobs.add(delta.logprobs)
                offsets[delta.choice] = chunk_logprobs.offset
                logprobs = chunk_logprobs.as_dict()
            if not text and not delta.finish_reason and logprobs is None:
                continue
            choice = {
                "index": delta.choice,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": delta.finish_reason,
            }
            yield sse({**base, "choices": [choice]})
    if include_usage:
        yield sse({**base, "choices": [], "usage": generation.usage()})
    yield SSE_DONE
