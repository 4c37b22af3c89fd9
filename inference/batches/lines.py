"""A batch's request lines: read and checked up front as their endpoint checks a request, and
run through the same code as the endpoint's own view (the view's non-streamed half).

`LinesReader` turns an input file into `ParsedLine`s, or file-level errors that fail the whole
batch in `validating` (a line that is not JSON, has no custom_id, names another endpoint, a
duplicate custom_id, ...). A line whose body its endpoint would refuse (a field out of range,
a model the key may not use, `stream`) is parsed but refused at once: it goes to the error
file with the endpoint's own status and error body and never runs. `line_run` runs one line
for its key with the key's budgets and answers (status code, body).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from rest_framework import serializers

from accounts.models import ApiKey
from inference.api.bodies import validate
from inference.api.chat import chat_call, chat_completion_object
from inference.api.completions import completion_call, text_completion_object
from inference.api.embeddings import EmbeddingsSerializer, embeddings_object
from inference.api.responses.serializers import ResponseCreateSerializer
from inference.api.responses.views import response_completed, response_created, response_items
from inference.api.serializers import ChatCompletionSerializer, CompletionSerializer
from inference.errors import APIError, model_not_found
from inference.models import ModelEntry
from inference.services.admission import ERROR_WRONG_KIND, Intake, batch_line_intake
from inference.services.generation import generation_start
from inference.services.registry import model_for_key

ERROR_STREAM = "Batch requests are not streamed; remove 'stream' from the line's body."
MAX_CUSTOM_ID = 512


@dataclass(frozen=True)
class LineEndpoint:
    """How a batch runs lines of one endpoint: its body's serializer, the check its view makes
    past the serializer (building its call), and the view's non-streamed answer."""

    url: str
    name: str  # the endpoint as usage rows and metrics name it
    kind: str  # the kind of model it serves
    serializer: type[serializers.Serializer]
    check: Callable[[dict[str, Any]], Any]
    answer: Callable[[Intake, dict[str, Any]], Awaitable[dict[str, Any]]]


async def _chat(intake: Intake, data: dict[str, Any]) -> dict[str, Any]:
    generation = await generation_start(intake=intake, call=await intake.in_thread(chat_call, data))
    return await chat_completion_object(
        generation, data, completion_id=_completion_id("chatcmpl", intake), created=_now()
    )


async def _completion(intake: Intake, data: dict[str, Any]) -> dict[str, Any]:
    call = await intake.in_thread(completion_call, data)
    generation = await generation_start(intake=intake, call=call)
    return await text_completion_object(
        generation, data, completion_id=_completion_id("cmpl", intake), created=_now()
    )


async def _embeddings(intake: Intake, data: dict[str, Any]) -> dict[str, Any]:
    body, _ = await embeddings_object(intake, data)
    return body


async def _response(intake: Intake, data: dict[str, Any]) -> dict[str, Any]:
    items = await intake.in_thread(response_items, data)
    return await response_completed(await response_created(intake, data, items))


def _completion_id(prefix: str, intake: Intake) -> str:
    return f"{prefix}-{intake.request_id.removeprefix('batch_req_')}"


def _now() -> int:
    return int(time.time())


ENDPOINTS = {
    e.url: e
    for e in (
        LineEndpoint(
            "/v1/chat/completions",
            "chat.completions",
            ModelEntry.Kind.CHAT,
            ChatCompletionSerializer,
            chat_call,
            _chat,
        ),
        LineEndpoint(
            "/v1/completions",
            "completions",
            ModelEntry.Kind.CHAT,
            CompletionSerializer,
            completion_call,
            _completion,
        ),
        LineEndpoint(
            "/v1/embeddings",
            "embeddings",
            ModelEntry.Kind.EMBEDDING,
            EmbeddingsSerializer,
            lambda data: None,
            _embeddings,
        ),
        LineEndpoint(
            "/v1/responses",
            "responses",
            ModelEntry.Kind.CHAT,
            ResponseCreateSerializer,
            response_items,
            _response,
        ),
    )
}


@dataclass(frozen=True)
class FileError:
    """A fault of the input file that fails the batch (OpenAI's `errors.data` entry)."""

    code: str
    message: str
    line: int | None = None  # 1-based, as OpenAI counts
    param: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class ParsedLine:
    index: int
    custom_id: str
    body: dict[str, Any]
    model: str
    refusal: APIError | None = None  # the endpoint's answer, for a line that does not run


