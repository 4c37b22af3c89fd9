"""accounts.signin: which counter an attempt lands on (the username folded, the client address
read past trusted proxies only), and the two stores every process shares, the database and the
real Redis, under concurrent attempts and from separate clients (separate connections, as
separate processes would have). The pages that use it: tests/inference/web/test_signin.py."""

import threading
import time

import pytest
import redis
from django.db import connection

from accounts import signin
from accounts.models import SigninAttempts
from accounts.signin import (
    DatabaseCounters,
    RedisCounters,
    SigninUnavailable,
    account_key,
    address_key,
    client_address,
)
from tests.accounts.conftest import TEST_REDIS_URL


def test_username_variants_of_one_account_share_a_counter():
    variants = ["Alice", "alice", "ALICE", " aLiCe ", "Ａｌｉｃｅ", "ＡＬＩＣＥ"]
    assert len({account_key(name) for name in variants}) == 1
    assert account_key("Alice") != account_key("Alicia")
    assert account_key("") is None and account_key("   ") is None
    # Neither the username nor its length reaches the store.
    assert "alice" not in account_key("alice") and account_key("a") != account_key("b")
    assert len(account_key("x" * 10_000)) == len(account_key("x"))


@pytest.mark.parametrize(
    ("remote", "forwarded", "trusted", "client"),
    [
        # No trusted proxy: the connection's address, whatever the header says.
        ("198.51.100.7", "203.0.113.9", [], "198.51.100.7"),
        # A request not from a trusted proxy: its header is the client's own words.
        ("198.51.100.7", "203.0.113.9", ["127.0.0.1/32"], "198.51.100.7"),
        # From our proxy: the hop it appended, not what the client wrote left of it.
        ("127.0.0.1", "6.6.6.6, 203.0.113.9", ["127.0.0.1/32"], "203.0.113.9"),
        # Two proxies of ours in a row (a balancer, then nginx): past both.
        ("10.0.0.7", "6.6.6.6, 203.0.113.9, 10.0.0.5", ["10.0.0.0/8"], "203.0.113.9"),
        # Every hop trusted: the farthest one.
        ("10.0.0.7", "10.0.0.3, 10.0.0.5", ["10.0.0.0/8"], "10.0.0.3"),
        # No header from a trusted proxy: the proxy itself.
        ("127.0.0.1", None, ["127.0.0.1/32"], "127.0.0.1"),
        # Not an address where our proxy's entry should be: the last hop that is one.
        ("127.0.0.1", "203.0.113.9, unknown", ["127.0.0.1/32"], "127.0.0.1"),
        # Ports and brackets, and an IPv4 client seen over IPv6.
        ("::1", "203.0.113.9:5123", ["::1/128"], "203.0.113.9"),
        ("::1", "[2001:db8::5]:443", ["::1/128"], "2001:db8::5"),
        ("::ffff:127.0.0.1", "203.0.113.9", ["127.0.0.1/32"], "203.0.113.9"),
    ],
)
def test_the_client_address_is_read_past_trusted_proxies_only(remote, forwarded, trusted, client):
    found = client_address(remote_addr=remote, forwarded_for=forwarded, trusted_proxies=trusted)
    assert found == client


def test_ipv6_clients_are_counted_per_64():
    assert address_key("2001:db8:1:2::5") == address_key("2001:db8:1:2:ffff::9")
    assert address_key("2001:db8:1:2::5") != address_key("2001:db8:1:3::5")
    assert address_key("203.0.113.9") != address_key("203.0.113.10")
    assert address_key("") == "address:unknown"


@pytest.fixture(
    params=[
        pytest.param("database", marks=pytest.mark.django_db(transaction=True)),
        pytest.param("redis", marks=pytest.mark.redis),
    ]
)
def make_counters(request):
    """Counters of one store; each call is another client of the same store, as another process
    would be (for the database, each thread has its own connection)."""
    made = []

    def make(window_seconds=signin.WINDOW_SECONDS):
        if request.param == "database":
            return DatabaseCounters(window_seconds=window_seconds)
        namespace = request.getfixturevalue("redis_namespace")
        counters = RedisCounters(
            url=TEST_REDIS_URL, namespace=namespace, window_seconds=window_seconds
        )
        made.append(counters)
        return counters

    yield make
    for counters in made:
        counters.close()


