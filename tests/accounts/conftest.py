"""Fixtures for the gateway tests: limiters on both backends (the Redis one in a namespace of its
own, deleted afterwards) and unsaved keys for limiter tests that need no database."""

import uuid

import pytest
import redis

from accounts import keys, limits
from accounts.limits import InProcessLimiter, RateLimitExceeded, RedisLimiter
from accounts.models import ApiKey

TEST_REDIS_URL = "redis://127.0.0.1:6379/15"


def make_limited_key(**limits) -> ApiKey:
    """An unsaved key with the given limits and a unique prefix (the limiters' identity)."""
    raw = keys.generate_key()
    return ApiKey(pk=abs(hash(raw)) % 10**9, prefix=keys.lookup_prefix(raw), **limits)


async def try_admit(limiter, api_key, reserved=1):
    """The admission, or the refusal it raised."""
    try:
        return await limiter.admit(api_key, reserved_tokens=reserved)
    except RateLimitExceeded as exc:
        return exc


def admissions_of(results):
    return [r for r in results if isinstance(r, limits.Admission)]


@pytest.fixture
def redis_namespace():
    namespace = f"orchard-test:{uuid.uuid4().hex}:"
    yield namespace
    client = redis.Redis.from_url(TEST_REDIS_URL)
    for name in client.scan_iter(match=f"{namespace}*"):
        client.delete(name)
    client.close()


def _redis_limiter(namespace: str, **kwargs) -> RedisLimiter:
    return RedisLimiter(url=TEST_REDIS_URL, namespace=namespace, **kwargs)


@pytest.fixture(params=["in_process", pytest.param("redis", marks=pytest.mark.redis)])
def make_limiter(request):
    """Build limiters of one backend; Redis ones share a namespace (as processes share Redis)."""
    made = []

    def make(**kwargs):
        if request.param == "in_process":
            limiter = InProcessLimiter(**kwargs)
        else:
            limiter = _redis_limiter(request.getfixturevalue("redis_namespace"), **kwargs)
        made.append(limiter)
        return limiter

    make.backend = request.param
    yield make
    for limiter in made:
        if isinstance(limiter, RedisLimiter):
            limiter.close()
