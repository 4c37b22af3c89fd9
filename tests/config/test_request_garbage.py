"""A request leaves no reference cycle behind in the web process.

What a cycle holds waits for Python's cyclic garbage collector, whose full collections walk the
heap with the interpreter lock held; under one team's flood of requests, every team's requests
waited for them (bench/isolation.py). The requests go through the /v1 routes' own handler
(config/handlers.py: Django with the API's middleware) as daphne drives it, in this process
(config.asgi itself would start the pull and batch runners here), with the collector saving what
it finds (DEBUG_SAVEALL) instead of freeing it: a request whose objects reach `gc.garbage` was
only ever freed by a collection.
"""

import asyncio
import gc
import json
import types

import pytest
from django.core.handlers.asgi import ASGIRequest
from django.db import connections

from inference.services.prework import FairGate
from tests.factories import api_key_with_raw


def call(
    app,
    method: str,
    path: str,
    *,
    key: str | None = None,
    body: bytes = b"",
    header: bytes = b"authorization",
) -> int:
    """One request through `app` as daphne makes it: the body, then `http.disconnect` once the
    response is sent (daphne says the client is gone when the request is finished). Returns
    the status."""
    headers = [(b"content-type", b"application/json")]
    if key is not None:
        value = f"Bearer {key}" if header == b"authorization" else key
        headers.append((header, value.encode()))
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [*headers, (b"content-length", str(len(body)).encode())],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    statuses = []

    async def run() -> None:
        done = asyncio.Event()
        sent_body = False

        async def receive():
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await done.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
            elif not message.get("more_body"):
                done.set()

        await app(scope, receive, send)

    asyncio.run(run())
    return statuses[0]


@pytest.fixture
def saved_garbage():
    """`gc.garbage` gets everything the collector finds from here on."""
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.garbage.clear()
    yield gc.garbage
    gc.set_debug(0)
    gc.garbage.clear()


def requests_in(garbage: list) -> list:
    """The requests, frames and tracebacks the collector found (a refusal's cycle runs through
    its error's traceback and frames, whether or not it reaches the request)."""
    gc.collect()
    return [
        thing
        for thing in garbage
        if isinstance(thing, ASGIRequest | types.FrameType | types.TracebackType)
    ]


class Engines:
    """No engine in this process: /v1/models asks only for the models' states."""

    def model_status(self, name):
        raise AssertionError("no model is registered")


@pytest.mark.django_db(transaction=True)
def test_answered_and_refused_api_requests_leave_no_cycle(saved_garbage, monkeypatch):
    from config.handlers import KeyedAPIHandler
    from inference.services import catalog

    monkeypatch.setattr(catalog, "get_engine_client", Engines)
    application = KeyedAPIHandler()
    _, key = api_key_with_raw()
    try:
        statuses = [
            call(application, "GET", "/v1/models", key=key),  # answered
            call(application, "GET", "/v1/models", key="sk-made-up"),  # refused: 401
            # refused by the view's own check: 400
            call(application, "POST", "/v1/chat/completions", key=key, body=b"{not json"),
            call(
                application,
                "POST",
                "/v1/chat/completions",
                key=key,
                body=json.dumps({"model": "no-such-model", "messages": []}).encode(),
            ),
            # Anthropic's route, its key in x-api-key: 401 in its shape
            call(application, "POST", "/v1/messages", key="sk-made-up", header=b"x-api-key"),
        ]
        assert statuses[0] == 200
        assert all(status >= 400 for status in statuses[1:])
        assert requests_in(saved_garbage) == []
    finally:
        connections.close_all()


def test_a_failed_preparation_job_leaves_no_cycle(saved_garbage):
    """The fair gate's failed job: its error, raised to the caller, must not keep the gate's
    frame (and with it the job's task, which holds the error and the job's input)."""

    class Refused(Exception):
        pass

    async def job():
        raise Refused("too long")

    async def run() -> None:
        gate = FairGate(workers=2, per_team=1, queue_per_team=4)
        for _ in range(3):
            with pytest.raises(Refused):
                await gate.run("team-a", job)

    asyncio.run(run())
    gc.collect()
    frames = [
        thing
        for thing in saved_garbage
        if type(thing).__name__ == "frame" and thing.f_code.co_filename.endswith("prework.py")
    ]
    assert frames == []


@pytest.mark.parametrize("valid", [True, False])
def test_a_validated_body_leaves_no_cycle(saved_garbage, valid):
    """DRF's fields point back at their serializer: the tree is let go of once the data is
    out, whether the body was valid or not."""
    from rest_framework import serializers

    from inference.api.bodies import validate
    from inference.api.serializers import ChatCompletionSerializer
    from inference.errors import APIError

    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
        "stop": ["x"],
    }
    if not valid:
        body["temperature"] = "hot"
    for _ in range(3):
        try:
            validate(ChatCompletionSerializer, body)
        except APIError:
            assert not valid
    gc.collect()
    fields = [thing for thing in saved_garbage if isinstance(thing, serializers.Field)]
    assert fields == []
