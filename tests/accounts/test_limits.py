"""accounts.limits on both backends (the real Redis for `redis`), under real concurrency: many
tasks at once on one event loop, and several event-loop threads (and, for Redis, several limiter
instances standing for several processes) sharing the counters. The rate limits (rpm, tpm,
parallel slots), headers, cancellation and a backend that fails; the monthly budget is in
test_limits_budget.py."""

import asyncio
import threading
import time

import pytest
import redis
from asgiref.sync import sync_to_async
from django.test import override_settings

from accounts import limits
from accounts.limits import (
    CODE_QUOTA,
    CODE_RATE_LIMIT,
    ERROR_PARALLEL,
    ERROR_TOO_LARGE,
    InProcessLimiter,
    RateLimitExceeded,
    RedisLimiter,
    format_duration,
)
from tests.accounts.conftest import TEST_REDIS_URL, admissions_of, make_limited_key, try_admit
from tests.factories import ApiKeyFactory


def test_format_duration_matches_openai():
    assert format_duration(0) == "0s"
    assert format_duration(20) == "20ms"
    assert format_duration(1000) == "1s"
    assert format_duration(1500) == "1.5s"
    assert format_duration(360_000) == "6m0s"
    assert format_duration(3_600_000) == "1h0m0s"


async def test_unlimited_key_has_no_headers_and_no_state(make_limiter):
    limiter = make_limiter()
    admission = await limiter.admit(make_limited_key(), reserved_tokens=10**9)
    assert admission.headers == {}
    await admission.release(used_tokens=5)


async def test_fifty_simultaneous_requests_admit_exactly_max_parallel(make_limiter):
    limiter = make_limiter()
    api_key = make_limited_key(max_parallel=2)
    results = await asyncio.gather(*(try_admit(limiter, api_key) for _ in range(50)))
    admitted = admissions_of(results)
    assert len(admitted) == 2
    refusals = [r for r in results if isinstance(r, RateLimitExceeded)]
    assert len(refusals) == 48
    assert {r.code for r in refusals} == {CODE_RATE_LIMIT}
    assert refusals[0].message == ERROR_PARALLEL.format(limit=2)
    await admitted[0].release(used_tokens=1)
    assert len(admissions_of([await try_admit(limiter, api_key) for _ in range(3)])) == 1


async def test_never_more_than_max_parallel_while_fifty_requests_run(make_limiter):
    limiter = make_limiter()
    api_key = make_limited_key(max_parallel=2)
    running = 0
    peak = 0

    async def request():
        nonlocal running, peak
        while True:
            try:
                admission = await limiter.admit(api_key, reserved_tokens=1)
                break
            except RateLimitExceeded:
                await asyncio.sleep(0.001)
        running += 1
        peak = max(peak, running)
        try:
            await asyncio.sleep(0.002)
        finally:
            running -= 1
            await admission.release(used_tokens=1)

    await asyncio.wait_for(asyncio.gather(*(request() for _ in range(50))), 30)
    assert peak == 2


def test_max_parallel_holds_across_event_loop_threads_and_processes(make_limiter):
    """Four threads, each with its own event loop (and, for Redis, its own limiter instance as a
    separate process would have) fire 50 admissions in total at once."""
    shared = make_limiter()
    api_key = make_limited_key(max_parallel=2)
    start = threading.Barrier(4)
    admitted = []
    lock = threading.Lock()

    def worker():
        limiter = shared if make_limiter.backend == "in_process" else make_limiter()

        async def burst():
            return await asyncio.gather(*(try_admit(limiter, api_key) for _ in range(13)))

        start.wait()
        results = asyncio.run(burst())
        with lock:
            admitted.extend(admissions_of(results))

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(admitted) == 2


async def test_rpm_is_a_sliding_window(make_limiter):
    limiter = make_limiter(window_seconds=0.3)
    api_key = make_limited_key(rpm=3)
    results = await asyncio.gather(*(try_admit(limiter, api_key) for _ in range(10)))
    assert len(admissions_of(results)) == 3
    refusal = next(r for r in results if isinstance(r, RateLimitExceeded))
    assert refusal.limit == "requests"
    assert refusal.headers["x-ratelimit-remaining-requests"] == "0"
    assert 0 < int(refusal.headers["retry-after-ms"]) <= 300
    await asyncio.sleep(0.35)
    admission = await limiter.admit(api_key, reserved_tokens=1)
    assert admission.headers["x-ratelimit-remaining-requests"] == "2"


