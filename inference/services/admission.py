"""A metered request's way in, the same for every /v1 endpoint that runs a model.

`request_model` finds the model (one this key may use, of the endpoint's kind);
`request_precheck` refuses what the key's limits would refuse at any size, before any work is
spent on the request; `request_admit` reserves its tokens and hands back its `Settlement` (the
way out: usage row, release). A refusal is recorded (a finished usage row with no tokens, a
metric) and answered: 429 with the x-ratelimit-* headers, 503 when the limits cannot be checked.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import TypeVar

from asgiref.sync import sync_to_async

from accounts import limits
from accounts.models import ApiKey
from engine import ModelLoadError
from inference.errors import APIError, model_not_found
from inference.models import ModelEntry
from inference.services import metrics
from inference.services.registry import model_for_key
from inference.services.settlement import Settlement
from inference.services.usage import usage_reject

logger = logging.getLogger(__name__)

# What a request for a model of the other kind is told, by the kind the endpoint serves.
ERROR_WRONG_KIND = {
    ModelEntry.Kind.CHAT: "The model '{name}' is an embedding model; use /v1/embeddings.",
    ModelEntry.Kind.EMBEDDING: (
        "The model '{name}' is not an embedding model; use it with /v1/chat/completions."
    ),
}
ERROR_LOAD_FAILED = (
    "The model '{name}' could not be loaded; an administrator must check its registry entry."
)

T = TypeVar("T")


async def request_model(*, api_key: ApiKey, name: str, kind: str) -> ModelEntry:
    """The registry entry `name` stands for, if this key may use it (404 otherwise) and it is
    of the endpoint's `kind` (400 otherwise)."""
    entry = await sync_to_async(model_for_key)(api_key, name)
    if entry is None:
        raise model_not_found(name)
    if entry.kind != kind:
        raise APIError(400, ERROR_WRONG_KIND[kind].format(name=entry.name), param="model")
    return entry


def model_load_failed(entry: ModelEntry) -> APIError:
    return APIError(503, ERROR_LOAD_FAILED.format(name=entry.name), code=ModelLoadError.code)


async def request_precheck(*, api_key: ApiKey, request_id: str, model: str, endpoint: str) -> None:
    """Refuse (reserving nothing) a request no token count could admit: a refused request
    costs no template render, tokenizing or model load."""
    await _limited(
        limits.precheck(api_key),
        request_id=request_id,
        api_key=api_key,
        model=model,
        endpoint=endpoint,
    )


async def request_admit(
    *,
    api_key: ApiKey,
    request_id: str,
    model: str,
    endpoint: str,
    reserved_tokens: int,
    min_tokens: int | None = None,
) -> Settlement:
    """Reserve the request's tokens (with `min_tokens`, admission may grant fewer, never fewer
    than that: `Settlement.granted_tokens`). The caller must `settle()` what this returns."""
    admission = await _limited(
        limits.admit(api_key, reserved_tokens=reserved_tokens, min_tokens=min_tokens),
        request_id=request_id,
        api_key=api_key,
        model=model,
        endpoint=endpoint,
    )
    return Settlement(api_key, request_id, model, endpoint, admission)


async def _limited(
    check: Awaitable[T], *, request_id: str, api_key: ApiKey, model: str, endpoint: str
) -> T:
    try:
        return await check
    except (limits.RateLimitExceeded, limits.LimiterUnavailable) as exc:
        raise await _refused(
            exc, request_id=request_id, api_key=api_key, model=model, endpoint=endpoint
        ) from None


async def _refused(
    exc: limits.RateLimitExceeded | limits.LimiterUnavailable,
    *,
    request_id: str,
    api_key: ApiKey,
    model: str,
    endpoint: str,
) -> APIError:
    """Record a refused request (a finished usage row with no tokens) and build its error."""
    metrics.request_rejected(endpoint=endpoint, model=model, reason=exc.code)
    await sync_to_async(usage_reject)(
        request_id=request_id,
        api_key=api_key,
        model=model,
        endpoint=endpoint,
        error_code=exc.code,
    )
    if isinstance(exc, limits.LimiterUnavailable):
        logger.error("limits unavailable: %s", exc)
        return APIError(503, limits.ERROR_UNAVAILABLE, code=exc.code)
    # OpenAI types an exhausted budget as its own error type, not a rate limit.
    error_type = "insufficient_quota" if exc.code == "insufficient_quota" else None
    return APIError(429, exc.message, code=exc.code, type=error_type, headers=exc.headers)
