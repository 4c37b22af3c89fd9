"""The one generation path under every generating /v1 endpoint.

An endpoint lets its request in (`request_intake`, inference/services/admission.py: the key's
rpm and a parallel slot, spent before its body is read, so a refused request costs nothing),
reads its body into a `GenerationCall` (which model, which prompts, the sampling fields the
caller set) off the event loop, and calls `generation_start`; everything between that and a
running generation happens here, once, in this order:

1. the model: one this key may use, a chat model, and the engine serving it (never waiting for
   a reload; 503 if it cannot load);
2. rendering (chat template, or the tokenizer), each prompt a job of the fair preparation gate
   (inference/services/prework.py) in a tokenizer process its deadline stops;
3. the sampling parameters: the caller's fields over the model's registry defaults, a
   max_tokens over the model's or the key's output ceiling refused, max_tokens left unset
   sized by `engine.completion_budget` (`Sizing`) within the model's default output size and
   those ceilings, the prefix-cache scope (the key's team
   and the call's `cache_salt`: inference/services/cache_scope.py), and the service class (the
   key's team and its weight, the key, and the tier: inference/services/service_class.py; a
   tier the key may not use is refused first of all);
4. validation by `engine.validate_generation` (token ids, ranges, context), the check the
   engine repeats at submit;
5. admission (reserving tokens on the intake; fewer when the caller left max_tokens to the
   server, and the requests are sized again within the grant), then the usage row and the
   engine streams (`Execution`), settled once whatever ends them.

What comes back is a `Generation`: its `deltas()` run each choice through the output stage
(inference/services/output.py), and the endpoint only formats them.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.conf import settings

from engine import (
    InvalidRequestError,
    ModelInfo,
    ModelLoadError,
    ModelNotLoadedError,
    ModelUnavailableError,
    PromptImage,
    PromptInput,
    PromptRoom,
    RenderedPrompt,
    SamplingParams,
    validate_generation,
)
from inference.errors import APIError
from inference.models import SAMPLING_DEFAULT_FIELDS, ModelEntry
from inference.parsers.registry import OutputParsing, detect_reasoning_parser, detect_tool_parser
from inference.services.admission import Intake, model_load_failed, model_unavailable
from inference.services.cache_scope import prefix_cache_scope
from inference.services.engines import get_engine_client
from inference.services.execution import ERROR_RELOADING, Execution
from inference.services.images import prompts_with_images
from inference.services.output import ChoiceDelta, GenerationFailed, choice_stages
from inference.services.registry import model_spec
from inference.services.service_class import AUTO_TIERS, service_class
from inference.services.sizing import Sizing
from inference.services.structured import tool_call_grammar

logger = logging.getLogger(__name__)


# Completions one call may ask for (prompts × n).
MAX_CHOICES_PER_CALL = 128
ERROR_OVER_MODEL_CEILING = (
    "{param} is too large: {asked}. The model '{model}' generates at most {ceiling} tokens per "
    "reply; lower {param}, or leave it unset for the model's default."
)
ERROR_OVER_KEY_CEILING = (
    "{param} is too large: {asked}. This API key may ask for at most {ceiling} tokens per "
    "reply; lower {param}, or leave it unset for the model's default."
)


@dataclass(frozen=True)
class GenerationCall:
    """What an endpoint asks for, read from its body.

    `sampling` holds `SamplingParams` fields the caller set (None or absent: not set, so the
    model's registry default or the engine's applies); `max_tokens` absent or None leaves the
    size to the server (the model's default output size, else `default_max_tokens`, else the
    rest of the context, within the model's and the key's output ceilings). `prompt_param`
    names the body field errors about the prompt point at ("messages", "prompt", "input").
    """

    endpoint: str
    model: str
    prompts: tuple[PromptInput, ...]
    prompt_param: str
    sampling: Mapping[str, Any] = field(default_factory=dict)
    default_max_tokens: int | None = None
    echo: bool = False  # also detokenize the prompts (`Generation.prompt_texts`)
    # SamplingParams field -> the body field it was read from, where their names differ, so that
    # errors name what the caller sent (e.g. "max_tokens" -> "max_completion_tokens").
    param_names: Mapping[str, str] = field(default_factory=dict)
    # Chat replies go through the model's reasoning and tool-call parsers; `tools` (those the
    # template was given; None: tool calls are not parsed) and `parallel_tool_calls` say how.
    parse_output: bool = False
    tools: tuple[Mapping[str, Any], ...] | None = None
    parallel_tool_calls: bool = True
    # tool_choice "required" or a named function: the reply is constrained to a call of one of
    # `tools` in the model's tool-call syntax. (Other structured output arrives as
    # sampling["grammar"], built by the endpoint from its own fields.)
    require_tool_call: bool = False
    # Narrows the prefix-cache scope: only calls with the same salt (and team) share cache hits.
    cache_salt: str | None = None
    # The service tiers the caller accepts, most wanted first (its `service_tier`): the call is
    # served in the first one its key may use.
    service_tiers: tuple[str, ...] = AUTO_TIERS

    def name(self, param: str | None) -> str | None:
        """The body field a validation error's parameter stands for."""
        if param in ("prompt", "messages"):
            return self.prompt_param
        return self.param_names.get(param, param)


