"""The sign-in throttle through the real pages (Django's test client, the members' form and the
admin's): variants of one username share the account's counter, one address is counted across
accounts, a forged X-Forwarded-For changes nothing unless it comes from a trusted proxy, a
success forgives the account's failures, and the counters live where every process sees them
(the database, or Redis when REDIS_URL is set)."""

import uuid

import pytest
import redis
from django.test import Client
from django.urls import reverse

from accounts import signin
from accounts.signin import RedisCounters
from tests.accounts.conftest import TEST_REDIS_URL
from tests.factories import UserFactory

pytestmark = pytest.mark.django_db
PASSWORD = "a-long-password-123"
LOGIN = reverse("web-login")
ADMIN_LOGIN = reverse("admin:login")


@pytest.fixture(autouse=True)
def fresh_counters(monkeypatch, settings):
    settings.ORCHARD_TRUSTED_PROXIES = []
    monkeypatch.setattr(signin, "_counters", {})  # built again from this test's settings


def user(username: str, **fields):
    made = UserFactory(username=username, **fields)
    made.set_password(PASSWORD)
    made.save()
    return made


def sign_in(username: str, password: str, *, url=LOGIN, address="198.51.100.1", forwarded=None):
    extra = {"REMOTE_ADDR": address}
    if forwarded is not None:
        extra["HTTP_X_FORWARDED_FOR"] = forwarded
    return Client().post(url, {"username": username, "password": password}, **extra).status_code


def test_variants_of_a_username_share_one_counter_from_any_address():
    user("Alice")
    variants = ["Alice", "ALICE", "alice", " aLiCe", "Ａｌｉｃｅ"]
    for number, name in enumerate(variants):
        assert sign_in(name, "wrong", address=f"198.51.100.{number + 10}") == 200
    # Locked from a sixth address too, even with the right password...
    assert sign_in("Alice", PASSWORD, address="198.51.100.99") == 429
    # ...and only this account: the addresses are far from their own limit.
    user("bob")
    assert sign_in("bob", PASSWORD, address="198.51.100.10") == 302


def test_one_address_is_locked_across_accounts_whatever_it_forwards():
    user("carol")
    for number in range(signin.ADDRESS_ATTEMPTS):
        # A client's own X-Forwarded-For, fresh each time: no proxy is trusted, so it is ignored.
        spoofed = f"203.0.113.{number}"
        assert sign_in(f"guess{number}", "wrong", forwarded=spoofed) == 200
    assert sign_in("carol", PASSWORD, forwarded="192.0.2.77") == 429
    assert sign_in("carol", PASSWORD, address="198.51.100.2") == 302  # another address


def test_behind_a_trusted_proxy_the_forwarded_client_is_counted(settings):
    settings.ORCHARD_TRUSTED_PROXIES = ["127.0.0.1/32"]
    user("dave")
    proxy = {"address": "127.0.0.1"}
    for number in range(signin.ADDRESS_ATTEMPTS):
        # Whatever the client writes on the left, our proxy appended its real address.
        forwarded = f"10.9.9.{number}, 203.0.113.5"
        assert sign_in(f"guess{number}", "wrong", forwarded=forwarded, **proxy) == 200
    assert sign_in("dave", PASSWORD, forwarded="203.0.113.5", **proxy) == 429
    # Another client behind the same proxy is not that client.
    assert sign_in("dave", PASSWORD, forwarded="203.0.113.6", **proxy) == 302


def test_a_success_forgives_the_accounts_failures():
    user("erin")
    for _ in range(signin.ACCOUNT_ATTEMPTS - 1):
        assert sign_in("erin", "wrong") == 200
    assert sign_in("erin", PASSWORD) == 302
    for _ in range(signin.ACCOUNT_ATTEMPTS):
        assert sign_in("erin", "wrong") == 200
    assert sign_in("erin", PASSWORD) == 429


def test_the_admins_sign_in_form_shares_the_throttle():
    user("root", is_staff=True, is_superuser=True)
    page = Client().get(ADMIN_LOGIN)
    assert page.status_code == 200 and b"csrfmiddlewaretoken" in page.content
    admin = Client()
    signed = admin.post(ADMIN_LOGIN, {"username": "root", "password": PASSWORD})
    assert signed.status_code == 302 and admin.get(reverse("admin:index")).status_code == 200
    for _ in range(3):
        assert sign_in("root", "wrong", url=ADMIN_LOGIN) == 200
    for _ in range(signin.ACCOUNT_ATTEMPTS - 3):
        assert sign_in("ROOT", "wrong") == 200  # the members' form: the same counter
    assert sign_in("root", PASSWORD, url=ADMIN_LOGIN) == 429
    assert sign_in("root", PASSWORD, url=ADMIN_LOGIN, address="198.51.100.3") == 429


def test_a_sign_in_without_its_csrf_token_is_not_counted():
    user("fay")
    strict = Client(enforce_csrf_checks=True, REMOTE_ADDR="198.51.100.1")
    for _ in range(signin.ACCOUNT_ATTEMPTS + 2):
        assert strict.post(LOGIN, {"username": "fay", "password": "x"}).status_code == 403
    assert sign_in("fay", PASSWORD) == 302


@pytest.mark.redis
def test_with_redis_every_process_sees_the_same_counters(settings):
    settings.REDIS_URL = TEST_REDIS_URL
    settings.ORCHARD_WORKER_NAMESPACE = f"orchard-test-{uuid.uuid4().hex}"
    namespace = f"{settings.ORCHARD_WORKER_NAMESPACE}:signin:"
    other_process = RedisCounters(url=TEST_REDIS_URL, namespace=namespace)
    raw = redis.Redis.from_url(TEST_REDIS_URL)
    try:
        user("gus")
        for _ in range(signin.ACCOUNT_ATTEMPTS - 1):
            assert sign_in("gus", "wrong") == 200
        # Another process's client counts one more failure on the same Redis counter...
        key = signin.account_key("gus")
        assert other_process.count([key])[key] == signin.ACCOUNT_ATTEMPTS
        # ...and this process's page refuses the next attempt.
        assert sign_in("Gus", PASSWORD, address="198.51.100.50") == 429
        assert raw.exists(namespace + key)
    finally:
        other_process.close()
        for name in raw.scan_iter(match=f"{namespace}*"):
            raw.delete(name)
        raw.close()
