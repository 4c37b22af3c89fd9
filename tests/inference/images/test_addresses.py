"""Which addresses a fetch may reach (inference/images/addresses.py), one address at a time: the
kinds refused, the IPv6 forms that carry an IPv4 address, and the allow-list."""

import ipaddress
import socket

import pytest

from inference.images import ImageError, ImagePolicy
from inference.images import errors as codes
from inference.images.addresses import address_check, host_addresses, refused_kind

ALLOW_10 = ImagePolicy(allowed_networks=(ipaddress.ip_network("10.0.0.0/8"),))


@pytest.mark.parametrize(
    ("address", "kind"),
    [
        ("127.0.0.1", "loopback"),
        ("127.255.0.9", "loopback"),
        ("::1", "loopback"),
        ("10.0.0.1", "private"),
        ("172.31.255.255", "private"),
        ("192.168.0.1", "private"),
        ("fc00::1", "private"),
        ("fdff:ffff::1", "private"),
        ("169.254.169.254", "link-local"),
        ("fe80::1", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.251", "multicast"),
        ("ff02::1", "multicast"),
        ("100.64.0.1", "carrier-grade NAT"),
        ("100.127.255.254", "carrier-grade NAT"),
        ("::ffff:127.0.0.1", "loopback"),
        ("::ffff:169.254.169.254", "link-local"),
        ("::ffff:10.1.1.1", "private"),
        ("64:ff9b::a9fe:a9fe", "link-local"),  # NAT64 of 169.254.169.254
        ("2002:7f00:1::", "loopback"),  # 6to4 of 127.0.0.1
        ("2001:0:4136:e378:8000:63bf:80ff:fffe", ""),  # Teredo: refused whatever it carries
        ("240.0.0.1", ""),
        ("255.255.255.255", ""),
        ("192.0.2.10", ""),  # documentation
        ("198.18.0.1", ""),  # benchmarking
    ],
)
def test_non_public_addresses_are_refused(address, kind):
    found = refused_kind(ipaddress.ip_address(address))
    assert found is not None
    assert kind in found


@pytest.mark.parametrize(
    "address",
    [
        "93.184.215.14",
        "1.1.1.1",
        "2606:4700:4700::1111",
        "::ffff:93.184.215.14",
        "64:ff9b::5db8:d70e",  # NAT64 of 93.184.215.14: what DNS64 answers for IPv4-only sites
        "2002:5db8:d70e::1",  # 6to4 of it
    ],
)
def test_public_addresses_are_not(address):
    assert refused_kind(ipaddress.ip_address(address)) is None


def test_the_allow_list_opens_its_networks_and_nothing_else():
    assert address_check("10.1.2.3", "intranet", ALLOW_10) == ipaddress.ip_address("10.1.2.3")
    # The mapped form is the same address, and the fetch connects to it as IPv4.
    assert address_check("::ffff:10.1.2.3", "intranet", ALLOW_10) == ipaddress.ip_address(
        "10.1.2.3"
    )
    for other in ("192.168.1.1", "127.0.0.1", "169.254.169.254", "fd00::1"):
        with pytest.raises(ImageError) as caught:
            address_check(other, "intranet", ALLOW_10)
        assert caught.value.code == codes.BLOCKED_ADDRESS


async def test_an_address_literal_is_not_resolved():
    async def resolve(host):
        raise AssertionError(f"resolved {host}")

    assert await host_addresses("10.9.9.9", ALLOW_10, resolve) == [ipaddress.ip_address("10.9.9.9")]


async def test_the_addresses_of_a_name_come_once_each_in_order():
    async def resolve(host):
        return ["10.0.0.2", "10.0.0.1", "10.0.0.2", "::ffff:10.0.0.1"]

    addresses = await host_addresses("intranet.test", ALLOW_10, resolve)
    assert addresses == [ipaddress.ip_address("10.0.0.2"), ipaddress.ip_address("10.0.0.1")]


@pytest.mark.parametrize("answer", [socket.gaierror(socket.EAI_NONAME, "unknown"), []])
async def test_a_name_without_addresses_is_refused(answer):
    async def resolve(host):
        if isinstance(answer, Exception):
            raise answer
        return answer

    with pytest.raises(ImageError) as caught:
        await host_addresses("nowhere.test", ImagePolicy(), resolve)
    assert caught.value.code == codes.UNRESOLVABLE_HOST