@dataclass
class Generation:
    """A started generation: the endpoint formats its `deltas()` and `usage()`."""

    execution: Execution
    entry: ModelEntry
    prompt_texts: list[str] | None = None
    parsing: OutputParsing | None = None

    @property
    def model(self) -> str:
        return self.entry.name

    @property
    def service_tier(self) -> str:
        """The tier the generation is served (and metered) in."""
        return self.execution.settlement.service_tier

    @property
    def headers(self) -> dict[str, str]:
        return self.execution.headers

    @property
    def num_choices(self) -> int:
        return self.execution.num_choices

    @property
    def choices_per_prompt(self) -> int:
        return self.execution.choices_per_request

    def usage(self) -> dict[str, Any]:
        return self.execution.usage()

    @contextlib.asynccontextmanager
    async def deltas(self) -> AsyncIterator[AsyncIterator[ChoiceDelta]]:
        """`async with generation.deltas() as deltas`: each choice's output, in arrival order
        (GenerationFailed when a choice fails). An exception in the block other than the client
        leaving records the request as failed by the server; leaving the block ends the
        generation either way."""
        stream = self._deltas()
        try:
            yield stream
        except (GeneratorExit, asyncio.CancelledError, GenerationFailed):
            raise
        except BaseException:
            self.execution.fail("server_error")
            raise
        finally:
            await stream.aclose()

    async def _deltas(self) -> AsyncIterator[ChoiceDelta]:
        stages = choice_stages(self.num_choices, self.parsing)
        async with contextlib.aclosing(self.execution.outputs()) as outputs:
            async for item in outputs:
                yield stages[item.choice].feed(item.output)