def _at_once(calls: list) -> list:
    barrier = threading.Barrier(len(calls))
    results, errors = [None] * len(calls), []

    def run(index):
        try:
            barrier.wait()
            results[index] = calls[index]()
        except Exception as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    return results


def test_concurrent_attempts_from_separate_clients_each_get_their_own_count(make_counters):
    clients = [make_counters() for _ in range(2)]
    keys = ["account:a", "address:1.2.3.4"]
    results = _at_once([lambda c=clients[i % 2]: c.count(keys) for i in range(8)])
    # No lost update and no two attempts seeing the same count: exactly 1..8 on each counter.
    for key in keys:
        assert sorted(result[key] for result in results) == list(range(1, 9))
    assert clients[1].count(["account:a"]) == {"account:a": 9}


def test_a_counter_starts_again_when_its_window_passes(make_counters):
    counters = make_counters(window_seconds=0.5)
    assert counters.count(["account:a"])["account:a"] == 1
    assert counters.count(["account:a"])["account:a"] == 2
    time.sleep(0.6)
    assert counters.count(["account:a"])["account:a"] == 1


def test_forgiving_clears_and_discounts_but_never_brings_a_counter_back(make_counters):
    counters, other_client = make_counters(), make_counters()
    for _ in range(3):
        counters.count(["account:a", "address:x"])
    other_client.forgive(clear=["account:a"], discount=["address:x", "address:never-counted"])
    after = counters.count(["account:a", "address:x", "address:never-counted"])
    assert after == {"account:a": 1, "address:x": 3, "address:never-counted": 1}


def test_attempts_past_a_limit_are_refused_without_counting_further(make_counters, settings):
    settings.ORCHARD_TRUSTED_PROXIES = []
    counters = make_counters()
    attempt = {"remote_addr": "203.0.113.9", "forwarded_for": None, "counters": counters}
    results = [
        signin.attempt_begin(username="alice", **attempt).allowed
        for _ in range(signin.ACCOUNT_ATTEMPTS + 3)
    ]
    assert results == [True] * signin.ACCOUNT_ATTEMPTS + [False] * 3
    by_address = address_key("203.0.113.9")
    assert counters.count([by_address])[by_address] == signin.ACCOUNT_ATTEMPTS + 1


def test_a_burst_of_concurrent_attempts_gets_no_more_than_the_limit(make_counters, settings):
    settings.ORCHARD_TRUSTED_PROXIES = []
    clients = [make_counters() for _ in range(2)]
    attempts = [
        lambda c=clients[i % 2], i=i: (
            signin.attempt_begin(
                username="alice", remote_addr=f"203.0.113.{i}", forwarded_for=None, counters=c
            ).allowed
        )
        for i in range(12)
    ]
    assert sum(_at_once(attempts)) == signin.ACCOUNT_ATTEMPTS


@pytest.mark.django_db
def test_expired_database_counters_are_purged():
    counters = DatabaseCounters(window_seconds=0.2)
    counters.count(["account:old"])
    time.sleep(0.3)
    DatabaseCounters().count(["account:new"])  # each count purges what has expired
    assert list(SigninAttempts.objects.values_list("key", flat=True)) == ["account:new"]


@pytest.mark.redis
def test_a_redis_that_does_not_answer_refuses_the_attempt(silent_redis, settings):
    settings.ORCHARD_TRUSTED_PROXIES = []
    counters = RedisCounters(url=silent_redis, namespace="x:", timeout_seconds=0.3)
    try:
        with pytest.raises(SigninUnavailable):
            signin.attempt_begin(
                username="alice", remote_addr="203.0.113.9", forwarded_for=None, counters=counters
            )
    finally:
        counters.close()


@pytest.mark.redis
def test_redis_counters_expire(redis_namespace):
    counters = RedisCounters(url=TEST_REDIS_URL, namespace=redis_namespace)
    raw = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        counters.count(["account:a"])
        counters.count(["account:a"])  # a second attempt does not extend the window
        ttl = raw.pttl(f"{redis_namespace}account:a")
        assert 0 < ttl <= signin.WINDOW_SECONDS * 1000
    finally:
        counters.close()
        raw.close()
