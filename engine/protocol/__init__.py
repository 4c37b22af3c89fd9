"""The plain data that crosses between the web side and the engine.

No Django, no MLX: these dataclasses travel in-process and over the Channels layer to
`runengine` workers, so they stay small, immutable where possible, and serialisable
(`to_dict` / `from_dict`). errors.py: what the engine raises to its callers; models.py: model
specs, facts and status; generation.py: a generation's request and its outputs; checks.py: the
one check of a request against its model and the one sizing of its completion.
"""

from engine.protocol.checks import PromptRoom, completion_budget, validate_generation
from engine.protocol.errors import (
    EmbeddingLoadError,
    EngineError,
    EngineOverloadedError,
    InvalidRequestError,
    ModelCapacityError,
    ModelLoadError,
    ModelNotLoadedError,
    ModelUnavailableError,
    describe,
)
from engine.protocol.generation import (
    MAX_CHOICES,
    MAX_GRAMMAR_CHARS,
    MAX_INT,
    MAX_LOGIT_BIAS,
    MAX_STOP_LENGTH,
    MAX_STOP_TOKEN_IDS,
    SERVICE_TIERS,
    GenerationOutput,
    GenerationRequest,
    PromptImage,
    PromptInput,
    RenderedPrompt,
    RequestStatus,
    SamplingParams,
    ServiceClass,
    TokenLogprob,
    TopLogprob,
)
from engine.protocol.models import (
    EmbeddingInfo,
    EmbeddingProgress,
    EngineStats,
    ModelInfo,
    ModelSpec,
    ModelStatus,
)

__all__ = [
    "MAX_CHOICES",
    "MAX_GRAMMAR_CHARS",
    "MAX_INT",
    "MAX_LOGIT_BIAS",
    "MAX_STOP_LENGTH",
    "MAX_STOP_TOKEN_IDS",
    "SERVICE_TIERS",
    "EmbeddingInfo",
    "EmbeddingLoadError",
    "EmbeddingProgress",
    "EngineError",
    "EngineOverloadedError",
    "EngineStats",
    "GenerationOutput",
    "GenerationRequest",
    "InvalidRequestError",
    "ModelCapacityError",
    "ModelInfo",
    "ModelLoadError",
    "ModelNotLoadedError",
    "ModelSpec",
    "ModelStatus",
    "ModelUnavailableError",
    "PromptImage",
    "PromptInput",
    "PromptRoom",
    "RenderedPrompt",
    "RequestStatus",
    "SamplingParams",
    "ServiceClass",
    "TokenLogprob",
    "TopLogprob",
    "completion_budget",
    "describe",
    "validate_generation",
]
