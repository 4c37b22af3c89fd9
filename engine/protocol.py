"""The plain data that crosses between the web side and the engine.

No Django, no MLX: these dataclasses travel in-process today and over the Channels layer to
`runengine` workers later, so they stay small, immutable where possible, and serialisable
(`to_dict` / `from_dict`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class EngineError(Exception):
    """Base class for errors the engine reports to its callers."""

    code = "engine_error"


class InvalidRequestError(EngineError, ValueError):
    """User input the engine cannot accept; `param` names the offending request field and
    `code` is set only where OpenAI has a specific one (e.g. context_length_exceeded)."""

    code = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        if code:
            self.code = code


class EngineOverloadedError(EngineError):
    """The model's waiting queue is full; the API answers 503."""

    code = "engine_overloaded"


class ModelNotLoadedError(EngineError):
    code = "model_not_loaded"


class RequestStatus(enum.IntEnum):
    """Ordered: everything >= FINISHED_STOPPED is final."""

    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class ModelSpec:
    """What the engine needs to load and serve one model (built from a registry entry)."""

    name: str
    path: str
    engine: str = "batched"  # "batched" | "simple"
    context_length: int | None = None  # None: read from the model's config
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_waiting: int = 256

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelSpec:
        return cls(**data)


@dataclass(frozen=True)
class ModelInfo:
    """What the engine reports about a loaded model."""

    name: str
    context_length: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    supports_tools: bool = False

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelInfo:
        return cls(**{**data, "eos_token_ids": tuple(data["eos_token_ids"])})


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling; `validate` raises InvalidRequestError before any work is done."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    seed: int | None = None
    max_tokens: int | None = None  # None: up to the context length
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0
    n: int = 1
    # response_format {"type": "json_object"}: the completion is constrained to one JSON object.
    json_mode: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, *, vocab_size: int | None = None) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", "temperature must be between 0 and 2.")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "top_p must be greater than 0 and at most 1.")
        if self.top_k < 0:
            raise bad("top_k", "top_k must be 0 (disabled) or positive.")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "min_p must be between 0 and 1.")
        if self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", "repetition_penalty must be positive.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "presence_penalty must be between -2 and 2.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "frequency_penalty must be between -2 and 2.")
        for token_id, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= int(token_id) < vocab_size:
                raise bad(
                    "logit_bias", f"logit_bias has token id {token_id} outside the vocabulary."
                )
            if not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", "logit_bias values must be between -100 and 100.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "max_tokens must be at least 1.")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise bad("min_tokens", "min_tokens must be between 0 and max_tokens.")
        if len(self.stop) > 4 or any(not s for s in self.stop):
            raise bad("stop", "stop takes at most 4 non-empty strings.")
        if not 0 <= self.top_logprobs <= 20:
            raise bad("top_logprobs", "top_logprobs must be between 0 and 20.")
        if self.top_logprobs and not self.logprobs:
            raise bad("top_logprobs", "top_logprobs requires logprobs.")
        if not 1 <= self.n <= 16:
            raise bad("n", "n must be between 1 and 16.")

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["logit_bias"] = {str(k): v for k, v in self.logit_bias.items()}
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SamplingParams:
        data = dict(data)
        data["logit_bias"] = {int(k): float(v) for k, v in data.get("logit_bias", {}).items()}
        data["stop"] = tuple(data.get("stop", ()))
        data["stop_token_ids"] = tuple(data.get("stop_token_ids", ()))
        return cls(**data)


@dataclass(frozen=True)
class PromptInput:
    """A prompt to render into token ids: chat messages, plain text, or ready token ids."""

    messages: tuple[Mapping[str, Any], ...] | None = None
    tools: tuple[Mapping[str, Any], ...] | None = None
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    text: str | None = None
    token_ids: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PromptInput:
        data = dict(data)
        for key in ("messages", "tools", "token_ids"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        return cls(**data)


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "model": self.model,
            "prompt_token_ids": list(self.prompt_token_ids),
            "sampling": self.sampling.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationRequest:
        return cls(
            request_id=data["request_id"],
            model=data["model"],
            prompt_token_ids=tuple(data["prompt_token_ids"]),
            sampling=SamplingParams.from_dict(data["sampling"]),
        )


@dataclass(frozen=True)
class TopLogprob:
    token: str
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token: str
    token_id: int
    logprob: float
    top_logprobs: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class GenerationOutput:
    """One event of a generation stream, for one choice (`index`, 0..n-1).

    `text` is the new text since the previous event of this choice: stop strings are matched
    across token boundaries and never emitted. `token_ids` are the new tokens (what usage
    counts). The last event of a choice has `finish_reason` set.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: tuple[TokenLogprob, ...] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationOutput:
        data = dict(data)
        data["token_ids"] = tuple(data["token_ids"])
        if data.get("logprobs") is not None:
            data["logprobs"] = tuple(
                TokenLogprob(
                    **{**lp, "top_logprobs": tuple(TopLogprob(**t) for t in lp["top_logprobs"])}
                )
                for lp in data["logprobs"]
            )
        return cls(**data)


@dataclass(frozen=True)
class EngineStats:
    """Per-model load, for admin, `/metrics` and (later) routing between workers."""

    model: str
    num_waiting: int = 0
    num_running: int = 0
    tokens_per_second: float = 0.0
    step_time_ms: float = 0.0
    num_steps: int = 0
    num_generated_tokens: int = 0
    num_prompt_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
