"""/v1/responses: create (streamed or not), retrieve, delete, list input items.

A create reads its body (its input items, and how to make a generation call of a conversation)
and starts the response through the responses service (inference/services/responses.py: the
stored response it continues, truncation, storage), then builds its output items with
`ResponseBuilder` from the same output stage as chat completions (reasoning and tool-call
parsers). A stream the client leaves is billed for what it received and not stored (it never
finished).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_http_methods, require_POST

from engine import PromptInput
from inference.api.bodies import validate
from inference.api.chat import requires_tool_call, structured_output, tools_for_template
from inference.api.common import (
    authenticate,
    intake_for,
    json_response,
    read_body_in,
    typed_sse,
)
from inference.api.common import streaming_response as sse_response
from inference.api.responses import items as input_items
from inference.api.responses.events import ResponseBuilder
from inference.api.responses.serializers import InputItemsQuerySerializer, ResponseCreateSerializer
from inference.errors import APIError
from inference.services.admission import Intake
from inference.services.generation import Generation, GenerationCall
from inference.services.output import GenerationFailed
from inference.services.responses import (
    ResponseRun,
    input_items_page,
    response_not_found,
    response_start,
)
from inference.services.stored_responses import (
    response_delete,
    response_get,
    response_input_items_get,
)

logger = logging.getLogger(__name__)

SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
# reasoning.effort values a template understands as `reasoning_effort` (gpt-oss's harmony).
TEMPLATE_EFFORTS = ("low", "medium", "high")
ERROR_STREAM_FAILED = "The server had an error while streaming this response."


def _text_config(data: dict[str, Any]) -> dict[str, Any]:
    return data.get("text") or {"format": {"type": "text"}}


def _template_kwargs(data: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(data.get("chat_template_kwargs") or {})
    effort = (data.get("reasoning") or {}).get("effort")
    if effort in TEMPLATE_EFFORTS:
        kwargs.setdefault("reasoning_effort", effort)
    return kwargs


def response_items(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The input items of a validated create body."""
    return input_items.input_items(data["input"])


def preflight_call(data: dict[str, Any]) -> GenerationCall:
    """The call a body makes with its own input alone (what came before is in the database),
    for the preflight's checks: its grammar and tools."""
    return _call(data, response_items(data))


def _call(data: dict[str, Any], conversation: list[dict[str, Any]]) -> GenerationCall:
    functions, _ = input_items.template_tools(data.get("tools"))
    choice, functions = input_items.chat_tool_choice(data.get("tool_choice"), functions)
    tools = tools_for_template({"tools": functions, "tool_choice": choice})
    prompt = PromptInput(
        messages=tuple(input_items.chat_messages(data.get("instructions"), conversation)),
        tools=tools,
        chat_template_kwargs=_template_kwargs(data),
    )
    sampling = {name: data.get(name) for name in SAMPLING_FIELDS}
    sampling.update(
        max_tokens=data.get("max_output_tokens"),
        grammar=structured_output(
            _text_config(data)["format"], data.get("structured_outputs"), "text.format"
        ),
    )
    return GenerationCall(
        endpoint="responses",
        model=data["model"],
        prompts=(prompt,),
        prompt_param="input",
        sampling=sampling,
        param_names={"max_tokens": "max_output_tokens"},
        parse_output=True,
        tools=tools,
        parallel_tool_calls=data.get("parallel_tool_calls") is not False,
        require_tool_call=requires_tool_call(choice, tools),
        cache_salt=data.get("cache_salt"),
        service_tiers=data["service_tier"],
    )


def _response_object(
    response_id: str, data: dict[str, Any], generation: Generation, store: bool
) -> dict[str, Any]:
    reasoning = data.get("reasoning") or {}
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": data.get("instructions"),
        "max_output_tokens": data.get("max_output_tokens"),
        "max_tool_calls": data.get("max_tool_calls"),
        "model": generation.model,
        "output": [],
        "parallel_tool_calls": data.get("parallel_tool_calls") is not False,
        "previous_response_id": data.get("previous_response_id"),
        "prompt_cache_key": data.get("prompt_cache_key"),
        "reasoning": {"effort": reasoning.get("effort"), "summary": reasoning.get("summary")},
        "service_tier": generation.service_tier,
        "store": store,
        "temperature": data.get("temperature"),
        "text": _text_config(data),
        "tool_choice": data.get("tool_choice") or "auto",
        "tools": data.get("tools") or [],
        "top_p": data.get("top_p"),
        "truncation": data.get("truncation") or "disabled",
        "usage": None,
        "user": data.get("user"),
        "metadata": data.get("metadata") or {},
    }