async def test_tpm_never_exceeded_by_concurrent_reservations(make_limiter):
    limiter = make_limiter()
    api_key = make_limited_key(tpm=1000)
    results = await asyncio.gather(*(try_admit(limiter, api_key, 100) for _ in range(50)))
    admitted = admissions_of(results)
    assert len(admitted) == 10
    assert admitted[-1].headers["x-ratelimit-remaining-tokens"] in {
        str(1000 - 100 * n) for n in range(1, 11)
    }
    refusal = next(r for r in results if isinstance(r, RateLimitExceeded))
    assert refusal.limit == "tokens"
    assert refusal.code == CODE_RATE_LIMIT


async def test_release_corrects_tpm_from_reserved_to_used(make_limiter):
    limiter = make_limiter()
    api_key = make_limited_key(tpm=1000)
    first = await limiter.admit(api_key, reserved_tokens=900)
    with pytest.raises(RateLimitExceeded):
        await limiter.admit(api_key, reserved_tokens=200)
    await first.release(used_tokens=300)
    await first.release(used_tokens=300)  # idempotent
    second = await limiter.admit(api_key, reserved_tokens=700)
    assert second.headers["x-ratelimit-remaining-tokens"] == "0"
    headers = await limiter.current_headers(api_key)
    assert headers["x-ratelimit-limit-tokens"] == "1000"
    assert headers["x-ratelimit-remaining-tokens"] == "0"


async def test_request_larger_than_tpm_is_refused_without_retry(make_limiter):
    limiter = make_limiter()
    api_key = make_limited_key(tpm=100)
    with pytest.raises(RateLimitExceeded) as caught:
        await limiter.admit(api_key, reserved_tokens=101)
    assert caught.value.message == ERROR_TOO_LARGE.format(limit=100, requested=101)
    assert caught.value.headers["x-should-retry"] == "false"


async def test_headers_on_admission_and_peek(make_limiter):
    limiter = make_limiter()
    api_key = make_limited_key(rpm=10, tpm=500)
    assert await limiter.current_headers(api_key) == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "10",
        "x-ratelimit-reset-requests": "0s",
        "x-ratelimit-limit-tokens": "500",
        "x-ratelimit-remaining-tokens": "500",
        "x-ratelimit-reset-tokens": "0s",
    }
    admission = await limiter.admit(api_key, reserved_tokens=50)
    assert admission.headers == {
        "x-ratelimit-limit-requests": "10",
        "x-ratelimit-remaining-requests": "9",
        "x-ratelimit-reset-requests": "1m0s",
        "x-ratelimit-limit-tokens": "500",
        "x-ratelimit-remaining-tokens": "450",
        "x-ratelimit-reset-tokens": "1m0s",
    }


async def test_a_refusal_reserves_nothing(make_limiter):
    limiter = make_limiter()
    api_key = make_limited_key(rpm=5, tpm=100, max_parallel=1)
    held = await limiter.admit(api_key, reserved_tokens=10)
    for _ in range(3):
        with pytest.raises(RateLimitExceeded):
            await limiter.admit(api_key, reserved_tokens=10)  # parallel refuses
    headers = await limiter.current_headers(api_key)
    assert headers["x-ratelimit-remaining-requests"] == "4"
    assert headers["x-ratelimit-remaining-tokens"] == "90"
    await held.release(used_tokens=10)


async def test_cancelled_request_still_releases(make_limiter):
    limiter = make_limiter()
    api_key = make_limited_key(max_parallel=1)

    async def request():
        admission = await limiter.admit(api_key, reserved_tokens=1)
        try:
            await asyncio.sleep(10)
        finally:
            await asyncio.shield(admission.release(used_tokens=1))

    task = asyncio.create_task(request())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0.05)  # a shielded Redis release finishes on its own
    admission = await limiter.admit(api_key, reserved_tokens=1)
    await admission.release(used_tokens=1)


async def test_a_crashed_holders_parallel_slot_comes_back_after_its_lease(make_limiter):
    limiter = make_limiter(lease_seconds=0.2)
    api_key = make_limited_key(max_parallel=1)
    await limiter.admit(api_key, reserved_tokens=1)  # never released: its process "crashed"
    with pytest.raises(RateLimitExceeded):
        await limiter.admit(api_key, reserved_tokens=1)
    await asyncio.sleep(0.25)
    await limiter.admit(api_key, reserved_tokens=1)