async def generation_start(*, intake: Intake, call: GenerationCall) -> Generation:
    """Run `call` for the request `intake` let in (steps in the module docstring). Raises
    APIError for anything the caller can fix or should retry; nothing is reserved or left open
    when it does (the intake gives its slot back)."""
    api_key, request_id = intake.api_key, intake.request_id
    service = service_class(
        api_key=api_key, accepted=call.service_tiers, batch=bool(intake.batch_id)
    )
    entry = await intake.model_entry(name=call.model, kind=ModelEntry.Kind.CHAT)
    info = await _serving_model(entry)
    sampling, size_limit = _sampling(call, entry, key_ceiling=api_key.max_output_tokens)
    if len(call.prompts) * sampling.n > MAX_CHOICES_PER_CALL:
        raise APIError(
            400,
            f"One request may ask for at most {MAX_CHOICES_PER_CALL} completions (prompts × n); "
            f"this one asks for {len(call.prompts) * sampling.n}.",
            param=call.prompt_param,
        )
    inputs = await prompts_with_images(
        call.prompts, info=info, model=entry.name, known=intake.images, run=intake.in_thread
    )
    # A prompt that cannot fit is refused where it is tokenized (PromptRoom), as validation
    # below would refuse it, without its ids coming back.
    room = PromptRoom(info.context_length, sampling.max_tokens or 1, call.prompt_param)
    prompts = [await _render(intake, entry.name, p, call.prompt_param, room) for p in inputs]
    images = [
        tuple(
            PromptImage.of(data, count)
            for data, count in zip(given.images, rendered.image_tokens, strict=True)
        )
        for given, rendered in zip(inputs, prompts, strict=True)
    ]
    parsing = output_parsing(call, entry, info, prompts[0].tail_text) if call.parse_output else None
    if parsing is not None and parsing.markers:
        sampling = dataclasses.replace(sampling, keep_special_tokens=parsing.markers)
    if call.require_tool_call:
        grammar = await intake.in_thread(_tool_grammar, call, sampling, parsing, info)
        sampling = dataclasses.replace(sampling, grammar=grammar)
    scope = prefix_cache_scope(api_key=api_key, entry=entry, salt=call.cache_salt)
    sized = Sizing(
        request_id, entry.name, prompts, sampling, size_limit, info, scope, service, images
    )
    requests = sized.requests()
    for request in requests:
        try:
            validate_generation(request, info, prompt_param=call.prompt_param)
        except InvalidRequestError as exc:
            raise APIError(400, str(exc), param=call.name(exc.param), code=exc.code) from None
    prompt_texts = None
    if call.echo:
        prompt_texts = [
            prompt.text
            if prompt.text is not None
            else await _detokenize(entry.name, list(rendered.token_ids))
            for prompt, rendered in zip(call.prompts, prompts, strict=True)
        ]
    reserved = sized.reserved_tokens(requests)
    settlement = await intake.reserve(
        model=entry.name,
        reserved_tokens=reserved,
        min_tokens=sized.least_tokens if sized.flexible else None,
        service_tier=service.tier,
        images=sum(len(given.images) for given in inputs),
    )
    if settlement.granted_tokens < reserved:
        requests = sized.requests(granted=settlement.granted_tokens)
    execution = Execution(settlement, requests, param_name=call.name)
    await execution.start()
    return Generation(execution, entry, prompt_texts, parsing)


def _tool_grammar(
    call: GenerationCall, sampling: SamplingParams, parsing: OutputParsing | None, info: ModelInfo
) -> str:
    """The grammar that makes the reply a call of one of the call's tools."""
    parser = parsing.tool_parser if parsing is not None else ""
    if not parser:
        raise APIError(
            400,
            f"tool_choice requires a tool call, but the model '{info.name}' has no tool-call "
            "parser (its chat template shows no tool syntax and the registry names none).",
            param="tool_choice",
        )
    if sampling.grammar is not None:
        raise APIError(
            400,
            "tool_choice 'required' or a named function cannot be combined with structured "
            "output (response_format / structured_outputs).",
            param="tool_choice",
        )
    grammar = tool_call_grammar(
        parser, call.tools or (), parallel=call.parallel_tool_calls, added_tokens=info.added_tokens
    )
    if grammar is None:
        raise APIError(
            400,
            f"tool_choice requires a tool call, which cannot be enforced for the '{parser}' "
            "tool-call syntax; use tool_choice 'auto'.",
            param="tool_choice",
        )
    return grammar


async def prompt_token_count(*, intake: Intake, call: GenerationCall) -> int:
    """How many tokens `call`'s (one) prompt renders to for its model: nothing is generated or
    reserved, but the request spent its key's limits like any other (`intake`)."""
    entry = await intake.model_entry(name=call.model, kind=ModelEntry.Kind.CHAT)
    info = await _serving_model(entry)
    (prompt,) = await prompts_with_images(
        call.prompts[:1], info=info, model=entry.name, known=intake.images, run=intake.in_thread
    )
    rendered = await _render(intake, entry.name, prompt, call.prompt_param)
    return len(rendered.token_ids)


def model_parsers(entry: ModelEntry, info: ModelInfo) -> tuple[str, str]:
    """The model's (tool-call, reasoning) parser names: the registry's, else detected from its
    chat template. A harmony model's replies are always read by the harmony parser (its
    channels are special tokens the text leaves out)."""
    tool = entry.tool_parser or detect_tool_parser(info.chat_template)
    reasoning = entry.reasoning_parser or detect_reasoning_parser(info.chat_template)
    if tool == "harmony" and reasoning != "harmony":
        reasoning = "harmony"
    return tool, reasoning


