"""inference.services.usage: every request ends with exactly one finished row, roll-ups equal the
rows, and the start-up sweep is safe to run from several processes at once."""

import random
import threading
from collections import Counter, defaultdict
from datetime import timedelta

import pytest
from django.db import connection
from django.db.models import Sum
from django.utils import timezone

from accounts.limits import PARALLEL_LEASE_SECONDS
from accounts.models import ApiKey, ApiKeyMonthlyUsage, Team
from accounts.selectors import month_start
from inference.models import DailyUsage, UsageRecord
from inference.services.usage import (
    ERROR_SERVER_RESTARTED,
    USAGE_STALE_AFTER,
    usage_close_stale,
    usage_finish,
    usage_open,
    usage_records_visible_to,
    usage_refusals_add,
    usage_totals,
)
from tests.factories import ApiKeyFactory, MembershipFactory, UsageRecordFactory, UserFactory

Status = UsageRecord.Status


def _in_threads(target, num_threads: int) -> list:
    """Run target() in threads released together; each closes its own DB connection."""
    barrier = threading.Barrier(num_threads)
    results, errors = [], []

    def run():
        try:
            barrier.wait()
            results.append(target())
        except Exception as exc:
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(num_threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    return results


def _recompute_daily(refused: Counter) -> dict:
    """The daily roll-ups as they should be, from the finished rows and the refusals counted."""
    expected = defaultdict(Counter)
    for bucket, count in refused.items():
        expected[bucket]["num_requests"] += count
        expected[bucket]["num_rejected"] += count
    for row in UsageRecord.objects.exclude(status=Status.IN_PROGRESS):
        bucket = expected[(row.started_at.date(), row.team_id, row.api_key_id, row.model)]
        bucket["num_requests"] += 1
        bucket[f"num_{row.status}"] += 1
        bucket["prompt_tokens"] += row.prompt_tokens
        bucket["cached_tokens"] += row.cached_tokens
        bucket["completion_tokens"] += row.completion_tokens
    return {key: {k: v for k, v in c.items() if v} for key, c in expected.items()}


def _stored_daily() -> dict:
    fields = [
        "num_requests",
        "num_completed",
        "num_cancelled",
        "num_failed",
        "num_rejected",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
    ]
    stored = {}
    for d in DailyUsage.objects.all():
        values = {f: getattr(d, f) for f in fields if getattr(d, f)}
        if values:
            stored[(d.date, d.team_id, d.api_key_id, d.model)] = values
    return stored


def _assert_roll_ups_match_rows(refused: Counter | None = None) -> None:
    assert _stored_daily() == _recompute_daily(refused or Counter())
    rows = UsageRecord.objects.exclude(status=Status.IN_PROGRESS)
    by_key_month = Counter()
    for row in rows:
        by_key_month[(row.api_key_id, month_start(row.started_at.date()))] += (
            row.prompt_tokens + row.completion_tokens
        )
    stored = {
        (m.api_key_id, m.month): m.tokens for m in ApiKeyMonthlyUsage.objects.all() if m.tokens
    }
    assert stored == {k: v for k, v in by_key_month.items() if v}


@pytest.mark.django_db
def test_finish_records_tokens_and_rolls_up():
    api_key = ApiKeyFactory()
    record = usage_open(request_id="r1", api_key=api_key, model="m", endpoint="/v1/chat")
    assert record.status == Status.IN_PROGRESS
    assert usage_finish(
        record_id=record.pk,
        status=Status.COMPLETED,
        prompt_tokens=10,
        cached_tokens=4,
        completion_tokens=7,
        time_to_first_token_ms=12,
    )
    record.refresh_from_db()
    assert (record.status, record.total_tokens, record.time_to_first_token_ms) == (
        Status.COMPLETED,
        17,
        12,
    )
    assert record.finished_at is not None and record.duration_ms is not None
    daily = DailyUsage.objects.get()
    assert (daily.num_requests, daily.num_completed, daily.prompt_tokens) == (1, 1, 10)
    assert ApiKeyMonthlyUsage.objects.get(api_key=api_key).tokens == 17


@pytest.mark.django_db
def test_a_second_finish_changes_nothing():
    record = UsageRecordFactory()
    assert usage_finish(record_id=record.pk, status=Status.CANCELLED, completion_tokens=3)
    assert not usage_finish(record_id=record.pk, status=Status.COMPLETED, completion_tokens=99)
    record.refresh_from_db()
    assert (record.status, record.completion_tokens) == (Status.CANCELLED, 3)
    _assert_roll_ups_match_rows()


@pytest.mark.django_db
def test_finish_refuses_an_unfinished_status():
    record = UsageRecordFactory()
    with pytest.raises(ValueError):
        usage_finish(record_id=record.pk, status=Status.IN_PROGRESS)


@pytest.mark.django_db(transaction=True)
def test_exactly_one_of_concurrent_finishes_wins():
    record = UsageRecordFactory()
    outcomes = _in_threads(
        lambda: usage_finish(
            record_id=record.pk,
            status=random.choice([Status.COMPLETED, Status.CANCELLED]),
            prompt_tokens=5,
            completion_tokens=random.randint(1, 9),
        ),
        num_threads=8,
    )
    assert sorted(outcomes) == [False] * 7 + [True]
    assert DailyUsage.objects.get().num_requests == 1
    _assert_roll_ups_match_rows()


@pytest.mark.django_db(transaction=True)
def test_many_rows_finished_at_once_all_land():
    """Concurrent writers, each in its own connection, as under daphne (a thread per request):
    on SQLite this fails with "database is locked" unless every transaction takes the write lock
    up front and waits for it (config/settings.py's SQLITE_OPTIONS)."""
    api_key = ApiKeyFactory()
    rows = [UsageRecordFactory(api_key=api_key, team=api_key.team).pk for _ in range(160)]
    batches = iter([rows[i::8] for i in range(8)])
    lock = threading.Lock()

    def finish_batch() -> int:
        with lock:
            batch = next(batches)
        return sum(
            usage_finish(
                record_id=pk, status=Status.COMPLETED, prompt_tokens=3, completion_tokens=2
            )
            for pk in batch
        )

    assert sum(_in_threads(finish_batch, num_threads=8)) == 160
    assert DailyUsage.objects.get().num_completed == 160
    _assert_roll_ups_match_rows()


@pytest.mark.django_db
def test_refusals_are_counted_in_the_roll_ups_without_rows():
    api_key = ApiKeyFactory()
    today = timezone.now().date()
    bucket = (today, api_key.team_id, api_key.pk, "m")
    usage_refusals_add(counts={bucket: 3})
    usage_refusals_add(counts={bucket: 2, (today, api_key.team_id, api_key.pk, ""): 1})
    assert not UsageRecord.objects.exists()
    daily = DailyUsage.objects.get(model="m")
    assert (daily.num_requests, daily.num_rejected, daily.prompt_tokens) == (5, 5, 0)
    assert DailyUsage.objects.get(model="").num_rejected == 1


@pytest.mark.django_db
def test_roll_ups_recomputed_from_rows_are_equal():
    rng = random.Random(5)
    keys = [ApiKeyFactory() for _ in range(3)]
    refused = Counter()
    for n in range(60):
        api_key = rng.choice(keys)
        model = rng.choice(["a", "b"])
        if rng.random() < 0.15:
            usage_refusals_add(
                counts={(timezone.now().date(), api_key.team_id, api_key.pk, model): 1}
            )
            refused[(timezone.now().date(), api_key.team_id, api_key.pk, model)] += 1
            continue
        record = usage_open(request_id=f"r{n}", api_key=api_key, model=model, endpoint="/v1/x")
        if rng.random() < 0.1:
            continue  # still running
        usage_finish(
            record_id=record.pk,
            status=rng.choice([Status.COMPLETED, Status.CANCELLED, Status.FAILED]),
            prompt_tokens=rng.randint(0, 50),
            cached_tokens=rng.randint(0, 5),
            completion_tokens=rng.randint(0, 50),
        )
    _assert_roll_ups_match_rows(refused)


@pytest.mark.django_db
def test_sweep_closes_stale_rows_as_failed():
    old = UsageRecordFactory(started_at=timezone.now() - USAGE_STALE_AFTER - timedelta(minutes=1))
    done = UsageRecordFactory(started_at=old.started_at)
    usage_finish(record_id=done.pk, status=Status.COMPLETED, completion_tokens=2)
    assert usage_close_stale() == 1
    old.refresh_from_db()
    assert (old.status, old.error_code) == (Status.FAILED, ERROR_SERVER_RESTARTED)
    assert usage_close_stale() == 0
    _assert_roll_ups_match_rows()


@pytest.mark.django_db
def test_sweep_by_default_spares_rows_a_live_process_may_own():
    """bootstrap sweeps with the default while other processes serve: their running requests,
    long generations included, stay in progress."""
    fresh = UsageRecordFactory()
    long_running = UsageRecordFactory(started_at=timezone.now() - timedelta(minutes=50))
    assert USAGE_STALE_AFTER >= timedelta(seconds=PARALLEL_LEASE_SECONDS)
    assert usage_close_stale() == 0
    for record in (fresh, long_running):
        record.refresh_from_db()
        assert record.status == Status.IN_PROGRESS


@pytest.mark.django_db
def test_sweep_spares_rows_younger_than_the_grace():
    UsageRecordFactory()
    assert usage_close_stale(older_than=timedelta(hours=1)) == 0
    assert usage_close_stale(older_than=timedelta(0)) == 1


@pytest.mark.django_db
def test_a_late_real_finish_replaces_the_sweep():
    """Another process's sweep closed a live row: its own finish still records the truth."""
    record = UsageRecordFactory()
    usage_close_stale(older_than=timedelta(0))
    assert usage_finish(
        record_id=record.pk, status=Status.COMPLETED, prompt_tokens=4, completion_tokens=6
    )
    record.refresh_from_db()
    assert (record.status, record.error_code, record.total_tokens) == (Status.COMPLETED, "", 10)
    daily = DailyUsage.objects.get()
    assert (daily.num_requests, daily.num_failed, daily.num_completed) == (1, 0, 1)
    assert not usage_finish(record_id=record.pk, status=Status.FAILED)
    _assert_roll_ups_match_rows()


@pytest.mark.django_db(transaction=True)
def test_concurrent_sweeps_close_each_row_once():
    api_key = ApiKeyFactory()
    for n in range(20):
        UsageRecordFactory(api_key=api_key, request_id=f"s{n}")
    closed = _in_threads(lambda: usage_close_stale(older_than=timedelta(0)), num_threads=4)
    assert sum(closed) == 20
    assert DailyUsage.objects.aggregate(n=Sum("num_failed"))["n"] == 20
    _assert_roll_ups_match_rows()


@pytest.mark.django_db
def test_team_members_see_only_their_teams_usage():
    alice, bob = UserFactory(), UserFactory()
    team_a = MembershipFactory(user=alice).team
    team_b = MembershipFactory(user=bob).team
    record_a = UsageRecordFactory(api_key=ApiKeyFactory(team=team_a, user=alice))
    record_b = UsageRecordFactory(api_key=ApiKeyFactory(team=team_b, user=bob))
    assert list(usage_records_visible_to(user=alice)) == [record_a]
    assert list(usage_records_visible_to(user=bob)) == [record_b]


@pytest.mark.django_db
def test_totals_per_team_and_key_come_from_roll_ups():
    api_key = ApiKeyFactory()
    for n in range(3):
        record = UsageRecordFactory(api_key=api_key)
        usage_finish(
            record_id=record.pk, status=Status.COMPLETED, prompt_tokens=n, completion_tokens=1
        )
    other = ApiKeyFactory()
    usage_finish(record_id=UsageRecordFactory(api_key=other).pk, status=Status.COMPLETED)
    day = record.started_at.date()
    every = {"teams": Team.objects.all(), "api_keys": ApiKey.objects.all()}
    totals = usage_totals(daily=DailyUsage.objects.all(), since=day, until=day, **every)
    by_team = {row["team_id"]: row["num_requests"] for row in totals["teams"]}
    assert by_team == {api_key.team_id: 3, other.team_id: 1}
    mine = next(row for row in totals["keys"] if row["api_key_id"] == api_key.pk)
    assert (mine["prompt_tokens"], mine["completion_tokens"]) == (3, 3)
    # What a reader may see narrows each table; None leaves a table out.
    narrowed = usage_totals(
        daily=DailyUsage.objects.all(),
        since=day,
        until=day,
        teams=Team.objects.filter(pk=other.team_id),
        api_keys=None,
    )
    assert [row["team_id"] for row in narrowed["teams"]] == [other.team_id]
    assert narrowed["keys"] is None


@pytest.mark.django_db
def test_images_are_billed_only_when_the_prompt_ran():
    from decimal import Decimal

    from inference.models import ModelEntry
    from inference.prices import ModelPrice
    from inference.services.usage import usage_finish, usage_open

    entry = ModelEntry.objects.create(name="vision-priced", path="/x")
    ModelPrice.objects.create(
        model=entry,
        effective_from=timezone.now() - timedelta(days=1),
        input_per_million=Decimal("0"),
        output_per_million=Decimal("0"),
        per_image=Decimal("0.01"),
    )
    key = ApiKeyFactory()
    ran = usage_open(request_id="r1", api_key=key, model=entry.name, endpoint="chat", images=2)
    usage_finish(record_id=ran.pk, status=UsageRecord.Status.COMPLETED, prompt_tokens=30)
    waited = usage_open(request_id="r2", api_key=key, model=entry.name, endpoint="chat", images=2)
    usage_finish(record_id=waited.pk, status=UsageRecord.Status.CANCELLED)
    ran.refresh_from_db()
    waited.refresh_from_db()
    assert (ran.images, ran.input_cost) == (2, 2 * 10_000_000)
    assert (waited.images, waited.input_cost) == (2, 0)