@pytest.mark.redis
async def test_redis_counters_expire(redis_namespace):
    limiter = RedisLimiter(url=TEST_REDIS_URL, namespace=redis_namespace)
    try:
        api_key = make_limited_key(rpm=5, tpm=50, max_parallel=2)
        await limiter.admit(api_key, reserved_tokens=5)
        client = redis.Redis.from_url(TEST_REDIS_URL)
        names = list(client.scan_iter(match=f"{redis_namespace}*"))
        assert len(names) == 4  # rpm, tpm, its tokens, the parallel leases
        assert all(0 < client.pttl(name) for name in names)
        client.close()
    finally:
        limiter.close()


async def test_admission_cancelled_mid_check_reserves_nothing(make_limiter):
    """A client that disconnects while its admission is in flight leaves no reservation."""
    limiter = make_limiter()
    api_key = make_limited_key(max_parallel=1, tpm=100)
    for _ in range(20):
        task = asyncio.create_task(limiter.admit(api_key, reserved_tokens=60))
        await asyncio.sleep(0)
        task.cancel()
        try:
            admission = await task
        except asyncio.CancelledError:
            pass
        else:
            await admission.release(used_tokens=0)
        # The undo runs once the check it follows has finished (in Redis's thread, which a
        # loaded machine may not run for a while): it lands within seconds, while a reservation
        # left behind would hold the key's tokens for the whole minute.
        admission = await _admitted_within(limiter, api_key, 60, seconds=5.0)
        await admission.release(used_tokens=0)


async def _admitted_within(limiter, api_key, tokens, *, seconds):
    deadline = time.monotonic() + seconds
    while True:
        try:
            return await limiter.admit(api_key, reserved_tokens=tokens)
        except RateLimitExceeded:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.02)


@pytest.mark.django_db(transaction=True)
async def test_in_process_state_of_idle_keys_is_evicted(sync_thread_db):
    """Memory follows the active keys: counters of keys idle past the window (and budgets idle past
    their idle time) go; a key with a request in flight keeps its state."""
    # Windows long enough that no key goes idle while the 50 are admitted (on a loaded machine
    # with PostgreSQL, 0.1 s was not), the keys made before the clock starts.
    limiter = InProcessLimiter(window_seconds=2.0, budget_idle_seconds=2.0)
    keys = [make_limited_key(rpm=10, tpm=1000, budget_tokens=10**6) for _ in range(50)]
    busy = make_limited_key(max_parallel=1)
    for api_key in keys:
        await (await limiter.admit(api_key, reserved_tokens=10)).release(used_tokens=5)
    await limiter.admit(busy, reserved_tokens=1)
    assert (len(limiter._keys), len(limiter._budgets)) == (51, 50)
    await asyncio.sleep(2.2)
    await limiter.current_headers(make_limited_key(rpm=1))
    assert list(limiter._keys) == [busy.prefix] and not limiter._budgets
    with pytest.raises(RateLimitExceeded):
        await limiter.admit(busy, reserved_tokens=1)


def test_get_limiter_follows_redis_url():
    with override_settings(REDIS_URL=None):
        assert isinstance(limits.get_limiter(), InProcessLimiter)
    with override_settings(REDIS_URL=TEST_REDIS_URL):
        assert isinstance(limits.get_limiter(), RedisLimiter)


