"""The token buckets of request-body bytes (common/body_rate.py), on a clock the test moves."""

import pytest

from common.body_rate import ByteBuckets


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_bucket_lets_its_burst_through_then_owes_at_its_rate():
    clock = Clock()
    buckets = ByteBuckets(rate=1000, burst=4000, clock=clock)
    assert buckets.spend("a", 4000) == 0.0  # a quiet team's burst: no wait
    assert buckets.spend("a", 500) == pytest.approx(0.5)  # in debt: half a second of it
    assert buckets.spend("b", 4000) == 0.0  # another bucket is untouched
    clock.now += 0.5
    assert buckets.level("a") == pytest.approx(0.0)
    clock.now += 60
    assert buckets.level("a") == 4000  # refilled, never past the burst
    assert buckets.spend("a", 1) == 0.0


def test_debt_adds_up_across_spenders_of_one_bucket():
    clock = Clock()
    buckets = ByteBuckets(rate=1000, burst=1000, clock=clock)
    buckets.spend("a", 1000)
    assert buckets.spend("a", 1000) == pytest.approx(1.0)
    assert buckets.spend("a", 1000) == pytest.approx(2.0)  # a second connection's chunk


def test_the_buckets_kept_stay_bounded_and_full_ones_go_first():
    clock = Clock()
    buckets = ByteBuckets(rate=1000, burst=1000, clock=clock, max_buckets=10)
    buckets.spend("owing", 5000)  # four seconds of debt
    for index in range(20):
        buckets.spend(f"quiet-{index}", 1)
        clock.now += 0.01
    assert len(buckets._buckets) <= 10
    assert buckets.level("owing") < 0  # the debt is not forgotten while newer full ones go


def test_a_rate_and_a_burst_must_be_positive():
    with pytest.raises(ValueError):
        ByteBuckets(rate=0, burst=10)
    with pytest.raises(ValueError):
        ByteBuckets(rate=10, burst=0)
