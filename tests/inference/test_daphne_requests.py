"""Daphne's side of the body cap (common/daphne_requests.py), on Twisted's own HTTP channel fed
raw bytes: a body over its route's cap is dropped as it arrives (only its size is kept, for the
413 the cap answers from the headers), one within it is kept whole, and no POST body is parsed
into Twisted's `args` (a multipart upload would be read into memory and parsed on the event
loop); with a body rate, a team past it is not read from until its debt is repaid, while another
team is. Over real HTTP the 413s are tests/inference/test_body_cap.py's, the pacing
tests/inference/test_body_rate.py's."""

from types import SimpleNamespace

import pytest
from daphne import http_protocol
from django.conf import settings
from django.core.handlers.asgi import ASGIHandler
from twisted.internet.task import Clock
from twisted.internet.testing import StringTransport
from twisted.web.http import HTTPChannel
from twisted.web.http_headers import Headers

from common import daphne_requests
from common.body_rate import ByteBuckets
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

    def protocol_disconnected(self, protocol) -> None:
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


RATE = 64 * 1024  # bytes a second, for the pacing tests below (and as their burst)


@pytest.fixture
def paced():
    """The request class with a body rate: one bucket per Authorization header, 64 KiB a
    second and 64 KiB of burst on a clock the test moves; the module's class is put back."""
    clock = Clock()
    rate = daphne_requests.BodyRate(
        buckets=ByteBuckets(rate=RATE, burst=RATE, clock=clock.seconds),
        bucket_for=lambda header, peer: (header(b"authorization") or b"?").decode(),
    )
    daphne_requests.install(BodyCapMiddleware(None, max_bytes=CAP).cap_for, rate)
    clock.buckets = rate.buckets
    yield clock
    daphne_requests.install(
        BodyCapMiddleware(None, max_bytes=CAP, route_max_bytes={"/v1/small": SMALL_CAP}).cap_for
    )


def post_head(team: bytes, length: int | None) -> bytes:
    size = b"Transfer-Encoding: chunked" if length is None else b"Content-Length: %d" % length
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: orchard\r\nAuthorization: "
        + team
        + b"\r\n"
        + size
        + b"\r\n\r\n"
    )


def connection(
    clock: Clock, team: bytes, length: int | None
) -> tuple[HTTPChannel, StringTransport]:
    """A daphne channel on `clock` with a POST of `length` bytes (None: chunked) from `team`
    begun (its headers in, no body yet)."""
    channel = HTTPChannel()
    channel.requestFactory = http_protocol.WebRequest
    channel.factory = SimpleNamespace(server=_Server(), log=lambda request: None)
    channel.callLater = clock.callLater
    transport = StringTransport()
    channel.makeConnection(transport)
    channel.dataReceived(post_head(team, length))
    return channel, transport


def test_a_team_past_its_body_rate_is_not_read_from_until_its_debt_is_repaid(paced):
    clock = paced
    a, a_transport = connection(clock, b"team-a", 4 * RATE)
    a.dataReceived(b"x" * RATE)  # the burst: nothing held
    assert a_transport.producerState == "producing"
    a.dataReceived(b"x" * (RATE // 2))  # half a second of debt
    assert a_transport.producerState == "paused"
    # A second connection of the same team spends from the same bucket: held as long.
    a2, a2_transport = connection(clock, b"team-a", 4 * RATE)
    a2.dataReceived(b"x" * (RATE // 2))  # one second of debt in all
    assert a2_transport.producerState == "paused"
    # Another team's connection is read as it comes.
    b, b_transport = connection(clock, b"team-b", RATE)
    b.dataReceived(b"y" * RATE)
    assert b_transport.producerState == "producing"
    clock.advance(0.9)
    assert a_transport.producerState == a2_transport.producerState == "paused"
    clock.advance(0.2)  # the debt is repaid: both are read from again
    assert a_transport.producerState == a2_transport.producerState == "producing"


def test_a_held_connection_is_left_to_twisted_while_its_request_is_handled(paced):
    """The last chunk's debt holds the connection, but the request is then being handled
    (Twisted reads again once it is done): the hold's end must not resume it early."""
    clock = paced
    channel, transport = connection(clock, b"team-a", 2 * RATE)
    channel.dataReceived(b"x" * (2 * RATE))  # the whole body, a second of debt
    assert transport.producerState == "paused" and channel._handlingRequest
    clock.advance(2)
    assert transport.producerState == "paused"


def test_requests_whose_bodies_come_in_one_read_are_paced_on_a_kept_alive_connection(paced):
    """Twisted reads a connection again once its request is done, debt or not: the request's
    end holds it again while the team is in debt."""
    clock = paced
    channel, transport = connection(clock, b"team-a", RATE + RATE // 2)
    channel.dataReceived(b"x" * (RATE + RATE // 2))  # whole, in one read: half a second of debt
    (request,) = channel.requests
    request.finish()
    assert transport.producerState == "paused"
    clock.advance(0.4)
    assert transport.producerState == "paused"
    clock.advance(0.2)
    assert transport.producerState == "producing"
    channel.dataReceived(post_head(b"team-a", 100) + b"y" * 100)  # the next request: no debt
    channel.requests[0].finish()
    assert transport.producerState == "producing"


def test_a_chunked_body_is_spent_as_its_bytes_come_off_the_socket(paced):
    """Chunk-size lines and their extensions cost their bytes, not the one byte each chunk
    decodes to."""
    clock = paced
    channel, _ = connection(clock, b"team-a", None)
    chunk = b"1;" + b"e" * 1000 + b"\r\nx\r\n"
    for _ in range(10):
        channel.dataReceived(chunk)
    assert clock.buckets.level("team-a") == RATE - 10 * len(chunk)


def test_a_repeated_header_is_read_whole():
    """A proxy that adds its own X-Forwarded-For line after the client's: both count, as
    Django joins them."""
    headers = Headers({b"X-Forwarded-For": [b"203.0.113.9", b"198.51.100.4"]})
    header = daphne_requests.all_headers(SimpleNamespace(requestHeaders=headers))
    assert header(b"x-forwarded-for") == b"203.0.113.9,198.51.100.4"
    assert header(b"authorization") is None
