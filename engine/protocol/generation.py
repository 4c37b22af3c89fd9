"""One generation: what a caller asks for (a prompt, rendered to token ids, and its sampling),
the one check of it against the model, and the stream of outputs that answers it."""

from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from engine.protocol.errors import InvalidRequestError

# Bounds on what one request may ask for. Token ids index the batch's flattened logits, so one
# outside the vocabulary would write into another request's row (or past the array); the counts
# bound the per-step work one request adds to everyone's batch; 2**31 - 1 keeps every integer
# an int32 on the device and small on the wire.
MAX_INT = 2**31 - 1
MAX_CHOICES = 16
MAX_LOGIT_BIAS = 1024
MAX_STOP_TOKEN_IDS = 256
MAX_STOP_LENGTH = 1000
MAX_GRAMMAR_CHARS = 1_000_000


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
    # Structured output: an llguidance grammar (from a JSON schema, Lark or a regex; built and
    # checked by the server) every token of the completion must follow (engine/text/grammar.py).
    grammar: str | None = None
    # Special tokens (by their text, e.g. "[TOOL_CALLS]") that stay in the output text instead of
    # being dropped: the markers the model's tool-call parser reads. Set by the server.
    keep_special_tokens: tuple[str, ...] = ()

    @property
    def greedy(self) -> bool:
        # top_p 0 keeps only the most likely token (OpenAI accepts it), as top_k 1 does.
        return self.temperature == 0.0 or self.top_p == 0.0 or self.top_k == 1

    def validate(self, *, vocab_size: int | None = None) -> None:
        """Check every field's range (and, given `vocab_size`, every token id): the one set of
        sampling rules, used for requests (through `validate_generation`) and for a registry
        entry's defaults (without a vocabulary)."""

        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        def out_of_vocabulary(token_id: int) -> bool:
            return not 0 <= token_id < (vocab_size if vocab_size is not None else MAX_INT)

        if not 0.0 <= self.temperature <= 2.0:
            raise bad("temperature", "temperature must be between 0 and 2.")
        if not 0.0 <= self.top_p <= 1.0:
            raise bad("top_p", "top_p must be between 0 and 1.")
        if not 0 <= self.top_k <= MAX_INT:
            raise bad("top_k", "top_k must be 0 (disabled) or positive.")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "min_p must be between 0 and 1.")
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise bad("repetition_penalty", "repetition_penalty must be above 0 and at most 10.")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "presence_penalty must be between -2 and 2.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "frequency_penalty must be between -2 and 2.")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise bad("logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} token ids.")
        for token_id, bias in self.logit_bias.items():
            if out_of_vocabulary(token_id):
                raise bad(
                    "logit_bias", f"logit_bias has token id {token_id} outside the vocabulary."
                )
            if not -100.0 <= bias <= 100.0:
                raise bad("logit_bias", "logit_bias values must be between -100 and 100.")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise bad("seed", "seed must fit in 64 bits.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "max_tokens must be at least 1.")
        if not 0 <= self.min_tokens <= (self.max_tokens or MAX_INT):
            raise bad("min_tokens", "min_tokens must be between 0 and max_tokens.")
        if len(self.stop) > 4 or any(not s or len(s) > MAX_STOP_LENGTH for s in self.stop):
            raise bad(
                "stop", f"stop takes at most 4 non-empty strings of {MAX_STOP_LENGTH} characters."
            )
        if self.grammar is not None and len(self.grammar) > MAX_GRAMMAR_CHARS:
            raise bad("response_format", f"A grammar takes at most {MAX_GRAMMAR_CHARS} characters.")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise bad("stop_token_ids", f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids.")
        for token_id in self.stop_token_ids:
            if out_of_vocabulary(token_id):
                raise bad(
                    "stop_token_ids",
                    f"stop_token_ids has token id {token_id} outside the vocabulary.",
                )
        if not 0 <= self.top_logprobs <= 20:
            raise bad("top_logprobs", "top_logprobs must be between 0 and 20.")
        if self.top_logprobs and not self.logprobs:
            raise bad("top_logprobs", "top_logprobs requires logprobs.")
        if not 1 <= self.n <= MAX_CHOICES:
            raise bad("n", f"n must be between 1 and {MAX_CHOICES}.")

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
        data["keep_special_tokens"] = tuple(data.get("keep_special_tokens", ()))
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
    # The images of `messages`, in order (each an image part the template renders as the
    # model's image token; rendering expands it into the image's placeholder tokens).
    images: tuple[bytes, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["images"] = [base64.b64encode(image).decode("ascii") for image in self.images]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PromptInput:
        data = dict(data)
        for key in ("messages", "tools", "token_ids"):
            if data.get(key) is not None:
                data[key] = tuple(data[key])
        data["images"] = tuple(base64.b64decode(image) for image in data.get("images", ()))
        return cls(**data)


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt's token ids, and the positions worth resuming from later (see
    GenerationRequest.checkpoints; computed only for models that need them)."""

    token_ids: tuple[int, ...]
    checkpoints: tuple[int, ...] = ()
    # The end of a chat prompt as text: whether the template opened a reasoning block for the
    # reply (Qwen3 and DeepSeek-R1 templates end with "<think>\n").
    tail_text: str = ""
    # How many of the placeholder tokens in `token_ids` are each image's, in order.
    image_tokens: tuple[int, ...] = ()


# Service tiers, highest first (OpenAI's `service_tier` values; engine/core/fairness.py).
SERVICE_TIERS = ("priority", "default", "flex")


@dataclass(frozen=True)
class ServiceClass:
    """Whom a request is served for and how urgently: the scheduler's fair share
    (engine/core/fairness.py) divides the engine between `tenant`s (a team) in proportion to
    their `weight`, and within a tenant between `principal`s (its keys); `tier` (one of
    SERVICE_TIERS) goes before lower tiers. Opaque strings chosen by the server; "" is one
    tenant (or principal) like any other."""

    tenant: str = ""
    weight: float = 1.0
    principal: str = ""
    tier: str = "default"

    def __post_init__(self) -> None:
        if self.tier not in SERVICE_TIERS:
            raise InvalidRequestError(f"unknown service tier {self.tier!r}", param="service_tier")
        if not (0 < self.weight <= 1_000_000):
            raise InvalidRequestError("a tenant's weight must be in (0, 1e6]")

    @property
    def rank(self) -> int:
        """0 for the highest tier."""
        return SERVICE_TIERS.index(self.tier)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ServiceClass:
        return cls(
            tenant=str(data.get("tenant", "")),
            weight=float(data.get("weight", 1.0)),
            principal=str(data.get("principal", "")),
            tier=str(data.get("tier", "default")),
        )


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt, as the caller sent it (checked at the edge: a PNG, JPEG, GIF or
    WebP within the size limits): its encoded bytes; their sha256 (hex), which keys the prefix
    cache, so a repeated image is a hit and another image never is; and how many of the
    prompt's placeholder tokens are this image's (the model's processor decides)."""

    data: bytes
    digest: str
    num_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "data": base64.b64encode(self.data).decode("ascii"),
            "digest": self.digest,
            "num_tokens": self.num_tokens,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PromptImage:
        return cls(base64.b64decode(data["data"]), data["digest"], int(data["num_tokens"]))

    @classmethod
    def of(cls, data: bytes, num_tokens: int) -> PromptImage:
        return cls(data, hashlib.sha256(data).hexdigest(), num_tokens)


@dataclass(frozen=True)
class GenerationRequest:
    """`checkpoints`: prompt positions worth resuming from later (the end of the system prompt
    and tools, the conversation before its last user turn): on a hybrid model the engine keeps
    the recurrent state there for the prefix cache.

    `cache_scope`: the prefix cache's namespace, an opaque string chosen by the server. A request
    reuses only state that requests of the same scope computed, so whoever may not learn another
    caller's prompts (through reused tokens or a faster first token) must not share its scope.
    "" is the scope of callers that set none.

    `service`: whose share of the engine the request uses, and its tier (ServiceClass).

    `images`: the prompt's images in order, on a vision model; each one's placeholder tokens
    (engine/models/vision.py `VisionEncoder.expand`) are in `prompt_token_ids`."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    checkpoints: tuple[int, ...] = ()
    cache_scope: str = ""
    service: ServiceClass = field(default_factory=ServiceClass)
    images: tuple[PromptImage, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "model": self.model,
            "prompt_token_ids": list(self.prompt_token_ids),
            "sampling": self.sampling.to_dict(),
            "checkpoints": list(self.checkpoints),
            "cache_scope": self.cache_scope,
            "service": self.service.to_dict(),
            "images": [image.to_dict() for image in self.images],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> GenerationRequest:
        return cls(
            request_id=data["request_id"],
            model=data["model"],
            prompt_token_ids=tuple(data["prompt_token_ids"]),
            sampling=SamplingParams.from_dict(data["sampling"]),
            checkpoints=tuple(data.get("checkpoints", ())),
            cache_scope=data.get("cache_scope", ""),
            service=ServiceClass.from_dict(data.get("service") or {}),
            images=tuple(PromptImage.from_dict(image) for image in data.get("images", ())),
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
    stop_sequence: str | None = None  # the stop string that ended this choice, if one did
    # On a choice's last event: every token the engine generated for it. A caller that got the
    # events over a network reconciles what it received (and bills) against this.
    num_generated_tokens: int = 0

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
