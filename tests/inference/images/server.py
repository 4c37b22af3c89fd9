"""Real images and a real HTTP server for the image tests: pictures Pillow makes, files that
declare far more pixels than they hold (decompression bombs), and a threaded server on 127.0.0.1
whose routes misbehave the ways image hosts do (wrong types, slow, endless, redirect chains).
It records every request (path, Host header) and, over TLS, the server name the client sent."""

from __future__ import annotations

import gzip
import io
import ssl
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs

from PIL import Image


def picture(image_format: str, width: int = 64, height: int = 48) -> bytes:
    image = Image.linear_gradient("L").resize((width, height)).convert("RGB")
    buffer = io.BytesIO()
    image.save(buffer, image_format)
    return buffer.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A valid 1×1 PNG whose header (IHDR, its CRC fixed) says width×height."""
    data = bytearray(picture("PNG", 1, 1))
    ihdr = 8 + 8  # signature, then the chunk's length and type
    data[ihdr : ihdr + 8] = struct.pack(">II", width, height)
    crc = zlib.crc32(bytes(data[ihdr - 4 : ihdr + 13]))
    data[ihdr + 13 : ihdr + 17] = struct.pack(">I", crc)
    return bytes(data)


def jpeg_declaring(width: int, height: int) -> bytes:
    """A valid 8×8 JPEG whose frame header (SOF0) says width×height."""
    data = bytearray(picture("JPEG", 8, 8))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


PNG = picture("PNG")
JPEG = picture("JPEG")
BOMB = png_declaring(100_000, 100_000)


@dataclass(frozen=True)
class Seen:
    path: str
    host: str | None


class ImageServer:
    """The server; `url(path, host=...)` names a route, `seen` what was asked, `server_names`
    the TLS server names (SNI) received. `close()` also ends the routes still waiting."""

    def __init__(self, tls: ssl.SSLContext | None = None) -> None:
        self.seen: list[Seen] = []
        self.server_names: list[str | None] = []
        self.release = threading.Event()
        self._lock = threading.Lock()
        self._barriers: dict[int, threading.Barrier] = {}
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.owner = self
        self.scheme = "http"
        if tls is not None:
            tls.sni_callback = lambda _socket, name, _context: self.server_names.append(name)
            self.httpd.socket = tls.wrap_socket(self.httpd.socket, server_side=True)
            self.scheme = "https"
        self.port = self.httpd.server_address[1]
        self._thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def barrier(self, parties: int) -> threading.Barrier:
        """One barrier per count, shared by the requests that wait on it."""
        with self._lock:
            if self._barriers.get(parties) is None or self._barriers[parties].broken:
                self._barriers[parties] = threading.Barrier(parties)
            return self._barriers[parties]

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"

    def paths(self) -> list[str]:
        return [seen.path for seen in self.seen]

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # quiet
        pass

    def do_GET(self):
        owner: ImageServer = self.server.owner
        owner.seen.append(Seen(self.path, self.headers.get("Host")))
        path, _, query = self.path.partition("?")
        try:
            self._route(owner, path, parse_qs(query))
        except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
            pass  # the client stopped reading: what several tests expect it to do

    def _send(self, status: int, body: bytes = b"", *headers: tuple[str, str]) -> None:
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        if not any(name == "Content-Length" for name, _ in headers):
            self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _route(self, owner: ImageServer, path: str, query: dict[str, list[str]]) -> None:
        fixed = {
            "/red.png": (PNG, "image/png"),
            "/photo.jpg": (JPEG, "image/jpeg"),
            "/mislabelled.png": (JPEG, "image/png"),
            "/page.html": (PNG, "text/html; charset=utf-8"),
            "/download": (PNG, "application/octet-stream"),
            "/text.png": (b"<html><body>not a picture</body></html>", "image/png"),
            "/bitmap.bmp": (picture("BMP"), "image/bmp"),
            "/bomb.png": (BOMB, "image/png"),
        }
        if path in fixed:
            body, content_type = fixed[path]
            self._send(200, body, ("Content-Type", content_type))
        elif path == "/untyped":
            self._send(200, PNG)
        elif path == "/gzip.png":
            body = gzip.compress(PNG)
            self._send(200, body, ("Content-Type", "image/png"), ("Content-Encoding", "gzip"))
        elif path.startswith("/hops/"):  # /hops/N: N redirects, then the image
            left = int(path.removeprefix("/hops/"))
            if left == 0:
                self._send(200, PNG, ("Content-Type", "image/png"))
            else:
                self._send(302, b"", ("Location", f"/hops/{left - 1}"))
        elif path == "/to":
            self._send(302, b"", ("Location", query["url"][0]))
        elif path == "/relative":
            self._send(301, b"", ("Location", "red.png"))
        elif path == "/no-location":
            self._send(302)
        elif path == "/together.png":  # answers once `n` requests for it are in at once
            try:
                owner.barrier(int(query["n"][0])).wait(timeout=5)
            except threading.BrokenBarrierError:
                self._send(404, b"alone", ("Content-Type", "text/plain"))
                return
            self._send(200, PNG, ("Content-Type", "image/png"))
        elif path == "/slow-headers.png":
            owner.release.wait(5)
            self._send(200, PNG, ("Content-Type", "image/png"))
        elif path == "/trickle.png":
            self._head(("Content-Length", str(len(PNG))))
            for index in range(len(PNG)):  # a byte at a time: no single read ever waits long
                if owner.release.wait(0.05):
                    return
                self.wfile.write(PNG[index : index + 1])
                self.wfile.flush()
        elif path == "/huge-declared.png":
            self._head(("Content-Length", str(10**10)))
            self.wfile.write(PNG)
            self.wfile.flush()
            owner.release.wait(5)
        elif path == "/endless.png":
            self._head()  # no length: the body ends when the connection does, here never
            self.wfile.write(PNG[:16])
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not owner.release.is_set():
                self.wfile.write(bytes(64 * 1024))
        else:
            self._send(404, b"not found", ("Content-Type", "text/plain"))

    def _head(self, *headers: tuple[str, str]) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.flush()


def tls_pair(host: str, directory) -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """(the server's context, a client's that trusts it): a certificate for `host` only, signed
    by a CA made here, so a client that checked it against another name would fail."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def certificate(subject, issuer, key, signer, *, ca: bool, names=()):
        # The extensions Python 3.13's strict verification (VERIFY_X509_STRICT) requires: key
        # identifiers, key usage, and a critical basicConstraints on the CA.
        usage = x509.KeyUsage(
            digital_signature=not ca,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            key_cert_sign=ca,
            crl_sign=ca,
            encipher_only=False,
            decipher_only=False,
        )
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(signer.public_key()),
                critical=False,
            )
        )
        if names:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(n) for n in names]), critical=False
            ).add_extension(
                x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
            )
        return builder.sign(signer, hashes.SHA256())

    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = certificate("Orchard test CA", "Orchard test CA", ca_key, ca_key, ca=True)
    leaf = certificate(host, "Orchard test CA", key, ca_key, ca=False, names=(host,))
    pem = serialization.Encoding.PEM
    cert_path, key_path = directory / "cert.pem", directory / "key.pem"
    cert_path.write_bytes(leaf.public_bytes(pem) + ca.public_bytes(pem))
    key_path.write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert_path, key_path)
    client = ssl.create_default_context(cadata=ca.public_bytes(pem).decode("ascii"))
    return server, client
