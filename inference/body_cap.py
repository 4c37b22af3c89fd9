"""The request body cap, in front of Django: a body over its route's cap is answered 413 before
authentication and before Django reads or parses a byte of it.

Django's ASGI handler reads a whole body before it runs a view (which then authenticates and
parses it), so without a cap one team's oversized bodies cost every request sharing the process.
`BodyCapMiddleware` refuses at once a request whose Content-Length is over the cap (one within
it goes to Django untouched: the server reads exactly that many bytes); a chunked body has no
Content-Length, so its bytes are counted as they arrive, kept in a temporary file past its first
MiB (never a whole upload in memory), and refused as soon as they pass the cap. Either way a
refusal stops receiving, answers (with `Connection: close`) and returns: the rest of the body is
never asked for.

The answer has the route's shape: OpenAI's error body on /v1, Anthropic's on /v1/messages
(inference/errors.py), a plain 413 elsewhere (the pages and the admin, whose form fields Django
also checks against DATA_UPLOAD_MAX_MEMORY_SIZE).

Daphne (Twisted) receives a whole request, spooling a large body to a temporary file, before any
application sees it; in daphne's process a body whose Content-Length is over its route's cap is
dropped as it arrives instead (common/daphne_requests.py, with `cap_for`), but its bytes are
still read: the network side of a huge upload is the reverse proxy's to stop
(`client_max_body_size`, docs/deploying.md); a server that streams bodies to the application
(uvicorn, hypercorn) stops reading at the cap.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Awaitable, Callable, Mapping
from typing import IO, Any

from django.http import HttpResponse

from inference.errors import APIError, error_response_for
from inference.middleware import API_PREFIX, new_request_id

logger = logging.getLogger(__name__)

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[dict[str, Any], Receive, Send], Awaitable[None]]

ERROR_TOO_LARGE = "The request body is larger than the {cap} bytes this endpoint accepts."
CODE_TOO_LARGE = "request_too_large"
SPOOL_BYTES = 1 << 20  # a counted body past this goes to a temporary file
REPLAY_CHUNK_BYTES = 1 << 16


class BodyCapMiddleware:
    """`app` behind a cap on request bodies: `max_bytes`, or `route_max_bytes[path]` for the
    paths named there."""

    def __init__(
        self, app: ASGIApp, *, max_bytes: int, route_max_bytes: Mapping[str, int] | None = None
    ):
        self.app = app
        self.max_bytes = max_bytes
        self.route_max_bytes = dict(route_max_bytes or {})

    def cap_for(self, path: str) -> int:
        return self.route_max_bytes.get(path, self.max_bytes)

    async def __call__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cap = self.cap_for(scope["path"])
        declared = _content_length(scope)
        if declared is not None:
            if declared > cap:
                await _refuse(scope, send, cap, f"a Content-Length of {declared}")
            else:  # the server reads exactly that many bytes: nothing to count
                await self.app(scope, receive, send)
            return
        # A body without a length (chunked): counted as it arrives, kept in a file past the
        # first MiB (a large upload never sits in memory), then handed on.
        with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as body:
            size = 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # http.disconnect: the client left before its body came
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > cap:
                    await _refuse(scope, send, cap, f"more than {cap} bytes")
                    return
                body.write(chunk)
                if not message.get("more_body", False):
                    break
            body.seek(0)
            await self.app(scope, _replaying(body, size, receive), send)


def _replaying(body: IO[bytes], size: int, receive: Receive) -> Receive:
    """`receive` that first gives back the body (`size` bytes) in chunks, then whatever the
    server sends next (a disconnect)."""
    given, finished = 0, False

    async def replay() -> Message:
        nonlocal given, finished
        if finished:
            return await receive()
        chunk = body.read(REPLAY_CHUNK_BYTES)
        given += len(chunk)
        finished = given >= size
        return {"type": "http.request", "body": chunk, "more_body": not finished}

    return replay


def _content_length(scope: dict[str, Any]) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":  # ASGI header names are lowercase
            try:
                return int(value)
            except ValueError:
                return None  # the server refuses it (daphne, uvicorn); the count still applies
    return None


async def _refuse(scope: dict[str, Any], send: Send, cap: int, seen: str) -> None:
    path = scope["path"]
    logger.info("refused a request body on %s: %s, over the cap of %d", path, seen, cap)
    message = ERROR_TOO_LARGE.format(cap=cap)
    if path.startswith(API_PREFIX):
        response = error_response_for(path, APIError(413, message, code=CODE_TOO_LARGE))
        response["x-request-id"] = new_request_id()
    else:
        response = HttpResponse(message, status=413, content_type="text/plain; charset=utf-8")
    response["Content-Length"] = str(len(response.content))
    response["Connection"] = "close"  # what is left of the body is never read
    headers = [
        (name.lower().encode("latin-1"), v.encode("latin-1")) for name, v in response.items()
    ]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": response.content})
