"""POST /v1/chat/completions: validate → generation service → format."""

from __future__ import annotations

import time
import uuid
from typing import Any

from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST

from engine import PromptInput
from inference.api import openai_format as fmt
from inference.api.common import intake_for, json_response, read_body_in, streaming_response
from inference.api.serializers import ChatCompletionSerializer, MessageError, normalize_messages
from inference.errors import APIError
from inference.services.generation import Generation, GenerationCall, generation_start
from inference.services.structured import extension_grammar, response_format_grammar

# Body fields that are SamplingParams fields of the same name.
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "seed",
    "n",
    "stop",
    "stop_token_ids",
    "min_tokens",
    "ignore_eos",
)


def tools_for_template(data: dict[str, Any]) -> tuple[dict, ...] | None:
    """The tools the chat template sees (and the tool-call parser reads calls of).

    tool_choice "auto" (the default with tools) and "required" give the model every tool;
    a named function gives it only that one; "none" gives it none (and replies are not parsed
    for calls). With "required" and a named function the reply is constrained to a call
    (`GenerationCall.require_tool_call`)."""
    tools = data.get("tools") or ()
    choice = data.get("tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        named = tuple(t for t in tools if t["function"]["name"] == name)
        if not named:
            raise APIError(
                400,
                f"tool_choice names the function '{name}', which is not in tools.",
                param="tool_choice",
            )
        return named
    if choice == "required" and not tools:
        raise APIError(400, "tool_choice 'required' needs tools.", param="tool_choice")
    if not tools or choice == "none":
        return None
    return tuple(tools)


def chat_call(data: dict[str, Any]) -> GenerationCall:
    try:
        messages = normalize_messages(data["messages"])
    except MessageError as exc:
        raise APIError(400, exc.message, param=exc.param) from None
    tools = tools_for_template(data)
    prompt = PromptInput(
        messages=tuple(messages),
        tools=tools,
        chat_template_kwargs=data.get("chat_template_kwargs") or {},
    )
    sampling = {name: data.get(name) for name in SAMPLING_FIELDS}
    max_tokens = data.get("max_completion_tokens")  # the newer name wins when both are sent
    sampling.update(
        max_tokens=data.get("max_tokens") if max_tokens is None else max_tokens,
        logprobs=bool(data.get("logprobs")),
        top_logprobs=data.get("top_logprobs"),
        grammar=structured_output(data.get("response_format"), data.get("structured_outputs")),
    )
    return GenerationCall(
        endpoint="chat.completions",
        model=data["model"],
        prompts=(prompt,),
        prompt_param="messages",
        sampling=sampling,
        param_names={} if max_tokens is None else {"max_tokens": "max_completion_tokens"},
        parse_output=True,
        tools=tools,
        parallel_tool_calls=data.get("parallel_tool_calls") is not False,
        require_tool_call=requires_tool_call(data.get("tool_choice"), tools),
        cache_salt=data.get("cache_salt"),
        service_tiers=data["service_tier"],
    )


def requires_tool_call(choice: Any, tools: tuple | None) -> bool:
    return bool(tools) and (choice == "required" or isinstance(choice, dict))


def structured_output(
    response_format: Any, extension: Any, format_param: str = "response_format"
) -> str | None:
    """The grammar a body asks for: its response format or the structured_outputs extension
    (not both)."""
    from_format = response_format_grammar(response_format, format_param)
    extension = extension_grammar(extension)
    if from_format is not None and extension is not None:
        raise APIError(
            400,
            f"Give either {format_param} or structured_outputs, not both.",
            param="structured_outputs",
        )
    return from_format if extension is None else extension


@csrf_exempt
@require_POST
async def chat_completions(request: HttpRequest) -> HttpResponse:
    async with intake_for(request, "chat.completions") as intake:
        data, call = await read_body_in(intake, request, ChatCompletionSerializer, chat_call)
        generation = await generation_start(intake=intake, call=call)
    completion_id = f"chatcmpl-{uuid.uuid4().hex}"
    created = int(time.time())
    if data.get("stream"):
        chunks = fmt.chat_chunks(
            generation,
            completion_id=completion_id,
            created=created,
            include_usage=bool((data.get("stream_options") or {}).get("include_usage")),
        )
        return streaming_response(chunks, generation.headers)
    body = await chat_completion_object(
        generation, data, completion_id=completion_id, created=created
    )
    return json_response(body, generation.headers)


async def chat_completion_object(
    generation: Generation, data: dict[str, Any], *, completion_id: str, created: int
) -> dict[str, Any]:
    """The whole chat.completion of a generation not streamed (a response, a batch's line)."""
    choices = await fmt.aggregate(generation)
    return fmt.chat_completion_body(
        generation,
        choices,
        completion_id=completion_id,
        created=created,
        want_logprobs=bool(data.get("logprobs")),
    )
