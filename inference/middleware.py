"""Everything under /v1 answers in its API's shape: an `x-request-id` on every response, the
key's `x-ratelimit-*` headers on every response once the key is known (errors included), and
JSON error bodies instead of Django's HTML pages, even for unknown paths and unexpected
exceptions: OpenAI's `{"error": {...}}`, on /v1/messages Anthropic's `{"type": "error", ...}`."""

import functools
import logging
import traceback
import uuid
from collections.abc import Callable

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse, JsonResponse

from accounts import limits
from inference.errors import APIError, error_response_for

logger = logging.getLogger(__name__)
API_PREFIX = "/v1/"


def new_request_id() -> str:
    return f"req_{uuid.uuid4().hex}"


class OpenAIApiMiddleware:
    async_capable = True
    sync_capable = False

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(self.get_response):
            markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        if not request.path.startswith(API_PREFIX):
            return await self.get_response(request)
        request.orchard_request_id = new_request_id()
        response = await self.get_response(request)
        if response.status_code >= 400 and not isinstance(response, JsonResponse):
            allow = response.get("Allow")
            response = error_response_for(request.path, _error_for_status(response.status_code))
            if allow:
                response["Allow"] = allow
        response["x-request-id"] = request.orchard_request_id
        response["X-Content-Type-Options"] = "nosniff"
        api_key = getattr(request, "orchard_api_key", None)
        if api_key is not None and not any(
            name.lower().startswith("x-ratelimit-") for name in response.headers
        ):
            # Responses that did not go through admission (errors, /v1/models) show the key's
            # current standing; generated ones already carry what admission computed.
            try:
                headers = await limits.current_headers(api_key)
            except limits.LimiterUnavailable as exc:
                logger.warning("no x-ratelimit-* headers: %s", exc)
                headers = {}
            for name, value in headers.items():
                response[name] = value
        return response

    def process_exception(self, request: HttpRequest, exception: Exception) -> HttpResponse | None:
        if not request.path.startswith(API_PREFIX):
            return None
        if isinstance(exception, APIError):
            return error_response_for(request.path, exception)
        logger.exception("Unhandled error in %s", request.path)
        return error_response_for(
            request.path, APIError(500, "The server had an error processing your request.")
        )


# Views already wrapped by `answering_errors` (Django asks for each request's).
_answering: dict[Callable, Callable] = {}


def answering_errors(view: Callable) -> Callable:
    """An async view whose APIError is answered where it is raised, on the event loop.

    Raised to Django, it would be answered by `OpenAIApiMiddleware.process_exception`, which
    Django calls through `sync_to_async` from inside its `except`: asgiref hands the error to
    the thread (its `thread_handler` raises it again there), so the error's traceback holds a
    frame that holds the error. That cycle, with the request and everything its frames hold
    (a refused prompt's text too), is left for the garbage collector, whose full collections
    walk the heap with the interpreter lock held: under one team's flood of refusals, every
    team's requests waited for them (bench/isolation.py). And each refusal cost a hop to a
    thread and back. Answered here, the error's frames are cleared too (`_let_go`)."""
    if not iscoroutinefunction(view):
        return view
    answered = _answering.get(view)
    if answered is None:

        @functools.wraps(view)
        async def answered(request: HttpRequest, *args, **kwargs) -> HttpResponse:
            try:
                return await view(request, *args, **kwargs)
            except APIError as exc:
                _let_go(exc)
                return error_response_for(request.path, exc)

        answered = _answering.setdefault(view, answered)
    return answered


def _let_go(error: BaseException) -> None:
    """Clear the finished frames of `error`'s tracebacks, and of the errors it was raised from
    or during: a frame that holds, in a local, the future or task that holds the error (asyncio's
    and asgiref's own `sync_to_async` do) is a cycle through the error's traceback, and the
    frames hold the request. Nothing reads these tracebacks once the error is answered."""
    seen: set[int] = set()
    pending = [error]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        pending += [error.__cause__, error.__context__]


def _error_for_status(status: int) -> APIError:
    if status == 404:
        return APIError(404, "Unknown request URL. Please check the URL and method.")
    if status == 405:
        return APIError(405, "Method not allowed for this URL.")
    if status == 413:
        return APIError(413, "Request body too large.")
    if status < 500:
        return APIError(status, "Bad request.")
    return APIError(500, "The server had an error processing your request.")
