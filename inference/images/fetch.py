"""Fetching an image URL without letting the caller use the server to reach what it can reach.

Each hop (the URL, then every redirect, followed here rather than by the client) is parsed, its
host resolved once and every address checked (addresses.py), and the connection made to a checked
address: the URL the client gets names the address, while the Host header and TLS's server name
(SNI, and so the certificate check) keep the original host name. The client reads no proxy or
certificate settings from the environment (a proxy would connect by name, past the checks).

Limits: ORCHARD_IMAGE_FETCH_TIMEOUT_SECONDS for the whole fetch (resolutions, redirects, body);
ORCHARD_IMAGE_MAX_BYTES against Content-Length before the body, then against the bytes as they
arrive (a body without Content-Length is cut off at the limit, not read to its end). The body is
asked for uncompressed and read as sent: a compressed body would grow past the limit in one
decompression step before it could be counted.
"""

from __future__ import annotations

import asyncio

import httpx2

from inference.images.addresses import Address, Resolver, host_addresses, system_resolve
from inference.images.errors import (
    FETCH_DISABLED,
    FETCH_FAILED,
    FETCH_TIMEOUT,
    INVALID_URL,
    TOO_MANY_REDIRECTS,
    UNSUPPORTED_SCHEME,
    ImageError,
)
from inference.images.formats import ImageInput, bytes_check, image_check, media_type_check
from inference.images.policy import ImagePolicy

REDIRECTS = (301, 302, 303, 307, 308)
HEADERS = {
    "Accept": "image/png, image/jpeg, image/gif, image/webp",
    "Accept-Encoding": "identity",
    "User-Agent": "Orchard image fetch",
}


async def image_fetch(
    url: str, *, policy: ImagePolicy | None = None, resolve: Resolver | None = None
) -> ImageInput:
    """The image at an http(s) `url`, fetched under the policy's limits and checked; ImageError
    for every refusal (fetching switched off included)."""
    policy = policy or ImagePolicy.from_settings()
    if not policy.fetch:
        raise ImageError(
            FETCH_DISABLED,
            "Image URLs are disabled on this server; send the image inline as a data URL "
            "(data:image/png;base64,...) instead.",
        )
    try:
        async with asyncio.timeout(policy.timeout_seconds):
            data, content_type = await _download(url, policy, resolve or system_resolve)
    except (TimeoutError, httpx2.TimeoutException):
        raise ImageError(
            FETCH_TIMEOUT,
            f"Fetching the image URL took longer than {policy.timeout_seconds:g} s.",
        ) from None
    except httpx2.TransportError as exc:  # refused, reset, TLS failed, a malformed answer
        raise ImageError(FETCH_FAILED, f"Could not fetch the image URL ({_reason(exc)}).") from None
    return image_check(data, declared_type=content_type, policy=policy)


def _hop(text: str, base: httpx2.URL | None = None) -> httpx2.URL:
    """`text` (a redirect's Location: relative to `base`) as a URL the fetch may go to."""
    try:
        url = base.join(text) if base is not None else httpx2.URL(text)
    except httpx2.InvalidURL as exc:
        raise ImageError(INVALID_URL, f"The image URL is not a valid URL ({exc}).") from None
    if url.scheme not in ("http", "https"):
        raise ImageError(
            UNSUPPORTED_SCHEME,
            "Image URLs must be http or https (or a data:image/...;base64 URL), not "
            f"'{url.scheme[:20]}'.",
        )
    if not url.host:
        raise ImageError(INVALID_URL, "The image URL has no host.")
    if url.port is not None and not 0 < url.port < 65536:
        raise ImageError(INVALID_URL, f"The image URL's port {url.port} does not exist.")
    if url.userinfo:
        raise ImageError(INVALID_URL, "Image URLs may not carry a user name or password.")
    return url


async def _download(url: str, policy: ImagePolicy, resolve: Resolver) -> tuple[bytes, str | None]:
    current = _hop(url)
    async with httpx2.AsyncClient(
        verify=policy.verify, trust_env=False, timeout=policy.timeout_seconds, headers=HEADERS
    ) as client:
        for _ in range(policy.max_redirects + 1):
            response = await _send(client, current, policy, resolve)
            try:
                if response.status_code in REDIRECTS:
                    location = response.headers.get("location")
                    if not location:
                        raise ImageError(
                            FETCH_FAILED, "The image URL redirected without saying where to."
                        )
                    current = _hop(location, current)
                    continue
                return await _body(response, policy), response.headers.get("content-type")
            finally:
                await response.aclose()
    raise ImageError(
        TOO_MANY_REDIRECTS,
        f"The image URL redirected more than {policy.max_redirects} times.",
    )


async def _send(
    client: httpx2.AsyncClient, url: httpx2.URL, policy: ImagePolicy, resolve: Resolver
) -> httpx2.Response:
    """The response of the first of the host's checked addresses that takes the connection."""
    host = url.raw_host.decode("ascii")
    *others, last = await host_addresses(host, policy, resolve)

    def pinned(address: Address) -> httpx2.Request:
        return client.build_request(
            "GET",
            url.copy_with(host=str(address)),
            headers={"Host": url.netloc.decode("ascii")},
            extensions={"sni_hostname": host},
        )

    for address in others:
        try:
            return await client.send(pinned(address), stream=True)
        except httpx2.ConnectError:
            continue
    return await client.send(pinned(last), stream=True)


async def _body(response: httpx2.Response, policy: ImagePolicy) -> bytes:
    if response.status_code != 200:
        raise ImageError(
            FETCH_FAILED, f"The image URL answered HTTP {response.status_code}, not an image."
        )
    media_type_check(response.headers.get("content-type"))
    encoding = response.headers.get("content-encoding", "identity").strip().lower()
    if encoding != "identity":
        raise ImageError(
            FETCH_FAILED,
            f"The image URL sent its image compressed ({encoding[:40]}); images must be sent "
            "as they are.",
        )
    declared = response.headers.get("content-length", "")
    if declared.isdigit():  # h11 has refused a malformed one already
        bytes_check(int(declared), policy)
    chunks, received = [], 0
    async for chunk in response.aiter_raw():
        received += len(chunk)
        bytes_check(received, policy)
        chunks.append(chunk)
    return b"".join(chunks)


def _reason(failure: Exception) -> str:
    text = str(failure).strip()
    return f"{type(failure).__name__}: {text[:200]}" if text else type(failure).__name__
