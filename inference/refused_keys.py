"""Keys over their requests-per-minute limit, refused in front of Django.

A key that floods the server past its rpm is refused by the limiter, but each refusal still
costs a request's way through Django: authentication (a query), the limiter, the thread hops.
A flood of them from one team then queues every other team's requests behind it. So while a
refusal of the key is held (inference/services/held_refusals.py: at most a second, never past
the rpm window's retry time), a request of that key on a route where it was refused is answered
here, at the ASGI level, a quarter of a second later (ANSWER_AFTER_S: a client that ignores
`retry-after` then sends a few requests a second per connection, not hundreds): the same 429
(OpenAI's shape, or Anthropic's on its routes), its headers, `retry-after` counting down,
counted as a refusal like any other (the metric and the day's roll-up). Nothing about the key
is trusted that the database did not say within the hold: a key revoked meanwhile gets its 401
once the hold ends, and an admin's raised limit applies then.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from accounts import keys
from inference.errors import ANTHROPIC_PREFIX, APIError, error_response_for
from inference.middleware import new_request_id
from inference.services import metrics
from inference.services.held_refusals import Refusal, refused_keys
from inference.services.refusals import refusals

ANSWER_AFTER_S = 0.25
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def _raw_key(scope: Scope) -> str | None:
    """The key the view would authenticate (inference/api/common.py `authenticate`): the
    `x-api-key` header first on Anthropic's routes, else `Authorization: Bearer`."""
    headers = dict(scope.get("headers", ()))
    x_api_key = headers.get(b"x-api-key") if scope["path"].startswith(ANTHROPIC_PREFIX) else None
    return keys.presented_key(
        headers.get(b"authorization", b"").decode("latin-1"),
        x_api_key.decode("latin-1") if x_api_key else None,
    )


class RefusedKeyMiddleware:
    """ASGI: a request of a key whose rpm refusal is held gets that 429 here (see the module
    docstring); every other request goes on to `app`."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            raw_key = _raw_key(scope)
            held = refused_keys.held(raw_key, scope["path"]) if raw_key else None
            if held is not None:
                await self._refuse(scope, send, *held)
                return
        await self.app(scope, receive, send)

    async def _refuse(self, scope: Scope, send: Send, refusal: Refusal, endpoint: str) -> None:
        metrics.request_rejected(endpoint=endpoint, model="", reason=refusal.code)
        refusals.count(refusal.api_key, "")
        # Holding nothing but the connection meanwhile.
        await asyncio.sleep(max(0.0, min(ANSWER_AFTER_S, refusal.retry_at - time.monotonic())))
        retry_ms = max(0, math.ceil((refusal.retry_at - time.monotonic()) * 1000))
        headers = {
            **refusal.headers,
            "retry-after-ms": str(retry_ms),
            "retry-after": str(max(1, math.ceil(retry_ms / 1000))),
        }
        response = error_response_for(
            scope["path"], APIError(429, refusal.message, code=refusal.code, headers=headers)
        )
        response["x-request-id"] = new_request_id()
        response["X-Content-Type-Options"] = "nosniff"
        response["Content-Length"] = str(len(response.content))
        await send(
            {
                "type": "http.response.start",
                "status": 429,
                "headers": [
                    (name.lower().encode("latin-1"), value.encode("latin-1"))
                    for name, value in response.items()
                ],
            }
        )
        await send({"type": "http.response.body", "body": response.content})
