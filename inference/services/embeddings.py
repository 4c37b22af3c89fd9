"""/v1/embeddings: inputs to vectors for a key, with its limits and a usage row.

In order: the model (one this key may use, and an embedding model), the limits that need no
token count, tokenizing (or checking given token ids against the vocabulary), each input
inside the model's context, admission for the tokens, then one batched request to the model's
embedding engine (concurrent requests share its forwards). The usage row is written once, when
the request ends, whatever ends it (also a client that leaves).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np
from asgiref.sync import sync_to_async
from django.utils import timezone

from accounts import limits
from accounts.models import ApiKey
from common.request_threads import detach
from engine import EmbeddingInfo, EmbeddingLoadError
from inference.errors import APIError, model_not_found
from inference.models import ModelEntry, UsageRecord
from inference.services import metrics
from inference.services.engines import get_engine_client
from inference.services.refusals import admission_refused
from inference.services.registry import model_for_key, model_spec
from inference.services.usage import usage_record_finished

logger = logging.getLogger(__name__)

MAX_INPUTS = 2048  # OpenAI's limit per request
ENDPOINT = "embeddings"


@dataclass
class Embeddings:
    model: str
    vectors: np.ndarray  # (inputs, dimensions) float32
    num_tokens: int
    headers: dict[str, str]


async def embeddings_create(
    *,
    api_key: ApiKey,
    request_id: str,
    model: str,
    inputs: list[str] | list[list[int]],
    dimensions: int | None = None,
) -> Embeddings:
    entry = await sync_to_async(model_for_key)(api_key, model)
    if entry is None:
        raise model_not_found(model)
    if entry.kind != ModelEntry.Kind.EMBEDDING:
        raise APIError(
            400,
            f"The model '{entry.name}' is not an embedding model; use it with "
            "/v1/chat/completions.",
            param="model",
        )
    if len(inputs) > MAX_INPUTS:
        raise APIError(400, f"'input' takes at most {MAX_INPUTS} items.", param="input")
    try:
        await limits.precheck(api_key)
    except (limits.RateLimitExceeded, limits.LimiterUnavailable) as exc:
        raise await admission_refused(
            exc, request_id=request_id, api_key=api_key, model=entry.name, endpoint=ENDPOINT
        ) from None
    client = get_engine_client()
    info = await _serving(client, entry)
    if dimensions is not None and dimensions != info.dimensions:
        raise APIError(
            400,
            f"The model '{entry.name}' makes {info.dimensions}-dimensional embeddings and does "
            f"not support shortening them; 'dimensions' must be {info.dimensions} or omitted.",
            param="dimensions",
        )
    if isinstance(inputs[0], str):
        token_ids = await client.tokenize(entry.name, inputs)
    else:
        token_ids = inputs
    _check(token_ids, info)
    num_tokens = sum(len(ids) for ids in token_ids)
    try:
        admission = await limits.admit(api_key, reserved_tokens=num_tokens)
    except (limits.RateLimitExceeded, limits.LimiterUnavailable) as exc:
        raise await admission_refused(
            exc, request_id=request_id, api_key=api_key, model=entry.name, endpoint=ENDPOINT
        ) from None
    started_at = timezone.now()
    status, error_code = UsageRecord.Status.CANCELLED, "client_disconnected"
    try:
        vectors = await client.embed(entry.name, token_ids)
        status, error_code = UsageRecord.Status.COMPLETED, ""
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("embedding %d inputs with %s failed", len(token_ids), entry.name)
        status, error_code = UsageRecord.Status.FAILED, "engine_error"
        raise APIError(500, "The embedding model failed on this request.") from None
    finally:
        used = num_tokens if status == UsageRecord.Status.COMPLETED else 0  # what it got
        detach(
            _settle(
                admission, request_id, api_key, entry.name, status, error_code, used, started_at
            )
        )
        metrics.request_finished(
            endpoint=ENDPOINT,
            model=entry.name,
            status=status,
            prompt_tokens=used,
            cached_tokens=0,
            completion_tokens=0,
            time_to_first_token_ms=None,
        )
    return Embeddings(entry.name, vectors, num_tokens, dict(admission.headers))


async def _serving(client, entry: ModelEntry) -> EmbeddingInfo:
    try:
        return await client.embedding_model(model_spec(entry))
    except EmbeddingLoadError as exc:
        logger.error("embedding model %s could not be loaded: %s", entry.name, exc)
        raise APIError(
            503,
            f"The model '{entry.name}' could not be loaded; an administrator must check its "
            "registry entry.",
            code="model_load_failed",
        ) from None


def _check(token_ids: list[list[int]], info: EmbeddingInfo) -> None:
    for index, ids in enumerate(token_ids):
        if not ids:
            raise APIError(400, f"input[{index}] is empty.", param="input")
        if len(ids) > info.context_length:
            raise APIError(
                400,
                f"input[{index}] has {len(ids)} tokens; the model '{info.name}' takes at most "
                f"{info.context_length} per input.",
                param="input",
                code="context_length_exceeded",
            )
        bad = next((t for t in ids if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise APIError(
                400,
                f"input[{index}] holds token id {bad}, outside the vocabulary (0 to "
                f"{info.vocab_size - 1}).",
                param="input",
            )


async def _settle(admission, request_id, api_key, model, status, error_code, used, started_at):
    """The usage row and the limiter's release, after the request, whatever ended it."""
    try:
        await sync_to_async(usage_record_finished)(
            request_id=request_id,
            api_key=api_key,
            model=model,
            endpoint=ENDPOINT,
            status=status,
            started_at=started_at,
            prompt_tokens=used,
            error_code=error_code,
        )
    except Exception:
        logger.exception("usage row of %s not written", request_id)
    try:
        await admission.release(used_tokens=used)
    except Exception:
        logger.exception("limiter release of %s failed", request_id)
