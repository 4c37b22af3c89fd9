"""The OpenAI-compatible /v1 endpoints: validate → execute → serialize.

Plain Django `async def` views: Django's ASGI handler cancels a view whose client disconnected
while streaming, which aborts the generation in the engine (see inference/execution.py).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from asgiref.sync import sync_to_async
from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest, HttpResponse, JsonResponse, StreamingHttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST
from rest_framework import serializers

from accounts.authentication import AuthenticationError, authenticate_header
from accounts.models import ApiKey
from engine.protocol import (
    GenerationRequest,
    InvalidRequestError,
    ModelInfo,
    ModelNotLoadedError,
    PromptInput,
    SamplingParams,
)
from inference.api import openai_format as fmt
from inference.api.serializers import (
    ChatCompletionSerializer,
    CompletionSerializer,
    MessageError,
    normalize_messages,
)
from inference.engine_access import get_engine_client
from inference.errors import APIError, model_not_found
from inference.models import ModelEntry
from inference.services.execution import Execution
from inference.services.registry import model_for_key, model_spec, models_for_key

logger = logging.getLogger(__name__)

# OpenAI's default for the legacy completions endpoint; chat defaults to the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


async def authenticate(request: HttpRequest) -> ApiKey:
    try:
        api_key = await sync_to_async(authenticate_header)(request.headers.get("Authorization"))
    except AuthenticationError as exc:
        raise APIError(401, exc.message, code=exc.code) from None
    request.orchard_api_key = api_key  # for the middleware's x-ratelimit-* headers
    return api_key


def parse_json_body(request: HttpRequest) -> dict[str, Any]:
    try:
        body = request.body
    except RequestDataTooBig:
        raise APIError(413, "Request body too large.", code="request_too_large") from None
    try:
        data = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise APIError(
            400,
            "We could not parse the JSON body of your request. (HINT: This likely means you "
            "aren't using your HTTP library correctly.)",
        ) from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    return data


def validate(serializer_class: type[serializers.Serializer], data: dict) -> dict[str, Any]:
    serializer = serializer_class(data=data)
    try:
        serializer.is_valid(raise_exception=True)
    except serializers.ValidationError:
        param, message = _first_error(serializer.errors)
        raise APIError(400, f"Invalid '{param}': {message}", param=param) from None
    return serializer.validated_data


def _first_error(errors: Any, path: str = "") -> tuple[str, str]:
    if isinstance(errors, dict):
        key, value = next(iter(errors.items()))
        return _first_error(value, f"{path}.{key}" if path else str(key))
    if isinstance(errors, list):
        return (
            _first_error(errors[0], path)
            if isinstance(errors[0], dict | list)
            else (
                path,
                str(errors[0]),
            )
        )
    return path, str(errors)


async def resolve_model(api_key: ApiKey, name: str) -> tuple[ModelEntry, ModelInfo]:
    entry = await sync_to_async(model_for_key)(api_key, name)
    if entry is None:
        raise model_not_found(name)
    try:
        info = await get_engine_client().ensure_model(model_spec(entry))
    except Exception as exc:
        logger.exception("loading model %s from %s failed", name, entry.path)
        raise APIError(
            503,
            f"The model '{name}' could not be loaded; an administrator must check its registry "
            "entry.",
            code=getattr(exc, "code", "model_load_failed"),
        ) from None
    return entry, info


def sampling_params(
    data: dict[str, Any],
    entry: ModelEntry,
    *,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int,
    json_mode: bool = False,
    default_max_tokens: int | None = None,
) -> SamplingParams:
    def pick(name: str, fallback: Any) -> Any:
        value = data.get(name)
        if value is None:
            value = entry.default_sampling.get(name, fallback)
        return value

    if max_tokens is None:
        max_tokens = entry.default_sampling.get("max_tokens", default_max_tokens)
    return SamplingParams(
        temperature=float(pick("temperature", 1.0)),
        top_p=float(pick("top_p", 1.0)),
        top_k=int(pick("top_k", 0)),
        min_p=float(pick("min_p", 0.0)),
        repetition_penalty=float(pick("repetition_penalty", 1.0)),
        presence_penalty=float(pick("presence_penalty", 0.0)),
        frequency_penalty=float(pick("frequency_penalty", 0.0)),
        logit_bias=data.get("logit_bias") or {},
        seed=data.get("seed"),
        max_tokens=max_tokens,
        min_tokens=data.get("min_tokens") or 0,
        ignore_eos=bool(data.get("ignore_eos")),
        stop=data.get("stop") or (),
        stop_token_ids=tuple(data.get("stop_token_ids") or ()),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=data.get("n") or 1,
        json_mode=json_mode,
    )


def fit_to_context(
    sampling: SamplingParams, prompt_len: int, info: ModelInfo, *, param: str
) -> SamplingParams:
    """Check prompt + completion against the context and default max_tokens to what is left."""
    available = info.context_length - prompt_len
    requested = sampling.max_tokens
    if available < 1 or (requested is not None and requested > available):
        completion = requested if requested is not None else 1
        raise APIError(
            400,
            f"This model's maximum context length is {info.context_length} tokens. However, you "
            f"requested {prompt_len + completion} tokens ({prompt_len} in the {param}, "
            f"{completion} in the completion). Please reduce the length of the {param} or "
            "completion.",
            param=param,
            code="context_length_exceeded",
        )
    if requested is None:
        return SamplingParams(**{**sampling.__dict__, "max_tokens": available})
    return sampling


def tools_for_template(data: dict[str, Any]) -> tuple[dict, ...] | None:
    """The tools the chat template should see. Forcing a call needs tool-call parsing, which
    Orchard does not do yet, so only "auto" (the default) and "none" are accepted."""
    tools = data.get("tools")
    choice = data.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise APIError(
            400,
            "tool_choice may be 'auto' or 'none' on this server: forcing a tool call is not "
            "supported yet.",
            param="tool_choice",
        )
    if not tools or choice == "none":
        return None
    return tuple(tools)


def check_sampling(sampling: SamplingParams, info: ModelInfo) -> None:
    try:
        sampling.validate(vocab_size=info.vocab_size)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param) from None


def streaming_response(chunks, headers: dict[str, str]) -> StreamingHttpResponse:
    response = StreamingHttpResponse(chunks, content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    for name, value in headers.items():
        response[name] = value
    return response


def json_response(body: dict[str, Any], headers: dict[str, str]) -> JsonResponse:
    response = JsonResponse(body)
    for name, value in headers.items():
        response[name] = value
    return response


async def render(model: str, prompt: PromptInput, *, param: str) -> list[int]:
    try:
        token_ids = await get_engine_client().render_prompt(model, prompt)
    except InvalidRequestError as exc:
        raise APIError(400, str(exc), param=exc.param or param) from None
    except ModelNotLoadedError as exc:
        raise APIError(
            503, "The model is being reloaded; please retry shortly.", code=exc.code
        ) from None
    except (ValueError, TypeError) as exc:
        # Chat templates raise on conversations they cannot render (e.g. roles out of order).
        raise APIError(400, f"The prompt could not be rendered: {exc}", param=param) from None
    if not token_ids:
        raise APIError(400, f"The {param} rendered to an empty prompt.", param=param)
    return token_ids


@csrf_exempt
@require_GET
async def models_list(request: HttpRequest) -> HttpResponse:
    api_key = await authenticate(request)
    entries = await sync_to_async(models_for_key)(api_key)
    return JsonResponse({"object": "list", "data": [_model_object(entry) for entry in entries]})


@csrf_exempt
@require_GET
async def model_detail(request: HttpRequest, model_id: str) -> HttpResponse:
    api_key = await authenticate(request)
    entry = await sync_to_async(model_for_key)(api_key, model_id)
    if entry is None:
        raise model_not_found(model_id)
    return JsonResponse(_model_object(entry))


def _model_object(entry: ModelEntry) -> dict[str, Any]:
    return {
        "id": entry.name,
        "object": "model",
        "created": int(entry.created_at.timestamp()),
        "owned_by": "orchard",
    }


@csrf_exempt
@require_POST
async def chat_completions(request: HttpRequest) -> HttpResponse:
    api_key = await authenticate(request)
    data = validate(ChatCompletionSerializer, parse_json_body(request))
    try:
        messages = normalize_messages(data["messages"])
    except MessageError as exc:
        raise APIError(400, exc.message, param=exc.param) from None
    entry, info = await resolve_model(api_key, data["model"])
    chat_template_kwargs = data.get("chat_template_kwargs") or {}
    prompt = PromptInput(
        messages=tuple(messages),
        tools=tools_for_template(data),
        chat_template_kwargs=chat_template_kwargs,
    )
    prompt_ids = await render(entry.name, prompt, param="messages")
    want_logprobs = bool(data.get("logprobs"))
    sampling = sampling_params(
        data,
        entry,
        max_tokens=data.get("max_completion_tokens") or data.get("max_tokens"),
        logprobs=want_logprobs,
        top_logprobs=data.get("top_logprobs") or 0,
        json_mode=(data.get("response_format") or {}).get("type") == "json_object",
    )
    check_sampling(sampling, info)
    sampling = fit_to_context(sampling, len(prompt_ids), info, param="messages")
    request_id = request.orchard_request_id
    execution = Execution(
        api_key=api_key,
        model=entry.name,
        endpoint="chat.completions",
        request_id=request_id,
        requests=[GenerationRequest(request_id, entry.name, tuple(prompt_ids), sampling)],
    )
    await execution.start()
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if data.get("stream"):
        chunks = fmt.chat_chunks(
            execution,
            completion_id=completion_id,
            created=created,
            model=entry.name,
            include_usage=bool((data.get("stream_options") or {}).get("include_usage")),
        )
        return streaming_response(chunks, execution.headers)
    choices = await fmt.aggregate(execution, sampling.n)
    body = fmt.chat_completion_body(
        execution,
        choices,
        completion_id=completion_id,
        created=created,
        model=entry.name,
        want_logprobs=want_logprobs,
    )
    return json_response(body, execution.headers)


@csrf_exempt
@require_POST
async def completions(request: HttpRequest) -> HttpResponse:
    api_key = await authenticate(request)
    data = validate(CompletionSerializer, parse_json_body(request))
    if data.get("suffix"):
        raise APIError(400, "suffix is not supported by this server.", param="suffix")
    if (data.get("best_of") or 1) != 1:
        raise APIError(400, "best_of is not supported by this server.", param="best_of")
    want_logprobs = data.get("logprobs") is not None
    if data.get("echo") and want_logprobs:
        raise APIError(
            400, "echo together with logprobs is not supported by this server.", param="echo"
        )
    entry, info = await resolve_model(api_key, data["model"])
    client = get_engine_client()
    prompts_ids = []
    for prompt in data["prompt"]:
        source = (
            PromptInput(text=prompt)
            if isinstance(prompt, str)
            else PromptInput(token_ids=tuple(prompt))
        )
        prompts_ids.append(await render(entry.name, source, param="prompt"))
    sampling = sampling_params(
        data,
        entry,
        max_tokens=data.get("max_tokens"),
        default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS,
        logprobs=want_logprobs,
        top_logprobs=data.get("logprobs") or 0,
    )
    check_sampling(sampling, info)
    for prompt_ids in prompts_ids:
        fit_to_context(sampling, len(prompt_ids), info, param="prompt")
    request_id = request.orchard_request_id
    execution = Execution(
        api_key=api_key,
        model=entry.name,
        endpoint="completions",
        request_id=request_id,
        requests=[
            GenerationRequest(f"{request_id}-{i}", entry.name, tuple(ids), sampling)
            for i, ids in enumerate(prompts_ids)
        ],
    )
    echo_texts = None
    if data.get("echo"):
        echo_texts = [
            p if isinstance(p, str) else await client.detokenize(entry.name, p)
            for p in data["prompt"]
        ]
    await execution.start()
    completion_id = f"cmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if data.get("stream"):
        chunks = fmt.completion_chunks(
            execution,
            completion_id=completion_id,
            created=created,
            model=entry.name,
            include_usage=bool((data.get("stream_options") or {}).get("include_usage")),
            echo_texts=echo_texts,
            want_logprobs=want_logprobs,
        )
        return streaming_response(chunks, execution.headers)
    choices = await fmt.aggregate(execution, len(prompts_ids) * sampling.n)
    body = fmt.text_completion_body(
        execution,
        choices,
        completion_id=completion_id,
        created=created,
        model=entry.name,
        echo_texts=echo_texts,
        want_logprobs=want_logprobs,
    )
    return json_response(body, execution.headers)
