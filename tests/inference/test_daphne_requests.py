"""Daphne's side of the body cap (common/daphne_requests.py), on Twisted's own HTTP channel fed
raw bytes: a body over its route's cap is dropped as it arrives (only its size is kept, for the
413 the cap answers from the headers), one within it is kept whole, and no POST body is parsed
into Twisted's `args` (a multipart upload would be read into memory and parsed on the event
loop). Over real HTTP the 413s are tests/inference/test_body_cap.py's."""

from types import SimpleNamespace

import pytest
from daphne import http_protocol
from django.conf import settings
from django.core.handlers.asgi import ASGIHandler
from twisted.internet.testing import StringTransport
from twisted.web.http import HTTPChannel

from common import daphne_requests
from common.daphne_requests import DroppedBody
from inference.body_cap import BodyCapMiddleware

CAP = settings.ORCHARD_MAX_BODY_BYTES
SMALL_CAP = 4096  # a route with a smaller cap of its own


@pytest.fixture(autouse=True, scope="module")
def installed():
    """The request class as config/asgi.py installs it in daphne's process (with the body
    cap's own caps), for this module only: daphne's own class is put back after it."""
    original = http_protocol.WebRequest
    daphne_requests.install(
        BodyCapMiddleware(None, max_bytes=CAP, route_max_bytes={"/v1/small": SMALL_CAP}).cap_for
    )
    yield
    http_protocol.WebRequest = original


class _Server:
    request_buffer_size = 8192  # daphne's default
    proxy_forwarded_address_header = None
    root_path = ""

    def __init__(self) -> None:
        self.messages: list[dict] = []

    def protocol_connected(self, protocol) -> None:
        pass

    def create_application(self, protocol, scope):
        """The application's queue: here, a list of what daphne puts in it."""
        return SimpleNamespace(put_nowait=self.messages.append)


def received(path: bytes, body: bytes, content_type: bytes = b"application/json", *, server=None):
    """The request daphne's channel builds for a POST of `body` to `path`, as it stands when
    the whole request is in (before it goes to the application); with `server`, daphne's own
    `process` then hands it to that server's application."""
    seen = []

    class Request(http_protocol.WebRequest):
        def process(self):
            seen.append(self)
            if server is not None:
                return super().process()

    channel = HTTPChannel()
    channel.requestFactory = Request
    channel.factory = SimpleNamespace(server=server or _Server())
    channel.makeConnection(StringTransport())
    head = (
        b"POST "
        + path
        + b" HTTP/1.1\r\nHost: orchard\r\nContent-Type: "
        + content_type
        + b"\r\nContent-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
    )
    channel.dataReceived(head)
    for start in range(0, len(body), 1 << 16):  # as the socket delivers it
        channel.dataReceived(body[start : start + (1 << 16)])
    (request,) = seen
    return request


def test_a_body_over_its_routes_cap_is_dropped_as_it_arrives():
    request = received(b"/v1/chat/completions?stream=1", b"x" * (CAP + 1))
    assert isinstance(request.content, DroppedBody) and request.content.size == CAP + 1
    assert request.content.read() == b""


def test_a_body_within_its_routes_cap_is_kept_whole():
    body = b"x" * (CAP - 10)
    request = received(b"/v1/chat/completions", body)
    assert not isinstance(request.content, DroppedBody)
    request.content.seek(0)
    assert request.content.read() == body
    # A route's own cap: by its path as the application sees it (percent-decoded, no query).
    small = received(b"/v1/%73mall?x=1", b"y" * (SMALL_CAP + 1))
    assert isinstance(small.content, DroppedBody) and small.content.size == SMALL_CAP + 1


def test_no_post_body_is_parsed_into_twisteds_args():
    boundary = b"b0undary"
    body = (
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; '
        b'filename="lines.jsonl"\r\n\r\n' + b"{}\n" * 1000 + b"\r\n--" + boundary + b"--\r\n"
    )
    request = received(b"/v1/files", body, b"multipart/form-data; boundary=" + boundary)
    assert request.args == {}
    request.content.seek(0)
    assert request.content.read() == body  # the view reads it, as it came


def test_a_large_body_reaches_the_application_whole_in_a_few_messages():
    """Daphne's 8 KiB messages made a 3 MB body 330 queue puts, wake-ups and writes on the
    event loop every team's requests share."""
    server = _Server()
    body = bytes(range(256)) * (3 * 4096)  # 3 MiB
    received(b"/v1/chat/completions", body, server=server)
    assert [m["type"] for m in server.messages] == ["http.request"] * len(server.messages)
    assert len(server.messages) <= 4
    assert b"".join(m["body"] for m in server.messages) == body
    assert [m["more_body"] for m in server.messages][-1] is False


async def test_django_keeps_a_body_the_api_caps_let_through_in_memory():
    """Django's ASGI handler spools a body past FILE_UPLOAD_MAX_MEMORY_SIZE to a temporary file
    on the event loop; its default (2.5 MB) sent a 2.6 MB chat body there and back."""
    assert settings.FILE_UPLOAD_MAX_MEMORY_SIZE == settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    body = b"{" * settings.DATA_UPLOAD_MAX_MEMORY_SIZE
    chunks = [body[start : start + (1 << 20)] for start in range(0, len(body), 1 << 20)]
    messages = iter(
        {"type": "http.request", "body": chunk, "more_body": i < len(chunks) - 1}
        for i, chunk in enumerate(chunks)
    )

    async def receive():
        return next(messages)

    spooled = await ASGIHandler().read_body(receive)
    assert not spooled._rolled  # still in memory
    assert spooled.read() == body
