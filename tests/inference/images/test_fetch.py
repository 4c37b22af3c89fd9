"""Image URLs fetched from a real HTTP(S) server on 127.0.0.1, through the real client: what is
fetched, and every way a fetch is refused (switched off, private addresses after DNS and after
redirects, too many redirects, time, bytes, pixels, types, formats). The server is reachable only
because each test's policy allows 127.0.0.1/32; everything else private stays refused."""

import ipaddress
import socket
import time

import pytest

from inference.images import ImageError, ImagePolicy, image_from_url
from inference.images import errors as codes
from tests.inference.images.server import BOMB, JPEG, PNG, ImageServer, tls_pair

LOCAL = (ipaddress.ip_network("127.0.0.1/32"),)
POLICY = ImagePolicy(fetch=True, allowed_networks=LOCAL, timeout_seconds=5.0)


@pytest.fixture
def server(image_server):
    return image_server  # tests/inference/conftest.py


@pytest.fixture(autouse=True)
def fresh_log(server):
    server.seen.clear()


def resolver(table: dict[str, list[str]], calls: list[str] | None = None):
    async def resolve(host: str) -> list[str]:
        if calls is not None:
            calls.append(host)
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table[host]

    return resolve


async def refused(url: str, policy: ImagePolicy = POLICY, **kwargs) -> ImageError:
    with pytest.raises(ImageError) as caught:
        await image_from_url(url, policy=policy, **kwargs)
    return caught.value


async def test_fetching_is_off_unless_enabled(server):
    assert ImagePolicy.from_settings().fetch is False
    error = await refused(server.url("/red.png"), policy=None)
    assert error.code == codes.FETCH_DISABLED
    assert "data URL" in error.message
    assert server.seen == []


def test_the_policy_comes_from_the_settings(settings):
    settings.ORCHARD_IMAGE_FETCH = True
    settings.ORCHARD_IMAGE_FETCH_ALLOWED_NETWORKS = ["10.20.0.0/16", "fd00:1::/64"]
    settings.ORCHARD_IMAGE_FETCH_MAX_REDIRECTS = 1
    settings.ORCHARD_IMAGE_FETCH_TIMEOUT_SECONDS = 2.5
    settings.ORCHARD_IMAGE_MAX_BYTES = 1000
    settings.ORCHARD_IMAGE_MAX_PIXELS = 500
    policy = ImagePolicy.from_settings()
    assert policy.fetch is True
    assert policy.allowed_networks == (
        ipaddress.ip_network("10.20.0.0/16"),
        ipaddress.ip_network("fd00:1::/64"),
    )
    assert (policy.max_redirects, policy.timeout_seconds) == (1, 2.5)
    assert (policy.max_bytes, policy.max_pixels) == (1000, 500)


@pytest.mark.parametrize(
    ("path", "body", "image_format"), [("/red.png", PNG, "PNG"), ("/photo.jpg", JPEG, "JPEG")]
)
async def test_an_image_is_fetched_as_sent(server, path, body, image_format):
    image = await image_from_url(server.url(path), policy=POLICY)
    assert (image.data, image.format, image.width, image.height) == (body, image_format, 64, 48)
    assert server.paths() == [path]


async def test_a_host_name_is_resolved_once_and_the_checked_address_is_used(server):
    # The name exists only in this resolver: the connection can only have gone to the address
    # it answered (and checked), never to the name again (DNS rebinding has no second look).
    calls: list[str] = []
    resolve = resolver({"images.test": ["127.0.0.1"]}, calls)
    image = await image_from_url(
        server.url("/red.png", "images.test"), policy=POLICY, resolve=resolve
    )
    assert image.data == PNG
    assert calls == ["images.test"]
    assert server.seen[0].host == f"images.test:{server.port}"


async def test_a_lying_image_type_gives_way_to_the_bytes(server):
    image = await image_from_url(server.url("/mislabelled.png"), policy=POLICY)
    assert (image.format, image.media_type) == ("JPEG", "image/jpeg")


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254",  # the cloud metadata service
        "::ffff:127.0.0.1",  # loopback, IPv4-mapped: would reach the test server if let through
        "::ffff:169.254.169.254",
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "100.64.0.1",  # CGNAT
        "127.0.0.2",
        "::1",
        "fd12:3456::1",
        "fe80::1",
        "0.0.0.0",
        "::",
        "224.0.0.1",
        "240.0.0.1",
    ],
)
async def test_a_host_resolving_to_a_non_public_address_is_refused_before_connecting(
    server, address
):
    resolve = resolver({"evil.test": [address]})
    policy = ImagePolicy(fetch=True, timeout_seconds=5.0)  # nothing allowed
    error = await refused(server.url("/red.png", "evil.test"), policy, resolve=resolve)
    assert error.code == codes.BLOCKED_ADDRESS
    assert "evil.test" in error.message
    assert server.seen == []


