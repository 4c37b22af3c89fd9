"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the one
generation service (keys from `x-api-key` or `Authorization: Bearer`, the same limits, usage
rows with `endpoint` = messages), errors in Anthropic's shape (inference/errors.py)."""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from rest_framework import serializers

from engine import PromptInput
from inference.api import common
from inference.api.anthropic import convert
from inference.api.anthropic.events import MessageBuilder, stop_reason
from inference.api.chat import requires_tool_call, tools_for_template
from inference.api.serializers import (
    ANTHROPIC_SERVICE_TIERS,
    CacheSaltField,
    IntField,
    NumberField,
    ServiceTierField,
    StrictBooleanField,
    StrictCharField,
)
from inference.errors import APIError
from inference.services.generation import (
    Generation,
    GenerationCall,
    generation_start,
    prompt_token_count,
)
from inference.services.output import GenerationFailed

logger = logging.getLogger(__name__)

ERROR_STREAM_FAILED = "The server had an error while streaming this response."
# The tier a message was served in, by Anthropic's names (its usage's `service_tier`).
USAGE_SERVICE_TIERS = {"priority": "priority", "default": "standard", "flex": "batch"}


class CountTokensSerializer(serializers.Serializer):
    model = StrictCharField(max_length=200)
    messages = serializers.JSONField()
    system = serializers.JSONField(required=False, allow_null=True)
    tools = serializers.JSONField(required=False, allow_null=True)
    tool_choice = serializers.JSONField(required=False, allow_null=True)
    thinking = serializers.JSONField(required=False, allow_null=True)


class MessagesSerializer(CountTokensSerializer):
    max_tokens = IntField()  # required, as Anthropic requires it
    stop_sequences = serializers.ListField(child=StrictCharField(), required=False, allow_null=True)
    temperature = NumberField(required=False, allow_null=True)
    top_p = NumberField(required=False, allow_null=True)
    top_k = IntField(required=False, allow_null=True)
    stream = StrictBooleanField(required=False, allow_null=True)
    metadata = serializers.DictField(required=False, allow_null=True)
    service_tier = ServiceTierField(ANTHROPIC_SERVICE_TIERS)
    cache_salt = CacheSaltField()  # an Orchard extension (`extra_body` in the SDK)


def _call(data: dict[str, Any]) -> GenerationCall:
    choice, parallel = convert.chat_tool_choice(data.get("tool_choice"))
    functions = convert.chat_tools(data.get("tools"))
    tools = tools_for_template({"tools": functions, "tool_choice": choice})
    prompt = PromptInput(
        messages=tuple(convert.chat_messages(data.get("system"), data["messages"])),
        tools=tools,
        chat_template_kwargs=convert.template_kwargs(data.get("thinking")),
    )
    sampling = {
        "temperature": data.get("temperature"),
        "top_p": data.get("top_p"),
        "top_k": data.get("top_k"),
        "max_tokens": data.get("max_tokens"),
        "stop": tuple(data.get("stop_sequences") or ()),
    }
    return GenerationCall(
        endpoint="messages",
        model=data["model"],
        prompts=(prompt,),
        prompt_param="messages",
        sampling=sampling,
        param_names={"stop": "stop_sequences"},
        parse_output=True,
        tools=tools,
        parallel_tool_calls=parallel,
        require_tool_call=requires_tool_call(choice, tools),
        cache_salt=data.get("cache_salt"),
        service_tiers=data["service_tier"],
    )


def _counted_call(data: dict[str, Any]) -> GenerationCall:
    return _call({**data, "max_tokens": 1, "service_tier": ANTHROPIC_SERVICE_TIERS["auto"]})


def _usage(generation: Generation) -> dict[str, Any]:
    usage = generation.usage()
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "input_tokens": usage["prompt_tokens"] - cached,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": usage["completion_tokens"],
        "service_tier": USAGE_SERVICE_TIERS[generation.service_tier],
    }


class _Run:
    def __init__(self, generation: Generation, builder: MessageBuilder):
        self.generation = generation
        self.builder = builder
        self.started = False

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        """The message's events; message_start waits for the first output (it carries the
        prompt's token count). GenerationFailed propagates."""
        finish, stop = None, None
        async with self.generation.deltas() as deltas:
            async for delta in deltas:
                if not self.started:
                    self.started = True
                    for event in self.builder.start(_usage(self.generation)):
                        yield event
                for event in self.builder.feed(delta):
                    yield event
                finish = delta.finish_reason or finish
                stop = delta.stop_sequence or stop
        if not self.started:
            self.started = True
            for event in self.builder.start(_usage(self.generation)):
                yield event
        for event in self.builder.finish(stop_reason(finish, stop), stop, _usage(self.generation)):
            yield event


def _error_event(message: str) -> bytes:
    return common.typed_sse({"type": "error", "error": {"type": "api_error", "message": message}})


async def _stream(run: _Run) -> AsyncIterator[bytes]:
    try:
        # Closed here, in order, when the client leaves (not later by the garbage collector).
        async with contextlib.aclosing(run.events()) as events:
            async for event in events:
                yield common.typed_sse(event)
    except GenerationFailed as exc:
        yield _error_event(exc.message)
    except Exception:
        logger.exception("a streamed message failed part-way")
        yield _error_event(ERROR_STREAM_FAILED)


@csrf_exempt
@require_POST
async def messages_create(request: HttpRequest) -> HttpResponse:
    async with common.intake_for(request, "messages", x_api_key=True) as intake:
        data, call = await common.read_body_in(intake, request, MessagesSerializer, _call)
        generation = await generation_start(intake=intake, call=call)
    message = {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": generation.model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {},
    }
    run = _Run(generation, MessageBuilder(message))
    if data.get("stream"):
        return common.streaming_response(_stream(run), generation.headers)
    try:
        async for _event in run.events():
            pass
    except GenerationFailed as exc:
        raise APIError(500, exc.message) from None
    return common.json_response(message, generation.headers)


@csrf_exempt
@require_POST
async def count_tokens(request: HttpRequest) -> HttpResponse:
    async with common.intake_for(request, "messages.count_tokens", x_api_key=True) as intake:
        _, call = await common.read_body_in(intake, request, CountTokensSerializer, _counted_call)
        count = await prompt_token_count(intake=intake, call=call)
    return common.json_response({"input_tokens": count}, {})
