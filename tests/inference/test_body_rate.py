"""Whose bucket a body is read from (inference/body_rate.py), and the pacing over real HTTP with
two teams: a daphne with a small body rate reads team A's bodies no faster than the rate, however
many connections carry them, while team B's request is answered at once (Twisted's side of it is
tests/inference/test_daphne_requests.py's)."""

import secrets
import threading
import time

import httpx
import pytest
from asgiref.sync import async_to_sync
from django.test import RequestFactory, override_settings

from accounts.models import ApiKey
from accounts.services import api_key_revoke
from inference import body_rate
from inference.api.common import authenticate
from inference.body_rate import KnownKeys, bucket_for, known_keys
from inference.errors import APIError
from tests.fixtures.daphne import daphne_servers, server_env

RATE = 512 * 1024
BURST = 64 * 1024


def headers(**values: str):
    raw = {name.replace("_", "-").encode(): value.encode() for name, value in values.items()}
    return raw.get


def made_up_key() -> str:
    return "sk-orch-" + secrets.token_hex(20)


def test_a_key_spends_from_its_teams_bucket_once_known_and_from_its_address_before():
    key = made_up_key()
    try:
        assert bucket_for(headers(authorization=f"Bearer {key}"), "10.1.2.3") == "address:10.1.2.3"
        known_keys.remember(key, 7)
        assert bucket_for(headers(authorization=f"Bearer {key}"), "10.1.2.3") == "team:7"
        assert bucket_for(headers(x_api_key=key), "10.9.9.9") == "team:7"  # Anthropic's header
        # Keys made up on the spot have no bucket of their own: their address's.
        for _ in range(3):
            forged = headers(authorization=f"Bearer {made_up_key()}")
            assert bucket_for(forged, "10.1.2.3") == "address:10.1.2.3"
        known_keys.forget(key)
        assert bucket_for(headers(authorization=f"Bearer {key}"), "10.1.2.3") == "address:10.1.2.3"
    finally:
        known_keys.forget(key)
    assert bucket_for(headers(), None) == "address:local"  # a Unix socket


def test_a_known_key_goes_back_to_its_address_a_while_after_it_last_authenticated():
    now = [0.0]
    keys = KnownKeys(known_for_s=60, clock=lambda: now[0])
    keys.remember("sk-orch-a", 3)
    now[0] = 59
    assert keys.team_of("sk-orch-a") == 3
    keys.remember("sk-orch-a", 3)  # authenticated again: another minute
    now[0] = 110
    assert keys.team_of("sk-orch-a") == 3
    now[0] = 120
    assert keys.team_of("sk-orch-a") is None


def test_an_ipv6_clients_addresses_share_its_64s_bucket():
    assert bucket_for(headers(), "2001:db8:1:2::1") == "address:2001:db8:1:2::/64"
    assert bucket_for(headers(), "2001:db8:1:2:ffff::9") == "address:2001:db8:1:2::/64"
    assert bucket_for(headers(), "2001:db8:1:3::1") == "address:2001:db8:1:3::/64"


def test_the_address_comes_from_x_forwarded_for_only_through_trusted_proxies():
    forwarded = headers(x_forwarded_for="203.0.113.9, 198.51.100.4")
    assert bucket_for(forwarded, "10.0.0.2") == "address:10.0.0.2"
    with override_settings(ORCHARD_TRUSTED_PROXIES=["10.0.0.0/8"]):
        assert bucket_for(forwarded, "10.0.0.2") == "address:198.51.100.4"
        assert bucket_for(forwarded, "192.0.2.1") == "address:192.0.2.1"  # not a proxy of ours


@pytest.mark.django_db
def test_authenticating_remembers_a_keys_team_and_a_refusal_forgets_it(make_key):
    raw = make_key("ann", "team-a")
    api_key = ApiKey.objects.select_related("team").get(prefix=raw[:16])
    request = RequestFactory().get("/v1/models", HTTP_AUTHORIZATION=f"Bearer {raw}")
    async_to_sync(authenticate)(request)
    assert known_keys.team_of(raw) == api_key.team_id
    api_key_revoke(api_key=api_key)
    with pytest.raises(APIError) as refused:
        async_to_sync(authenticate)(request)
    assert refused.value.status == 401
    assert known_keys.team_of(raw) is None  # a revoked key's bodies go back to its address


def test_the_settings_make_the_buckets_or_none():
    with override_settings(ORCHARD_BODY_RATE_BYTES=1000, ORCHARD_BODY_BURST_BYTES=5000):
        rate = body_rate.body_rate()
        assert (rate.buckets.rate, rate.buckets.burst) == (1000, 5000)
    with override_settings(ORCHARD_BODY_RATE_BYTES=0):
        assert body_rate.body_rate() is None


@pytest.fixture(scope="module")
def paced_server(django_db_setup, tmp_path_factory):
    home = tmp_path_factory.mktemp("paced-home")
    env = {
        **server_env(),
        "ORCHARD_HOME": str(home),
        "ORCHARD_BODY_RATE_BYTES": str(RATE),
        "ORCHARD_BODY_BURST_BYTES": str(BURST),
        "ORCHARD_PRELOAD_MODELS": "0",
    }
    with daphne_servers(1, env, home) as (url,):
        yield url


def test_one_teams_bodies_are_read_at_its_rate_while_another_teams_request_goes_through(
    paced_server, make_key
):
    key_a, key_b = make_key("ann", "team-a"), make_key("bob", "team-b")
    for key in (key_a, key_b):  # each key authenticates once: its team's bucket from now on
        answer = httpx.get(f"{paced_server}/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert answer.status_code == 200
    connections, size = 4, RATE  # 2 MiB on 4 connections: about 4 s at team A's rate
    body = b'{"model": "no-such-model", "input": "' + b"a" * (size - 60) + b'"}'
    done_a: list[float] = []

    def send_a() -> None:
        answer = httpx.post(
            f"{paced_server}/v1/embeddings",
            content=body,
            headers={"Authorization": f"Bearer {key_a}", "Content-Type": "application/json"},
            timeout=60,
        )
        assert answer.status_code == 404, answer.text  # read whole, then no such model
        done_a.append(time.monotonic())

    started = time.monotonic()
    threads = [threading.Thread(target=send_a) for _ in range(connections)]
    for thread in threads:
        thread.start()
    time.sleep(0.5)
    answer_b = httpx.post(
        f"{paced_server}/v1/embeddings",
        content=b'{"model": "no-such-model", "input": "' + b"b" * 30_000 + b'"}',
        headers={"Authorization": f"Bearer {key_b}", "Content-Type": "application/json"},
        timeout=60,
    )
    done_b = time.monotonic()
    for thread in threads:
        thread.join()
    assert answer_b.status_code == 404 and len(done_a) == connections
    # B's body, within its own team's burst, did not wait behind A's debt.
    assert done_b < max(done_a)
    # A's bytes: at most the burst, the rate since, and one socket read (64 KiB) a connection
    # that found the bucket out of debt, so the last is read no sooner than this.
    soonest = (connections * size - BURST - connections * 64 * 1024) / RATE
    assert max(done_a) - started >= soonest
