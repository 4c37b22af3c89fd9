"""What a key used of its limits, as the pages show it: the limiter's counters read without
counting anything (requests and tokens in the window, requests running), on both backends."""

from tests.accounts.conftest import make_limited_key


async def test_current_use_counts_nothing_and_sees_what_runs(make_limiter):
    limiter = make_limiter()
    api_key = make_limited_key(rpm=10, tpm=1000, max_parallel=3)
    first = await limiter.admit(api_key, reserved_tokens=100)
    await limiter.admit(api_key, reserved_tokens=50)
    for _ in range(2):  # reading twice counts nothing
        use = await limiter.current_use(api_key)
        assert (use.requests, use.tokens, use.inflight) == (2, 150, 2)
    await first.release(used_tokens=40)
    use = await limiter.current_use(api_key)
    assert (use.requests, use.tokens, use.inflight) == (2, 90, 1)
    unlimited = await limiter.current_use(make_limited_key())
    assert (unlimited.requests, unlimited.tokens, unlimited.inflight) == (0, 0, 0)
