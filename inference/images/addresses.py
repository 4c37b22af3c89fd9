"""Which addresses an image fetch may connect to: public ones, and those of the networks the
deployment allows (ORCHARD_IMAGE_FETCH_ALLOWED_NETWORKS).

A host name is resolved once per hop and every address it resolves to is checked: one private
address among public ones refuses the host, since which one a connection would use is not ours
to predict. The fetch then connects to an address checked here, never to the name again, so a DNS
answer that changes between the check and the connection (rebinding) cannot move it.

IPv6 forms that carry an IPv4 address are judged by that address alone: IPv4-mapped
(::ffff:a.b.c.d, to which the fetch connects as plain IPv4), NAT64 (64:ff9b::/96: on an IPv6-only
network every IPv4-only site has such an address) and 6to4 (2002::/16). Teredo is refused (not
globally reachable), and so is anything else Python's `ipaddress` does not call global.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable

from inference.images.errors import BLOCKED_ADDRESS, UNRESOLVABLE_HOST, ImageError
from inference.images.policy import ImagePolicy

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
# A host name -> the addresses it resolves to (text); the system's unless a test substitutes one.
Resolver = Callable[[str], Awaitable[list[str]]]

CGNAT = ipaddress.ip_network("100.64.0.0/10")
NAT64 = ipaddress.ip_network("64:ff9b::/96")


async def system_resolve(host: str) -> list[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, None, type=socket.SOCK_STREAM)
    return [str(info[4][0]) for info in infos]


def refused_kind(address: Address) -> str | None:
    """Why `address` is not public ("loopback", "private", ...), or None when it is."""
    if isinstance(address, ipaddress.IPv6Address):
        embedded = _embedded_ipv4(address)
        if embedded is not None:
            return refused_kind(embedded)
    checks = (
        (address.is_loopback, "loopback"),
        (address.is_unspecified, "unspecified"),
        (address.is_link_local, "link-local (such as a cloud metadata service)"),
        (address.is_multicast, "multicast"),
        (address in CGNAT, "shared (carrier-grade NAT)"),
        (address.is_private, "private"),
        (address.is_reserved, "reserved"),
        (not address.is_global, "non-public"),
    )
    return next((kind for refused, kind in checks if refused), None)


def _embedded_ipv4(address: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address in NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return address.sixtofour


def address_check(text: str, host: str, policy: ImagePolicy) -> Address:
    """The address to connect to for `text` (one of `host`'s), or ImageError when it may not be."""
    address = ipaddress.ip_address(text)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if any(address in network for network in policy.allowed_networks):
        return address
    kind = refused_kind(address)
    if kind is not None:
        raise ImageError(
            BLOCKED_ADDRESS,
            f"The image URL's host ({host}) points to a {kind} address; Orchard fetches images "
            "only from public addresses.",
        )
    return address


async def host_addresses(host: str, policy: ImagePolicy, resolve: Resolver) -> list[Address]:
    """Every address of `host`, each checked (an IP literal is not resolved)."""
    try:
        ipaddress.ip_address(host)
        texts = [host]
    except ValueError:
        try:
            texts = await resolve(host)
        except (OSError, UnicodeError):
            texts = []
        if not texts:
            raise ImageError(
                UNRESOLVABLE_HOST, f"The image URL's host {host} could not be resolved."
            ) from None
    addresses = [address_check(text, host, policy) for text in texts]
    return list(dict.fromkeys(addresses))
