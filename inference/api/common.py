"""What every /v1 endpoint shares before and after the generation service: the key and the
request's intake, the body and its serializer (read off the event loop), and the response
objects (JSON, or an SSE stream that always ends)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.http import HttpRequest, JsonResponse, StreamingHttpResponse
from rest_framework import serializers

from accounts import keys
from accounts.authentication import AuthenticationError, authenticate_header
from accounts.models import ApiKey
from inference import body_rate
from inference.api import preflight
from inference.api.bodies import check_body_bytes, parse_json, request_body
from inference.errors import APIError
from inference.services.admission import Intake, request_intake
from inference.services.output import GenerationFailed

logger = logging.getLogger(__name__)

ERROR_STREAM_FAILED = "The server had an error while streaming this response."
T = TypeVar("T")


async def authenticate(request: HttpRequest, *, x_api_key: bool = False) -> ApiKey:
    """The request's key from `Authorization: Bearer` (or, with `x_api_key`, from `x-api-key`
    as Anthropic's clients send it)."""
    header = request.headers.get("Authorization")
    if x_api_key and request.headers.get("x-api-key"):
        header = f"Bearer {request.headers['x-api-key']}"
    raw_key = keys.presented_key(header)
    try:
        api_key = await sync_to_async(authenticate_header)(header)
    except AuthenticationError as exc:
        if raw_key:
            body_rate.known_keys.forget(raw_key)
        raise APIError(401, exc.message, code=exc.code) from None
    if raw_key:  # its bodies are paced as its team's from now on (inference/body_rate.py)
        body_rate.known_keys.remember(raw_key, api_key.team_id)
    request.orchard_api_key = api_key  # for the middleware's x-ratelimit-* headers
    return api_key


@contextlib.asynccontextmanager
async def intake_for(
    request: HttpRequest, endpoint: str, *, x_api_key: bool = False
) -> AsyncIterator[Intake]:
    """The request's key, and its intake: the key's limits spent before the body is read (a
    429 here costs nothing), the slot given back when the block ends unless the request was
    admitted (inference/services/admission.py)."""
    api_key = await authenticate(request, x_api_key=x_api_key)
    async with request_intake(
        api_key=api_key,
        request_id=request.orchard_request_id,
        endpoint=endpoint,
        path=request.path,
    ) as intake:
        yield intake


def read_body(
    request: HttpRequest,
    serializer_class: type[serializers.Serializer],
    build: Callable[[dict[str, Any]], T] | None = None,
) -> tuple[dict[str, Any], T | None]:
    """The body parsed, validated by `serializer_class`, and what `build` makes of it (an
    endpoint's call, with its grammar): work that grows with the body, for `Intake.in_thread`."""
    return check_body_bytes(request_body(request), serializer_class, build)


async def read_body_in(
    intake: Intake,
    request: HttpRequest,
    serializer_class: type[serializers.Serializer],
    build: Callable[[dict[str, Any]], T] | None = None,
    *,
    preflight_build: Callable[[dict[str, Any]], Any] | None = None,
) -> tuple[dict[str, Any], T | None]:
    """`read_body` as a job of the intake's team; a large body is read and checked in a
    preflight process instead (inference/api/preflight.py), with `preflight_build` in place
    of `build` there where that needs more than the body (the database), and only built
    here."""
    body = request_body(request)
    if preflight.needed(body):
        data = await preflight.preflight(intake, body, serializer_class, preflight_build or build)
        if data is not None:
            return data, None if build is None else await intake.in_thread(build, data)
    return await intake.in_thread(read_body, request, serializer_class, build)


def parse_json_body(request: HttpRequest) -> dict[str, Any]:
    return parse_json(request_body(request))


def json_response(body: dict[str, Any], headers: dict[str, str]) -> JsonResponse:
    response = JsonResponse(body)
    for name, value in headers.items():
        response[name] = value
    return response


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def typed_sse(event: dict[str, Any]) -> bytes:
    """An event named by its `type` (`event:` then `data:`), as the Responses and Anthropic
    streams send them."""
    data = json.dumps(event, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


def error_event(message: str) -> bytes:
    return sse({"error": {"message": message, "type": "server_error", "param": None, "code": None}})


async def ending_stream(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """`events`, then the end of the response, whatever happens: a failed generation or any
    error part-way is one error event and a closed response, never a hang (the usage row and
    the engine are settled by the generation itself)."""
    try:
        async with contextlib.aclosing(events):
            async for event in events:
                yield event
    except asyncio.CancelledError:
        raise
    except GenerationFailed as exc:
        yield error_event(exc.message)
    except Exception:
        logger.exception("a streamed response failed part-way")
        yield error_event(ERROR_STREAM_FAILED)


class ClosingStreamingResponse(StreamingHttpResponse):
    """Closes its iterator when Django stops reading it. Django closes only the generator it
    iterates (`__aiter__`); a client that leaves while a chunk is being sent would otherwise
    leave the stream's own generators to the garbage collector, which closes each of them
    at once and in no order, so an outer one's close finds an inner one already closing
    ("aclose(): asynchronous generator is already running")."""

    async def __aiter__(self):
        async with contextlib.aclosing(self._iterator) as parts:
            async for part in parts:
                yield self.make_bytes(part)


def streaming_response(events: AsyncIterator[bytes], headers: dict[str, str]):
    response = ClosingStreamingResponse(ending_stream(events), content_type="text/event-stream")
    response["Cache-Control"] = "no-cache"
    response["X-Accel-Buffering"] = "no"
    for name, value in headers.items():
        response[name] = value
    return response
