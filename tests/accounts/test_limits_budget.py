"""accounts.limits' monthly token budget on both backends: seeded from the month's usage and
re-seeded when idle, never exceeded under sustained concurrent load, shared by processes (Redis),
what a flexible request is granted from it, and a retried release counted once."""

import asyncio
import random

import pytest
from asgiref.sync import sync_to_async
from django.utils import timezone

from accounts import limits
from accounts.limits import CODE_QUOTA, ERROR_BUDGET, RateLimitExceeded, RedisLimiter
from accounts.models import ApiKeyMonthlyUsage
from accounts.selectors import month_start
from tests.accounts.conftest import TEST_REDIS_URL, admissions_of, try_admit
from tests.factories import ApiKeyFactory


@pytest.mark.django_db(transaction=True)
async def test_budget_holds_under_sustained_concurrent_load(make_limiter, sync_thread_db):
    """50 clients admit and release as fast as they can until the budget runs out: what they used
    never exceeds the budget, whatever each request ends up using."""
    api_key = await sync_to_async(ApiKeyFactory)(budget_tokens=5000)
    limiter = make_limiter()
    rng = random.Random(7)
    used_total = 0

    async def client():
        nonlocal used_total
        while True:
            try:
                admission = await limiter.admit(api_key, reserved_tokens=100)
            except RateLimitExceeded as exc:
                assert exc.code == CODE_QUOTA
                return
            await asyncio.sleep(0)
            used = rng.randint(0, 100)
            used_total += used
            await admission.release(used_tokens=used)

    await asyncio.wait_for(asyncio.gather(*(client() for _ in range(50))), 60)
    assert 5000 - 100 < used_total <= 5000


@pytest.mark.django_db(transaction=True)
async def test_budget_is_seeded_from_the_month_and_never_exceeded(make_limiter, sync_thread_db):
    api_key = await sync_to_async(ApiKeyFactory)(budget_tokens=1000)
    month = month_start(timezone.now().date())
    await ApiKeyMonthlyUsage.objects.acreate(api_key=api_key, month=month, tokens=400)
    limiter = make_limiter()
    results = await asyncio.gather(*(try_admit(limiter, api_key, 100) for _ in range(50)))
    admitted = admissions_of(results)
    assert len(admitted) == 6
    refusal = next(r for r in results if isinstance(r, RateLimitExceeded))
    assert refusal.code == CODE_QUOTA
    assert refusal.headers["x-should-retry"] == "false"
    assert refusal.message == ERROR_BUDGET.format(
        budget="key's monthly token budget",
        name=f"key {api_key.prefix}",
        limit=1000,
        used=1000,
        requested=100,
    )
    assert refusal.budget.scope == "key" and refusal.budget.unit == "tokens"
    for admission in admitted:
        await admission.release(used_tokens=50)
    # 400 + 6 * 50 used: 300 left
    assert len(admissions_of([await try_admit(limiter, api_key, 100) for _ in range(5)])) == 3


@pytest.mark.django_db(transaction=True)
async def test_an_idle_keys_budget_is_re_seeded_from_the_database(make_limiter, sync_thread_db):
    api_key = await sync_to_async(ApiKeyFactory)(budget_tokens=1000)
    limiter = make_limiter(budget_idle_seconds=0.2)
    await (await limiter.admit(api_key, reserved_tokens=100)).release(used_tokens=100)
    # Usage this counter never saw (another process's, or a release lost in a crash).
    month = month_start(timezone.now().date())
    await ApiKeyMonthlyUsage.objects.acreate(api_key=api_key, month=month, tokens=950)
    await (await limiter.admit(api_key, reserved_tokens=100)).release(used_tokens=0)
    await asyncio.sleep(0.3)
    with pytest.raises(RateLimitExceeded) as caught:
        await limiter.admit(api_key, reserved_tokens=100)
    assert caught.value.code == CODE_QUOTA


@pytest.mark.django_db(transaction=True)
async def test_a_flexible_request_gets_what_the_budget_has_left(make_limiter, sync_thread_db):
    api_key = await sync_to_async(ApiKeyFactory)(budget_tokens=1000)
    month = month_start(timezone.now().date())
    await ApiKeyMonthlyUsage.objects.acreate(api_key=api_key, month=month, tokens=400)
    limiter = make_limiter()
    held = await limiter.admit(api_key, reserved_tokens=8192, min_tokens=10)
    assert held.granted_tokens == 600
    with pytest.raises(RateLimitExceeded) as caught:
        await limiter.admit(api_key, reserved_tokens=8192, min_tokens=10)
    assert caught.value.code == CODE_QUOTA
    await held.release(used_tokens=595)
    last = await limiter.admit(api_key, reserved_tokens=8192, min_tokens=5)
    assert last.granted_tokens == 5


@pytest.mark.redis
@pytest.mark.django_db(transaction=True)
async def test_redis_budget_is_shared_by_processes(redis_namespace, sync_thread_db):
    api_key = await sync_to_async(ApiKeyFactory)(budget_tokens=500)
    first = RedisLimiter(url=TEST_REDIS_URL, namespace=redis_namespace)
    second = RedisLimiter(url=TEST_REDIS_URL, namespace=redis_namespace)
    try:
        held = await first.admit(api_key, reserved_tokens=300)
        with pytest.raises(RateLimitExceeded):
            await second.admit(api_key, reserved_tokens=300)
        await held.release(used_tokens=100)
        await second.admit(api_key, reserved_tokens=400)
    finally:
        first.close()
        second.close()


@pytest.mark.redis
@pytest.mark.django_db(transaction=True)
async def test_a_retried_release_counts_its_tokens_once(redis_namespace, sync_thread_db):
    api_key = await sync_to_async(ApiKeyFactory)(budget_tokens=1000)
    limiter = RedisLimiter(url=TEST_REDIS_URL, namespace=redis_namespace)
    try:
        admission = await limiter.admit(api_key, reserved_tokens=100)
        key_limits = await limits.base.limits_with_budgets(api_key)
        for _ in range(3):  # a release whose answer was lost, retried
            await limiter._release(key_limits, admission.id, 400, 0)
        held = await limiter.admit(api_key, reserved_tokens=600)
        with pytest.raises(RateLimitExceeded):
            await limiter.admit(api_key, reserved_tokens=1)
        await held.release(used_tokens=0)
    finally:
        limiter.close()
