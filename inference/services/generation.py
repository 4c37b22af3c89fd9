"""The one generation path under every generating /v1 endpoint.

An endpoint reads its body into a `GenerationCall` (which model, which prompts, the sampling
fields the caller set) and calls `generation_start`; everything between that and a running
generation happens here, once, in this order:

1. the model: one this key may use (404 otherwise) and the engine serving it (never waiting for
   a reload; 503 if it cannot load);
2. the limits that need no token count (rpm, parallel slots, an exhausted budget or tpm
   window): a refused request costs no template render;
3. rendering (chat template under a time limit, or the tokenizer);
4. the sampling parameters: the caller's fields over the model's registry defaults, max_tokens
   resolved against the context;
5. validation, once, by `engine.protocol.validate_generation` (token ids, ranges, context);
6. admission (reserving tokens, fewer when the caller left max_tokens to the server), the usage
   row and the engine streams (`Execution`).

What comes back is a `Generation`: its `deltas()` run each choice through the output stage
(inference/services/output.py), and the endpoint only formats them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings

from accounts import limits
from accounts.models import ApiKey
from engine.protocol import (
    GenerationRequest,
    InvalidRequestError,
    ModelInfo,
    ModelLoadError,
    ModelNotLoadedError,
    PromptInput,
    SamplingParams,
    validate_generation,
)
from inference.engine_access import get_engine_client
from inference.errors import APIError, model_not_found
from inference.models import SAMPLING_DEFAULT_FIELDS, ModelEntry
from inference.services.execution import Execution, admission_refused
from inference.services.output import ChoiceDelta, GenerationFailed, choice_stages
from inference.services.registry import model_for_key, model_spec

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenerationCall:
    """What an endpoint asks for, read from its body.

    `sampling` holds `SamplingParams` fields the caller set (None or absent: not set, so the
    model's registry default or the engine's applies); `max_tokens` absent or None leaves the
    size to the server (`default_max_tokens`, else the rest of the context). `prompt_param`
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


@dataclass
class Generation:
    """A started generation: format its `deltas()` (or `collect()` them) and its `usage()`."""

    execution: Execution
    entry: ModelEntry
    prompt_texts: list[str] | None = None

    @property
    def model(self) -> str:
        return self.entry.name

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
        stages = choice_stages(self.num_choices)
        async with contextlib.aclosing(self.execution.outputs()) as outputs:
            async for item in outputs:
                yield stages[item.choice].feed(item.output)


async def generation_start(*, api_key: ApiKey, request_id: str, call: GenerationCall) -> Generation:
    """Run `call` for `api_key` (steps in the module docstring). Raises APIError for anything
    the caller can fix or should retry; nothing is reserved or left open when it does."""
    entry = await sync_to_async(model_for_key)(api_key, call.model)
    if entry is None:
        raise model_not_found(call.model)
    try:
        await limits.precheck(api_key)
    except (limits.RateLimitExceeded, limits.LimiterUnavailable) as exc:
        raise await admission_refused(
            exc, request_id=request_id, api_key=api_key, model=entry.name, endpoint=call.endpoint
        ) from None
    info = await _serving_model(entry)
    prompts = [await _render(entry.name, prompt, call.prompt_param) for prompt in call.prompts]
    sampling = _sampling(call, entry)
    requests = []
    for index, prompt_ids in enumerate(prompts):
        request = GenerationRequest(
            request_id if len(prompts) == 1 else f"{request_id}-{index}",
            entry.name,
            tuple(prompt_ids),
            _fit_to_context(sampling, len(prompt_ids), info),
        )
        try:
            validate_generation(request, info, prompt_param=call.prompt_param)
        except InvalidRequestError as exc:
            param = call.param_names.get(exc.param, exc.param)
            raise APIError(400, str(exc), param=param, code=exc.code) from None
        requests.append(request)
    prompt_texts = None
    if call.echo:
        prompt_texts = [
            prompt.text if prompt.text is not None else await _detokenize(entry.name, ids)
            for prompt, ids in zip(call.prompts, prompts, strict=True)
        ]
    execution = Execution(
        api_key=api_key,
        model=entry.name,
        endpoint=call.endpoint,
        request_id=request_id,
        requests=requests,
        flexible=sampling.max_tokens is None,
    )
    await execution.start()
    return Generation(execution, entry, prompt_texts)


async def _serving_model(entry: ModelEntry) -> ModelInfo:
    try:
        return await get_engine_client().serving_model(model_spec(entry))
    except Exception as exc:
        if not isinstance(exc, ModelLoadError):
            logger.exception("loading model %s from %s failed", entry.name, entry.path)
        raise APIError(
            503,
            f"The model '{entry.name}' could not be loaded; an administrator must check its "
            "registry entry.",
            code=ModelLoadError.code,
        ) from None


async def _render(model: str, prompt: PromptInput, param: str) -> list[int]:
    try:
        token_ids = await get_engine_client().render_prompt(
            model, prompt, timeout_s=settings.ORCHARD_RENDER_TIMEOUT_SECONDS
        )
    except InvalidRequestError as exc:
        # The engine names the prompt by its kind; the endpoint knows its own field's name.
        named = param if exc.param in (None, "messages", "prompt") else exc.param
        raise APIError(400, str(exc), param=named) from None
    except ModelNotLoadedError as exc:
        raise APIError(
            503, "The model is being reloaded; please retry shortly.", code=exc.code
        ) from None
    return token_ids


async def _detokenize(model: str, token_ids: list[int]) -> str:
    try:
        return await get_engine_client().detokenize(model, token_ids)
    except ModelNotLoadedError as exc:
        raise APIError(
            503, "The model is being reloaded; please retry shortly.", code=exc.code
        ) from None


def _sampling(call: GenerationCall, entry: ModelEntry) -> SamplingParams:
    """The caller's fields over the model's defaults (the registry validated those)."""
    values = {name: value for name, value in call.sampling.items() if value is not None}
    for name, kind in SAMPLING_DEFAULT_FIELDS.items():
        if name not in values and name in entry.default_sampling:
            values[name] = kind(entry.default_sampling[name])
    if "max_tokens" not in values and call.default_max_tokens is not None:
        values["max_tokens"] = call.default_max_tokens
    return SamplingParams(**values)


def _fit_to_context(sampling: SamplingParams, num_prompt: int, info: ModelInfo) -> SamplingParams:
    """A size the server decides is the rest of the context (validation reports a prompt
    that leaves none)."""
    if sampling.max_tokens is not None or info.context_length - num_prompt < 1:
        return sampling
    return SamplingParams(**{**sampling.__dict__, "max_tokens": info.context_length - num_prompt})
