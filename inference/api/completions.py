"""POST /v1/completions (the legacy endpoint): validate → generation service → format."""

from __future__ import annotations

import time
import uuid
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from engine import PromptInput
from inference.api import openai_format as fmt
from inference.api.chat import SAMPLING_FIELDS
from inference.api.common import intake_for, json_response, read_body_in, streaming_response
from inference.api.serializers import CompletionSerializer
from inference.errors import APIError
from inference.services.generation import Generation, GenerationCall, generation_start
from inference.services.structured import extension_grammar

# OpenAI's default for this endpoint; chat defaults to the rest of the context.
DEFAULT_MAX_TOKENS = 16


def completion_call(data: dict[str, Any]) -> GenerationCall:
    if data.get("suffix"):
        raise APIError(400, "suffix is not supported by this server.", param="suffix")
    if data.get("best_of") not in (None, 1):
        raise APIError(400, "best_of is not supported by this server.", param="best_of")
    want_logprobs = data.get("logprobs") is not None
    if data.get("echo") and want_logprobs:
        raise APIError(
            400, "echo together with logprobs is not supported by this server.", param="echo"
        )
    prompts = tuple(
        PromptInput(text=p) if isinstance(p, str) else PromptInput(token_ids=tuple(p))
        for p in data["prompt"]
    )
    sampling = {name: data.get(name) for name in SAMPLING_FIELDS}
    sampling.update(
        max_tokens=data.get("max_tokens"),
        logprobs=want_logprobs,
        top_logprobs=data.get("logprobs"),
        grammar=extension_grammar(data.get("structured_outputs")),
    )
    return GenerationCall(
        endpoint="completions",
        model=data["model"],
        prompts=prompts,
        prompt_param="prompt",
        sampling=sampling,
        default_max_tokens=DEFAULT_MAX_TOKENS,
        echo=bool(data.get("echo")),
        param_names={"top_logprobs": "logprobs"},
        cache_salt=data.get("cache_salt"),
        service_tiers=data["service_tier"],
    )


@csrf_exempt
@require_POST
async def completions(request: HttpRequest) -> HttpResponse:
    async with intake_for(request, "completions") as intake:
        data, call = await read_body_in(intake, request, CompletionSerializer, completion_call)
        generation = await generation_start(intake=intake, call=call)
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if data.get("stream"):
        chunks = fmt.completion_chunks(
            generation,
            completion_id=completion_id,
            created=created,
            include_usage=bool((data.get("stream_options") or {}).get("include_usage")),
            want_logprobs=data.get("logprobs") is not None,
        )
        return streaming_response(chunks, generation.headers)
    body = await text_completion_object(
        generation, data, completion_id=completion_id, created=created
    )
    return json_response(body, generation.headers)


async def text_completion_object(
    generation: Generation, data: dict[str, Any], *, completion_id: str, created: int
) -> dict[str, Any]:
    """The whole text_completion of a generation not streamed (a response, a batch's line)."""
    choices = await fmt.aggregate(generation)
    return fmt.text_completion_body(
        generation,
        choices,
        completion_id=completion_id,
        created=created,
        want_logprobs=data.get("logprobs") is not None,
    )
