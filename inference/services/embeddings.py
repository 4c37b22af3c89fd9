"""/v1/embeddings: inputs to vectors for a key, with its limits and a usage row.

In order, through the same way in and out as a generation (inference/services/admission.py,
settlement.py), on a request its intake let in (the key's rpm and a parallel slot): the model
(one this key may use, and an embedding model), tokenizing in a tokenizer process under the
render deadline (or checking given token ids against the vocabulary), each input inside the
model's context (both preparation jobs of the fair gate, off the event loop), admission for
the tokens, the usage row, then one batched request to the model's embedding engine
(concurrent requests share its forwards). The row is settled
once, whatever ends the request (a client that leaves stops its engine job between forwards
and is billed the tokens computed until then), and its write retried if the database refuses
it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
from django.conf import settings

from engine import (
    EmbeddingInfo,
    EmbeddingProgress,
    EngineClient,
    InvalidRequestError,
    ModelLoadError,
    ModelNotLoadedError,
    ModelUnavailableError,
)
from inference.errors import APIError
from inference.models import ModelEntry, UsageRecord
from inference.services.admission import Intake, model_load_failed, model_unavailable
from inference.services.engines import get_engine_client
from inference.services.registry import model_spec

logger = logging.getLogger(__name__)

MAX_INPUTS = 2048  # OpenAI's limit per request
ENDPOINT = "embeddings"
T = TypeVar("T")


@dataclass
class Embeddings:
    model: str
    vectors: np.ndarray  # (inputs, dimensions) float32
    num_tokens: int
    headers: dict[str, str]


async def embeddings_create(
    *,
    intake: Intake,
    model: str,
    inputs: list[str] | list[list[int]],
    dimensions: int | None = None,
) -> Embeddings:
    entry = await intake.model_entry(name=model, kind=ModelEntry.Kind.EMBEDDING)
    if len(inputs) > MAX_INPUTS:
        raise APIError(400, f"'input' takes at most {MAX_INPUTS} items.", param="input")
    client = get_engine_client()
    info = await _serving(client, entry)
    if dimensions is not None and dimensions != info.dimensions:
        raise APIError(
            400,
            f"The model '{entry.name}' makes {info.dimensions}-dimensional embeddings and does "
            f"not support shortening them; 'dimensions' must be {info.dimensions} or omitted.",
            param="dimensions",
        )
    token_ids = inputs
    if isinstance(inputs[0], str):
        timeout_s = settings.ORCHARD_RENDER_TIMEOUT_SECONDS
        token_ids = await intake.prepare(
            lambda: _on_engine(client.tokenize(entry.name, inputs, timeout_s=timeout_s), entry.name)
        )
    num_tokens = await intake.in_thread(_check, token_ids, info)
    settlement = await intake.reserve(model=entry.name, reserved_tokens=num_tokens)
    status, error_code = UsageRecord.Status.FAILED, "server_error"
    progress = EmbeddingProgress()
    try:
        await settlement.open()
        vectors = await _on_engine(client.embed(entry.name, token_ids, progress), entry.name)
        settlement.usage.prompt_tokens = num_tokens  # billed: the client gets its vectors
        status, error_code = UsageRecord.Status.COMPLETED, ""
    except asyncio.CancelledError:
        # The engine stopped it between forwards: billed what it computed until then.
        settlement.usage.prompt_tokens = progress.num_computed_tokens
        status, error_code = UsageRecord.Status.CANCELLED, "client_disconnected"
        raise
    except APIError:
        status, error_code = UsageRecord.Status.FAILED, "engine_error"
        raise
    finally:
        await settlement.settle(status, error_code=error_code)
    return Embeddings(entry.name, vectors, num_tokens, settlement.headers)


async def _on_engine(work: Awaitable[T], model: str) -> T:
    """`work` on the model's engine: 503 when nothing serves the model now (its engine worker
    stopped mid-call, say: a retry may find another), 500 when the model fails on it."""
    try:
        return await work
    except InvalidRequestError as exc:  # inputs past the tokenizing deadline
        raise APIError(400, str(exc), param="input") from None
    except (ModelNotLoadedError, ModelUnavailableError) as exc:
        logger.warning("embedding model %s: %s", model, exc)
        raise APIError(503, str(exc), code=exc.code) from None
    except Exception:
        logger.exception("embedding with %s failed", model)
        raise APIError(500, "The embedding model failed on this request.") from None


async def _serving(client: EngineClient, entry: ModelEntry) -> EmbeddingInfo:
    try:
        return await client.embedding_model(model_spec(entry))
    except ModelUnavailableError as exc:
        logger.warning("embedding model %s: %s", entry.name, exc)
        raise model_unavailable(exc) from None
    except ModelLoadError as exc:
        logger.error("embedding model %s could not be loaded: %s", entry.name, exc)
        raise model_load_failed(entry) from None


def _check(token_ids: list[list[int]], info: EmbeddingInfo) -> int:
    """The inputs' number of tokens, if the model can take each of them (else a 400)."""
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
    return sum(len(ids) for ids in token_ids)