class LinesReader:
    """Parse and check an input file's lines for `endpoint` (see the module docstring), one at a
    time: `read` yields the lines (so a large file is never held whole), then `errors` holds
    the file's faults (any fault fails the batch: what was yielded is then dropped). Reads the
    database (the key's models): use it off the event loop."""

    def __init__(self, *, api_key: ApiKey, endpoint: str, max_lines: int) -> None:
        self.api_key = api_key
        self.endpoint = endpoint
        self.spec = ENDPOINTS[endpoint]
        self.max_lines = max_lines
        self.errors: list[FileError] = []
        self.num_lines = 0
        self.models: set[str] = set()  # named by the lines that run
        self._seen: set[str] = set()
        self._model_refusals: dict[str, APIError | None] = {}

    def read(self, lines: Iterable[bytes]) -> Iterator[ParsedLine]:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            if self.num_lines >= self.max_lines:
                message = f"A batch may hold at most {self.max_lines:,} requests."
                self.errors.append(FileError("too_many_requests", message, line=number))
                break
            line, error = _line(raw, number, self.endpoint, self._seen)
            if error is not None:
                self.errors.append(error)
                if len(self.errors) >= 100:  # enough to act on; the rest would repeat them
                    break
                continue
            custom_id, body = line
            self._seen.add(custom_id)
            model = body.get("model") if isinstance(body.get("model"), str) else ""
            refusal = _refusal(self.api_key, self.spec, body, self._model_refusals)
            if refusal is None:
                self.models.add(model)
            yield ParsedLine(self.num_lines, custom_id, body, model, refusal)
            self.num_lines += 1
        self._file_errors()

    def _file_errors(self) -> None:
        if not self.num_lines and not self.errors:
            self.errors.append(FileError("empty_file", "The input file holds no requests."))
        # One model per batch, as OpenAI's; a line its endpoint refuses (a model the key may
        # not use, say) is answered in the error file instead.
        if len(self.models) > 1:
            named = ", ".join(f"'{name}'" for name in sorted(self.models)[:5])
            message = (
                f"The requests of a batch must all name the same model; this file names {named}."
            )
            self.errors.append(FileError("mismatched_model", message, param="body.model"))


def _line(
    raw: bytes, number: int, endpoint: str, seen: set[str]
) -> tuple[tuple[str, dict] | None, FileError | None]:
    try:
        line = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None, FileError("invalid_json_line", "This line is not valid JSON.", number)
    if not isinstance(line, dict):
        return None, FileError("invalid_json_line", "This line is not a JSON object.", number)
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID:
        message = f"custom_id must be a non-empty string of at most {MAX_CUSTOM_ID} characters."
        return None, FileError("invalid_custom_id", message, number, "custom_id")
    if custom_id in seen:
        message = f"The custom_id '{custom_id}' is used by an earlier line; each must be unique."
        return None, FileError("duplicate_custom_id", message, number, "custom_id")
    if line.get("method") != "POST":
        return None, FileError("invalid_method", "method must be 'POST'.", number, "method")
    if line.get("url") != endpoint:
        message = f"This batch's endpoint is {endpoint}; the line's url must be the same."
        return None, FileError("mismatched_endpoint", message, number, "url")
    body = line.get("body")
    if not isinstance(body, dict):
        return None, FileError("invalid_body", "body must be a JSON object.", number, "body")
    return (custom_id, body), None


def _refusal(
    api_key: ApiKey, spec: LineEndpoint, body: dict, models: dict[str, APIError | None]
) -> APIError | None:
    """What the endpoint would answer this body before running it, or None when it would run."""
    try:
        if body.get("stream"):
            raise APIError(400, ERROR_STREAM, param="stream")
        data = validate(spec.serializer, body)
        spec.check(data)
        name = data["model"]
        if name not in models:
            models[name] = _model_refusal(api_key, spec, name)
        if models[name] is not None:
            raise models[name]
    except APIError as exc:
        return exc
    return None


def _model_refusal(api_key: ApiKey, spec: LineEndpoint, name: str) -> APIError | None:
    entry = model_for_key(api_key, name)
    if entry is None:
        return model_not_found(name)
    if entry.kind != spec.kind:
        return APIError(400, ERROR_WRONG_KIND[spec.kind].format(name=entry.name), param="model")
    return None


async def line_run(
    *, api_key: ApiKey, batch_id: str, endpoint: str, request_id: str, body: dict[str, Any]
) -> tuple[int, dict[str, Any]]:
    """Run one line as its endpoint would (with the key's budgets, in the batch tier): its
    status code and body (the endpoint's error body for an APIError). Other exceptions, and
    cancellation, propagate."""
    spec = ENDPOINTS[endpoint]
    try:
        async with batch_line_intake(
            api_key=api_key, request_id=request_id, endpoint=spec.name, batch_id=batch_id
        ) as intake:
            data = await intake.in_thread(validate, spec.serializer, body)
            return 200, await spec.answer(intake, data)
    except APIError as exc:
        return exc.status, exc.body()