async def test_every_resolved_address_is_checked(server):
    resolve = resolver({"mixed.test": ["127.0.0.1", "93.184.215.14", "10.0.0.7"]})
    error = await refused(server.url("/red.png", "mixed.test"), resolve=resolve)
    assert error.code == codes.BLOCKED_ADDRESS
    assert "private" in error.message
    assert server.seen == []


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "[::ffff:127.0.0.1]", "127.1", "0x7f000001", "2130706433", "localhost"]
)
async def test_loopback_in_any_spelling_is_refused_without_an_allow_list(server, host):
    policy = ImagePolicy(fetch=True, timeout_seconds=5.0)
    error = await refused(server.url("/red.png", host), policy=policy)  # the system's resolver
    assert error.code == codes.BLOCKED_ADDRESS
    assert "loopback" in error.message
    assert server.seen == []


@pytest.mark.parametrize(
    "target",
    [
        "http://127.0.0.2:{port}/red.png",  # loopback, but not the allowed 127.0.0.1
        "http://10.0.0.1/red.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::ffff:127.0.0.2]:{port}/red.png",
        "http://internal.test:{port}/red.png",  # a name resolving to a private address
    ],
)
async def test_a_redirect_from_an_allowed_host_is_checked_again(server, target):
    resolve = resolver({"internal.test": ["10.1.2.3"]})
    error = await refused(server.url("/to?url=" + target.format(port=server.port)), resolve=resolve)
    assert error.code == codes.BLOCKED_ADDRESS
    assert [path.partition("?")[0] for path in server.paths()] == ["/to"]


@pytest.mark.parametrize(
    ("target", "code"),
    [
        ("file:///etc/passwd", codes.UNSUPPORTED_SCHEME),
        ("gopher://127.0.0.1:70/", codes.UNSUPPORTED_SCHEME),
        ("http://127.0.0.1:abc/", codes.INVALID_URL),
        ("http://127.0.0.1:99999/", codes.INVALID_URL),
    ],
)
async def test_a_redirect_to_what_cannot_be_fetched_is_refused(server, target, code):
    error = await refused(server.url(f"/to?url={target}"))
    assert error.code == code
    assert len(server.seen) == 1


async def test_redirects_are_followed_up_to_the_limit(server):
    image = await image_from_url(server.url("/hops/3"), policy=POLICY)
    assert image.data == PNG
    assert server.paths() == ["/hops/3", "/hops/2", "/hops/1", "/hops/0"]
    server.seen.clear()
    image = await image_from_url(server.url("/relative"), policy=POLICY)
    assert (image.data, server.paths()) == (PNG, ["/relative", "/red.png"])


async def test_too_many_redirects_are_refused(server):
    error = await refused(server.url("/hops/4"))
    assert error.code == codes.TOO_MANY_REDIRECTS
    assert server.paths() == ["/hops/4", "/hops/3", "/hops/2", "/hops/1"]
    no_redirects = ImagePolicy(fetch=True, allowed_networks=LOCAL, max_redirects=0)
    assert (await refused(server.url("/relative"), no_redirects)).code == codes.TOO_MANY_REDIRECTS


@pytest.mark.parametrize("path", ["/page.html", "/download", "/untyped"])
async def test_a_body_not_declared_as_an_image_is_refused(server, path):
    error = await refused(server.url(path))
    assert error.code == codes.NOT_AN_IMAGE_TYPE


@pytest.mark.parametrize("path", ["/text.png", "/bitmap.bmp"])
async def test_bytes_that_are_not_an_accepted_format_are_refused(server, path):
    error = await refused(server.url(path))
    assert error.code == codes.UNSUPPORTED_FORMAT
    assert "PNG, JPEG, GIF or WebP" in error.message


async def test_a_decompression_bomb_is_refused_from_its_header(server):
    started = time.monotonic()
    error = await refused(server.url("/bomb.png"))
    assert error.code == codes.TOO_MANY_PIXELS
    assert time.monotonic() - started < 1.0
    assert len(BOMB) < 100