async def test_a_flexible_request_gets_what_the_tpm_window_has_left(make_limiter):
    limiter = make_limiter()
    api_key = make_limited_key(tpm=1000)
    # Below the window: the whole reservation (a request whose max_tokens was omitted asks for
    # the rest of the context, 8000 tokens here).
    first = await limiter.admit(api_key, reserved_tokens=8000, min_tokens=50)
    assert first.granted_tokens == 1000
    await first.release(used_tokens=300)
    second = await limiter.admit(api_key, reserved_tokens=8000, min_tokens=50)
    assert second.granted_tokens == 700
    assert second.headers["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(RateLimitExceeded) as caught:
        await limiter.admit(api_key, reserved_tokens=8000, min_tokens=50)
    assert caught.value.limit == "tokens"
    # A request that fixed its size still gets all of it or nothing.
    await second.release(used_tokens=0)
    with pytest.raises(RateLimitExceeded):
        await limiter.admit(api_key, reserved_tokens=800)
    exact = await limiter.admit(api_key, reserved_tokens=700)
    assert exact.granted_tokens == 700


@pytest.mark.django_db(transaction=True)
async def test_an_entry_counts_the_request_and_holds_a_slot_but_no_tokens(
    make_limiter, sync_thread_db
):
    limiter = make_limiter()
    api_key = await sync_to_async(ApiKeyFactory)(rpm=3, tpm=1000, max_parallel=1, budget_tokens=100)
    entered = await limiter.enter(api_key)
    assert entered.granted_tokens == 0
    assert entered.headers["x-ratelimit-remaining-requests"] == "2"
    assert entered.headers["x-ratelimit-remaining-tokens"] == "1000"
    with pytest.raises(RateLimitExceeded) as caught:
        await limiter.enter(api_key)  # the entry holds the one parallel slot
    assert caught.value.limit == "parallel"
    await entered.reserve(reserved_tokens=500, min_tokens=10)  # a flexible request
    assert entered.granted_tokens == 100  # what the budget has left
    assert entered.headers["x-ratelimit-remaining-tokens"] == "900"
    await entered.release(used_tokens=100)  # the whole budget
    with pytest.raises(RateLimitExceeded) as caught:
        await limiter.enter(api_key)
    assert caught.value.code == CODE_QUOTA
    headers = await limiter.current_headers(api_key)
    assert headers["x-ratelimit-remaining-requests"] == "2"  # refused entries count nothing


async def test_an_entered_request_spends_its_request_whatever_becomes_of_it(make_limiter):
    limiter = make_limiter()
    api_key = make_limited_key(rpm=2, tpm=50, max_parallel=1)
    first = await limiter.enter(api_key)
    with pytest.raises(RateLimitExceeded) as caught:
        await first.reserve(reserved_tokens=80)
    assert caught.value.message == ERROR_TOO_LARGE.format(limit=50, requested=80)
    await first.release(used_tokens=0)  # the slot comes back...
    second = await limiter.enter(api_key)  # (a request that ends in a 400, say)
    await second.release(used_tokens=0)
    with pytest.raises(RateLimitExceeded) as caught:
        await limiter.enter(api_key)  # ...but both requests counted in the rpm window
    assert caught.value.limit == "requests"
    headers = await limiter.current_headers(api_key)
    assert headers["x-ratelimit-remaining-tokens"] == "50"  # and no tokens were left reserved


async def test_a_redis_that_does_not_answer_raises_limiter_unavailable(silent_redis):
    for call in (
        lambda limiter, api_key: limiter.admit(api_key, reserved_tokens=1),
        lambda limiter, api_key: limiter.enter(api_key),
        lambda limiter, api_key: limiter.current_headers(api_key),
    ):
        limiter = RedisLimiter(url=silent_redis, timeout_seconds=0.3)
        api_key = make_limited_key(rpm=10)
        try:
            async with asyncio.timeout(5):
                with pytest.raises(limits.LimiterUnavailable):
                    await call(limiter, api_key)
            # Right after, calls fail at once instead of each waiting out the timeout.
            started = time.monotonic()
            with pytest.raises(limits.LimiterUnavailable):
                await limiter.enter(api_key)
            assert time.monotonic() - started < 0.2
        finally:
            limiter.close()


@pytest.mark.redis
async def test_an_admission_whose_answer_was_lost_is_undone(redis_namespace):
    class LostAnswers(RedisLimiter):
        async def _check(self, *args):
            await super()._check(*args)  # Redis reserved...
            raise limits.LimiterUnavailable("...and the answer timed out")

    lossy = LostAnswers(url=TEST_REDIS_URL, namespace=redis_namespace)
    healthy = RedisLimiter(url=TEST_REDIS_URL, namespace=redis_namespace)
    api_key = make_limited_key(max_parallel=1)
    try:
        with pytest.raises(limits.LimiterUnavailable):
            await lossy.admit(api_key, reserved_tokens=5)
        async with asyncio.timeout(5):
            while True:  # the undo runs in the background
                result = await try_admit(healthy, api_key)
                if isinstance(result, limits.Admission):
                    break
                await asyncio.sleep(0.05)
        await result.release(used_tokens=0)
    finally:
        lossy.close()
        healthy.close()
