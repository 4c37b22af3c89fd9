"""The limits an image input is held to, as one value: read from the settings for the views, built
by hand in tests (a small byte limit, a short timeout, 127.0.0.1 allowed) without touching them."""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass

from django.conf import settings

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class ImagePolicy:
    # Off by default: a URL makes the server reach out on the caller's behalf, which a
    # deployment should choose knowingly (data URLs and base64 always work).
    fetch: bool = False
    # Networks a fetch may reach although they are not public (an intranet image server).
    allowed_networks: tuple[Network, ...] = ()
    max_redirects: int = 3
    timeout_seconds: float = 10.0
    max_bytes: int = 20 << 20
    max_pixels: int = 40_000_000
    # The TLS trust of a fetch (httpx's default, certifi's roots); a test passes its own CA's.
    verify: ssl.SSLContext | bool = True

    @classmethod
    def from_settings(cls) -> ImagePolicy:
        return cls(
            fetch=settings.ORCHARD_IMAGE_FETCH,
            allowed_networks=tuple(
                ipaddress.ip_network(network)
                for network in settings.ORCHARD_IMAGE_FETCH_ALLOWED_NETWORKS
            ),
            max_redirects=settings.ORCHARD_IMAGE_FETCH_MAX_REDIRECTS,
            timeout_seconds=settings.ORCHARD_IMAGE_FETCH_TIMEOUT_SECONDS,
            max_bytes=settings.ORCHARD_IMAGE_MAX_BYTES,
            max_pixels=settings.ORCHARD_IMAGE_MAX_PIXELS,
        )
