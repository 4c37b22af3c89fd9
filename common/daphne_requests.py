"""What daphne (Twisted) does with a request's body before the application sees it, made to fit
a server many teams share.

Daphne receives a whole request before it calls the application, keeping a body over 100 kB in a
temporary file, and Twisted's `Request` then parses every multipart or URL-encoded POST body into
`request.args` (the email parser, the whole body in memory, on the event loop), which daphne
never reads. So, in the daphne process:

- no body is parsed into `args`: a 200 MiB upload to /v1/files is no longer read into memory
  and parsed on the event loop every team's requests share, before the view streams it;
- a body whose Content-Length is over its route's cap (`cap_for`: the body cap's own,
  inference/body_cap.py) is dropped as it arrives: the cap answers 413 from the headers alone,
  so the bytes are read off the socket (a client sends its body before it reads the answer)
  and thrown away, never written to a file nor handed to the application;
- a body goes to the application in messages of up to BODY_MESSAGE_BYTES, not daphne's 8 KiB
  (its `request_buffer_size`, which no command-line option sets): a 3 MB body was 330 messages,
  each a queue put, a wake-up and a write into Django's body file on the event loop (35% of the
  web process's interpreter-lock time while one team sent such bodies in a loop, sampled with
  py-spy in bench/isolation.py's enums);
- with a `BodyRate`, every body's bytes are spent from a token bucket of its sender's
  (common/body_rate.py: its team once its key is known, else its client address) as they are
  read, and a connection whose bucket is in debt is not read from until the debt is repaid: the
  client's bytes wait in TCP, so one team's bodies (a flood of over-cap uploads, of schemas that
  take a parse to refuse) cost the process at most the bucket's rate, however many connections
  carry them, while another team's requests are read as they come.

`install` swaps daphne's request class for a subclass (daphne builds each connection's requests
from `daphne.http_protocol.WebRequest`), which raises its server's message size when it is made;
it changes nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from urllib.parse import unquote

from common.body_rate import ByteBuckets

BODY_MESSAGE_BYTES = 1 << 20


@dataclasses.dataclass
class BodyRate:
    """The buckets bodies are spent from, and `bucket_for(header, peer)`: the bucket of a
    request, from its headers (`header(name)`: a lowercase header's values, joined, or None)
    and the address of its peer (None when it has none, e.g. a Unix socket)."""

    buckets: ByteBuckets
    bucket_for: Callable[[Callable[[bytes], bytes | None], str | None], str]


class DroppedBody:
    """A request body's file that keeps nothing: its size only (Twisted asks `tell()`)."""

    closed = False

    def __init__(self) -> None:
        self.size = 0

    def write(self, data: bytes) -> None:
        self.size += len(data)

    def tell(self) -> int:
        return self.size

    def seek(self, offset: int, whence: int = 0) -> int:
        return 0

    def read(self, size: int = -1) -> bytes:
        return b""

    def close(self) -> None:
        self.closed = True


def declared_length(request) -> int | None:
    """The Content-Length as the body cap reads it (its first header, as an integer)."""
    values = request.requestHeaders.getRawHeaders(b"content-length") or []
    try:
        return int(values[0]) if values else None
    except ValueError:
        return None


def request_path(request) -> str | None:
    """The request's path as the application's scope will carry it; None if daphne would
    refuse it (not ASCII) or the line is not known yet."""
    target = getattr(request.channel, "_path", None)
    if not isinstance(target, bytes):
        return None
    try:
        return unquote(target.split(b"?", 1)[0].decode("ascii"))
    except UnicodeDecodeError:
        return None


def all_headers(request) -> Callable[[bytes], bytes | None]:
    """`header(name)`: a header's values joined with commas, as Django joins a repeated header
    (so a proxy's own X-Forwarded-For line after the client's counts), or None."""

    def header(name: bytes) -> bytes | None:
        values = request.requestHeaders.getRawHeaders(name)
        return b",".join(values) if values else None

    return header


def hold(channel, buckets: ByteBuckets, bucket: str, seconds: float) -> None:
    """Read nothing more from `channel`'s connection until `bucket` is out of debt, `seconds`
    from now as far as this connection knows (others of the bucket's may add to the debt
    meanwhile: the hold's end looks again)."""
    channel.transport.pauseProducing()
    channel.orchard_hold = (buckets, bucket)
    pending = getattr(channel, "orchard_release", None)
    if pending is not None and pending.active():
        pending.reset(seconds)
    else:
        channel.orchard_release = channel.callLater(seconds, release, channel)


def release(channel) -> None:
    """Read from `channel`'s connection again once its bucket is out of debt, unless Twisted
    holds it itself: while the answer waits for the client to read (`_waitingForTransport`)
    or a whole request is being handled (`_handlingRequest`: Twisted reads again once the
    request is done)."""
    channel.orchard_release = None
    transport = channel.transport
    if transport is None or not getattr(transport, "connected", True):
        return
    buckets, bucket = channel.orchard_hold
    debt = -buckets.level(bucket)
    if debt > 0:  # another connection of the bucket's spent meanwhile
        channel.orchard_release = channel.callLater(debt / buckets.rate, release, channel)
        return
    if channel._waitingForTransport or channel._handlingRequest:
        return
    transport.resumeProducing()


def install(cap_for: Callable[[str], int], body_rate: BodyRate | None = None) -> None:
    """Use the request class below for daphne's connections from now on (idempotent; the
    last call's `cap_for` and `body_rate` apply)."""
    from daphne import http_protocol

    base = getattr(http_protocol.WebRequest, "orchard_base", http_protocol.WebRequest)

    class Request(base):
        orchard_base = base

        def __init__(self, *args, **kwargs):
            kwargs["parsePOSTFormSubmission"] = False
            super().__init__(*args, **kwargs)
            if self.server.request_buffer_size < BODY_MESSAGE_BYTES:
                self.server.request_buffer_size = BODY_MESSAGE_BYTES

        def gotLength(self, length):  # (Twisted's name)
            self.orchard_bucket = None
            self.orchard_wire = False
            if body_rate is not None:
                peer = getattr(self.client, "host", None)
                self.orchard_bucket = body_rate.bucket_for(all_headers(self), peer)
                decoder = getattr(self.channel, "_transferDecoder", None)
                if length is None and decoder is not None:
                    # Chunked: spent as the bytes come off the socket, chunk-size lines and
                    # trailers included, not as the body they decode to.
                    self.orchard_wire = True
                    decoder.dataReceived = self._spending(decoder.dataReceived)
            path = request_path(self)
            if (
                length is not None
                and path is not None
                and declared_length(self) == length
                and length > cap_for(path)
            ):
                self.content = DroppedBody()  # BodyCapMiddleware answers 413 from the headers
                return
            super().gotLength(length)

        def handleContentChunk(self, data):  # (Twisted's name)
            super().handleContentChunk(data)
            if not getattr(self, "orchard_wire", True):
                self._spend(len(data))

        def finish(self):
            """Twisted reads the connection again once a request is done (`requestDone`),
            debt or not: held again while the request's bucket is in debt, so that requests
            whose bodies each come in one read are paced too."""
            channel = getattr(self, "channel", None)  # (gone once the request is cleaned up)
            bucket = getattr(self, "orchard_bucket", None)
            result = super().finish()
            if bucket is not None and channel is not None and channel.transport is not None:
                debt = -body_rate.buckets.level(bucket)
                if debt > 0:
                    hold(channel, body_rate.buckets, bucket, debt / body_rate.buckets.rate)
            return result

        def _spend(self, nbytes: int) -> None:
            bucket, channel = getattr(self, "orchard_bucket", None), getattr(self, "channel", None)
            if bucket is not None and channel is not None:
                wait = body_rate.buckets.spend(bucket, nbytes)
                if wait > 0:
                    hold(channel, body_rate.buckets, bucket, wait)

        def _spending(self, received: Callable[[bytes], None]) -> Callable[[bytes], None]:
            def spend_then(data: bytes) -> None:
                self._spend(len(data))
                received(data)

            return spend_then

    http_protocol.WebRequest = Request
