"""OpenAI response shapes for chat completions and completions: streamed chunks (SSE) and the
aggregated body built from the very same stream."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from engine.protocol import TokenLogprob
from inference.errors import APIError
from inference.services.execution import ChoiceOutput, Execution

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def stream_error_payload(finish_reason: str) -> dict[str, Any]:
    message = (
        "The request was aborted by the server (the model was unloaded or the server is stopping)."
        if finish_reason == "abort"
        else "The engine failed while generating this response."
    )
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(logprobs: tuple[TokenLogprob, ...] | None) -> list[dict[str, Any]]:
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

    def add(self, logprobs: tuple[TokenLogprob, ...] | None) -> None:
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
    text: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    chat_logprobs: list[dict[str, Any]] = field(default_factory=list)
    completion_logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)


async def aggregate(execution: Execution, num_choices: int) -> list[ChoiceAggregate]:
    """Drain the execution's stream: non-streamed responses are the aggregated stream."""
    choices = [ChoiceAggregate() for _ in range(num_choices)]
    async with contextlib.aclosing(execution.outputs()) as outputs:
        async for item in outputs:
            _add(choices[item.choice], item)
    return choices


def _add(choice: ChoiceAggregate, item: ChoiceOutput) -> None:
    choice.text.append(item.output.text)
    if item.output.logprobs:
        choice.chat_logprobs.extend(chat_logprobs(item.output.logprobs))
        choice.completion_logprobs.add(item.output.logprobs)
    if item.output.finish_reason:
        choice.finish_reason = item.output.finish_reason


def is_failure(finish_reason: str | None) -> bool:
    return finish_reason in ("error", "abort")


def _raise_on_failure(choices: list[ChoiceAggregate]) -> None:
    for choice in choices:
        if is_failure(choice.finish_reason):
            raise APIError(500, stream_error_payload(choice.finish_reason)["error"]["message"])


def chat_completion_body(
    execution: Execution,
    choices: list[ChoiceAggregate],
    *,
    completion_id: str,
    created: int,
    model: str,
    want_logprobs: bool,
) -> dict[str, Any]:
    _raise_on_failure(choices)
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "system_fingerprint": None,
        "choices": [
            {
                "index": index,
                "message": {"role": "assistant", "content": "".join(c.text), "refusal": None},
                "logprobs": {"content": c.chat_logprobs} if want_logprobs else None,
                "finish_reason": c.finish_reason,
            }
            for index, c in enumerate(choices)
        ],
        "usage": execution.usage(),
    }


def text_completion_body(
    execution: Execution,
    choices: list[ChoiceAggregate],
    *,
    completion_id: str,
    created: int,
    model: str,
    echo_texts: list[str] | None,
    want_logprobs: bool,
) -> dict[str, Any]:
    _raise_on_failure(choices)
    per_prompt = execution.choices_per_request
    return {
        "id": completion_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": (echo_texts[index // per_prompt] if echo_texts else "") + "".join(c.text),
                "logprobs": c.completion_logprobs.as_dict(
                    offset=len(echo_texts[index // per_prompt]) if echo_texts else 0
                )
                if want_logprobs
                else None,
                "finish_reason": c.finish_reason,
            }
            for index, c in enumerate(choices)
        ],
        "usage": execution.usage(),
    }


async def chat_chunks(
    execution: Execution,
    *,
    completion_id: str,
    created: int,
    model: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    base = {
        "id": completion_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "system_fingerprint": None,
    }
    if include_usage:
        base["usage"] = None
    started: set[int] = set()
    async with contextlib.aclosing(execution.outputs()) as outputs:
        async for item in outputs:
            if is_failure(item.output.finish_reason):
                yield sse(stream_error_payload(item.output.finish_reason))
                return
            chunk = _chat_chunk(base, item, started)
            if chunk is not None:
                yield sse(chunk)
    if include_usage:
        yield sse({**base, "choices": [], "usage": execution.usage()})
    yield SSE_DONE


def _chat_chunk(base: dict, item: ChoiceOutput, started: set[int]) -> dict | None:
    output = item.output
    delta: dict[str, Any] = {}
    if item.choice not in started:
        started.add(item.choice)
        delta["role"] = "assistant"
    if output.text or "role" in delta:
        delta["content"] = output.text
    if not delta and not output.finish_reason and not output.logprobs:
        return None
    choice: dict[str, Any] = {
        "index": item.choice,
        "delta": delta,
        "logprobs": {"content": chat_logprobs(output.logprobs)} if output.logprobs else None,
        "finish_reason": output.finish_reason,
    }
    return {**base, "choices": [choice]}


async def completion_chunks(
    execution: Execution,
    *,
    completion_id: str,
    created: int,
    model: str,
    include_usage: bool,
    echo_texts: list[str] | None,
    want_logprobs: bool,
) -> AsyncIterator[bytes]:
    base = {"id": completion_id, "object": "text_completion", "created": created, "model": model}
    if include_usage:
        base["usage"] = None
    # Per choice: the logprobs text offset runs on across chunks, after any echoed prompt.
    offsets: dict[int, int] = {}
    async with contextlib.aclosing(execution.outputs()) as outputs:
        async for item in outputs:
            output = item.output
            if is_failure(output.finish_reason):
                yield sse(stream_error_payload(output.finish_reason))
                return
            text = output.text
            if item.choice not in offsets:
                echo = (
                    echo_texts[item.choice // execution.choices_per_request] if echo_texts else ""
                )
                text = echo + text
                offsets[item.choice] = len(echo)
            logprobs = None
            if want_logprobs and output.logprobs:
                chunk_logprobs = CompletionLogprobs(offset=offsets[item.choice])
                chunk_logprobs.add(output.logprobs)
                offsets[item.choice] = chunk_logprobs.offset
                logprobs = chunk_logprobs.as_dict()
            if not text and not output.finish_reason and logprobs is None:
                continue
            choice = {
                "index": item.choice,
                "text": text,
                "logprobs": logprobs,
                "finish_reason": output.finish_reason,
            }
            yield sse({**base, "choices": [choice]})
    if include_usage:
        yield sse({**base, "choices": [], "usage": execution.usage()})
    yield SSE_DONE