def _usage(generation: Generation, builder: ResponseBuilder) -> dict[str, Any]:
    usage = generation.usage()
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": builder.reasoning_tokens},
        "total_tokens": usage["total_tokens"],
    }


class _Run:
    """One create: the started response and its builder, the events it sends."""

    def __init__(self, run: ResponseRun, builder: ResponseBuilder):
        self.run = run
        self.builder = builder
        self.error: str | None = None

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        for event in self.builder.start():
            yield event
        status = "completed"
        try:
            async with self.run.generation.deltas() as deltas:
                async for delta in deltas:
                    for event in self.builder.feed(delta):
                        yield event
                    if delta.finish_reason == "length":
                        status = "incomplete"
        except GenerationFailed as exc:
            status, self.error = "failed", exc.message
        self.builder.response["usage"] = _usage(self.run.generation, self.builder)
        error = {"code": "server_error", "message": self.error} if self.error else None
        final = self.builder.finish(status, error=error)
        await self.run.finished(self.builder.response)
        for event in final:
            yield event


async def _stream(run: _Run) -> AsyncIterator[bytes]:
    """The run's events as SSE; an unexpected error part-way is an `error` event (the stream
    still ends), as OpenAI sends one."""
    try:
        # Closed here, in order, when the client leaves (not later by the garbage collector).
        async with contextlib.aclosing(run.events()) as events:
            async for event in events:
                yield typed_sse(event)
    except Exception:
        logger.exception("a streamed response failed part-way")
        yield typed_sse(run.builder.error(ERROR_STREAM_FAILED))


@csrf_exempt
@require_POST
async def responses_create(request: HttpRequest) -> HttpResponse:
    async with intake_for(request, "responses") as intake:
        data, items = await read_body_in(
            intake,
            request,
            ResponseCreateSerializer,
            response_items,
            preflight_build=preflight_call,
        )
        created = await response_created(intake, data, items)
    headers = created.run.generation.headers
    if data.get("stream"):
        return sse_response(_stream(created), headers)
    return json_response(await response_completed(created), headers)


async def response_created(intake: Intake, data: dict[str, Any], items: list) -> _Run:
    """Start the response a validated create body asks for (its input `items` read)."""
    run = await response_start(
        intake=intake,
        input_items=items,
        call_for=functools.partial(_call, data),
        previous_response_id=data.get("previous_response_id"),
        truncate=data.get("truncation") == "auto",
        store=data.get("store") is not False,
    )
    builder = ResponseBuilder(
        _response_object(input_items.new_id("resp"), data, run.generation, run.store),
        input_items.template_tools(data.get("tools"))[1],
    )
    return _Run(run, builder)


async def response_completed(created: _Run) -> dict[str, Any]:
    """The whole response of a create not streamed (a response, a batch's line); a generation
    that failed is a 500."""
    async for _event in created.events():
        pass
    if created.error:
        raise APIError(500, created.error)
    return created.builder.response


@csrf_exempt
@require_http_methods(["GET", "DELETE"])
async def response_detail(request: HttpRequest, response_id: str) -> HttpResponse:
    api_key = await authenticate(request)
    if request.method == "DELETE":
        if not await sync_to_async(response_delete)(api_key=api_key, response_id=response_id):
            raise response_not_found(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True}, {})
    stored = await sync_to_async(response_get)(api_key=api_key, response_id=response_id)
    if stored is None:
        raise response_not_found(response_id)
    return json_response(stored.body, {})


@csrf_exempt
@require_GET
async def response_input_items(request: HttpRequest, response_id: str) -> HttpResponse:
    api_key = await authenticate(request)
    query = validate(InputItemsQuerySerializer, request.GET.dict())
    items = await sync_to_async(response_input_items_get)(api_key=api_key, response_id=response_id)
    if items is None:
        raise response_not_found(response_id)
    page = input_items_page(
        items, order=query["order"], after=query.get("after"), limit=query["limit"]
    )
    return json_response(page, {})