@pytest.mark.parametrize("path", ["/slow-headers.png", "/trickle.png"])
async def test_the_whole_fetch_has_one_deadline(server, path):
    # The trickle sends a byte every 50 ms: no read waits long, only the total runs out.
    policy = ImagePolicy(fetch=True, allowed_networks=LOCAL, timeout_seconds=0.4)
    started = time.monotonic()
    error = await refused(server.url(path), policy)
    assert error.code == codes.FETCH_TIMEOUT
    assert 0.35 < time.monotonic() - started < 2.0


async def test_a_declared_length_over_the_limit_is_refused_before_the_body(server):
    # The server then waits for 5 s: reading the body would end in a timeout instead.
    started = time.monotonic()
    error = await refused(server.url("/huge-declared.png"))
    assert error.code == codes.TOO_LARGE
    assert time.monotonic() - started < 2.0


async def test_a_body_without_length_is_cut_off_at_the_limit(server):
    # The body never ends: only counting it while it arrives can refuse it.
    policy = ImagePolicy(fetch=True, allowed_networks=LOCAL, max_bytes=256 * 1024)
    error = await refused(server.url("/endless.png"), policy)
    assert error.code == codes.TOO_LARGE
    assert "262,144 bytes" in error.message


async def test_the_byte_limit_is_inclusive(server):
    exact = ImagePolicy(fetch=True, allowed_networks=LOCAL, max_bytes=len(PNG))
    assert (await image_from_url(server.url("/red.png"), policy=exact)).data == PNG
    under = ImagePolicy(fetch=True, allowed_networks=LOCAL, max_bytes=len(PNG) - 1)
    assert (await refused(server.url("/red.png"), under)).code == codes.TOO_LARGE


async def test_a_compressed_body_is_refused(server):
    error = await refused(server.url("/gzip.png"))
    assert error.code == codes.FETCH_FAILED
    assert "gzip" in error.message


@pytest.mark.parametrize(
    ("path", "words"), [("/missing.png", "HTTP 404"), ("/no-location", "redirected without")]
)
async def test_an_answer_without_an_image_is_refused(server, path, words):
    error = await refused(server.url(path))
    assert error.code == codes.FETCH_FAILED
    assert words in error.message


async def test_an_unreachable_server_is_refused():
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    error = await refused(f"http://127.0.0.1:{port}/red.png")
    assert error.code == codes.FETCH_FAILED


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("ftp://example.com/a.png", codes.UNSUPPORTED_SCHEME),
        ("file:///etc/passwd", codes.UNSUPPORTED_SCHEME),
        ("http://user:secret@example.com/a.png", codes.INVALID_URL),
        ("http:///a.png", codes.INVALID_URL),
        ("http://example.com:99999/a.png", codes.INVALID_URL),
        ("http://example.com:abc/a.png", codes.INVALID_URL),
        ("http://nowhere.test/a.png", codes.UNRESOLVABLE_HOST),
    ],
)
async def test_urls_that_cannot_be_fetched_are_refused(url, code):
    calls: list[str] = []
    error = await refused(url, resolve=resolver({}, calls))
    assert error.code == code
    assert calls == (["nowhere.test"] if code == codes.UNRESOLVABLE_HOST else [])


async def test_proxy_settings_of_the_environment_are_ignored(server, monkeypatch):
    # A proxy connects by name, past the address checks: the fetch must go direct.
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:9/")
    assert (await image_from_url(server.url("/red.png"), policy=POLICY)).data == PNG


async def test_https_keeps_the_host_name_for_sni_and_the_certificate(tmp_path):
    server_tls, client_tls = tls_pair("images.test", tmp_path)
    server = ImageServer(tls=server_tls)
    try:
        policy = ImagePolicy(fetch=True, allowed_networks=LOCAL, verify=client_tls)
        resolve = resolver({"images.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]})
        image = await image_from_url(
            server.url("/red.png", "images.test"), policy=policy, resolve=resolve
        )
        assert image.data == PNG
        assert server.server_names == ["images.test"]
        assert server.seen[0].host == f"images.test:{server.port}"
        # The same address under a name the certificate does not carry: verified, refused.
        error = await refused(server.url("/red.png", "other.test"), policy, resolve=resolve)
        assert error.code == codes.FETCH_FAILED
        assert len(server.seen) == 1
    finally:
        server.close()