def output_parsing(
    call: GenerationCall, entry: ModelEntry, info: ModelInfo, prompt_tail: str
) -> OutputParsing:
    tool, reasoning = model_parsers(entry, info)
    return OutputParsing(
        tool_parser=tool if call.tools else "",
        reasoning_parser=reasoning,
        tools=tuple(dict(t) for t in call.tools or ()),
        parallel_tool_calls=call.parallel_tool_calls,
        prompt_tail=prompt_tail,
        model_path=entry.path,
    )


async def _serving_model(entry: ModelEntry) -> ModelInfo:
    try:
        return await get_engine_client().serving_model(model_spec(entry))
    except ModelUnavailableError as exc:
        logger.warning("model %s: %s", entry.name, exc)
        raise model_unavailable(exc) from None
    except Exception as exc:
        if not isinstance(exc, ModelLoadError):
            logger.exception("loading model %s from %s failed", entry.name, entry.path)
        raise model_load_failed(entry) from None


async def _render(
    intake: Intake, model: str, prompt: PromptInput, param: str, room: PromptRoom | None = None
) -> RenderedPrompt:
    """The prompt rendered as one of the request's preparation jobs, stopped at the deadline
    (with `room`, refused there if it cannot fit)."""
    client = get_engine_client()
    try:
        rendered = await intake.prepare(
            lambda: client.render_prompt(
                model, prompt, timeout_s=settings.ORCHARD_RENDER_TIMEOUT_SECONDS, room=room
            )
        )
    except InvalidRequestError as exc:
        # The engine names the prompt by its kind; the endpoint knows its own field's name.
        named = param if exc.param in (None, "messages", "prompt") else exc.param
        raise APIError(400, str(exc), param=named, code=exc.code) from None
    except ModelNotLoadedError as exc:
        raise APIError(503, ERROR_RELOADING, code=exc.code) from None
    return rendered


async def _detokenize(model: str, token_ids: list[int]) -> str:
    try:
        return await get_engine_client().detokenize(model, token_ids)
    except ModelNotLoadedError as exc:
        raise APIError(503, ERROR_RELOADING, code=exc.code) from None


def _sampling(
    call: GenerationCall, entry: ModelEntry, *, key_ceiling: int | None = None
) -> tuple[SamplingParams, int | None]:
    """The caller's fields over the model's defaults (the registry validated those), and, when
    the caller left max_tokens to the server, the most it may be (the model's default, else
    the endpoint's, within the output ceilings; None: the rest of the context). max_tokens
    stays None then: the server sizes the request (`Sizing`) and admission may grant less (a
    flexible request). A max_tokens over the model's or the key's (`key_ceiling`) output
    ceiling is a 400 naming it, as OpenAI answers one over a model's limit."""
    values = {name: value for name, value in call.sampling.items() if value is not None}
    for name, kind in SAMPLING_DEFAULT_FIELDS.items():
        if name not in values and name in entry.default_sampling:
            values[name] = kind(entry.default_sampling[name])
    ceilings = [c for c in (entry.max_output_tokens, key_ceiling) if c is not None]
    ceiling = min(ceilings, default=None)
    size_limit = None
    if "max_tokens" not in values:
        default = entry.default_max_tokens or call.default_max_tokens
        size_limit = min([c for c in (default, ceiling) if c is not None], default=None)
    elif ceiling is not None and values["max_tokens"] > ceiling:
        param = call.name("max_tokens")
        error = (
            ERROR_OVER_MODEL_CEILING
            if ceiling == entry.max_output_tokens
            else ERROR_OVER_KEY_CEILING
        )
        raise APIError(
            400,
            error.format(
                param=param, asked=values["max_tokens"], ceiling=ceiling, model=entry.name
            ),
            param=param,
            code="invalid_value",
        )
    return SamplingParams(**values), size_limit
