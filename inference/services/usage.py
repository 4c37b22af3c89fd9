"""Usage accounting: a row opened at admission, finished exactly once with its cost (at the price
its request was admitted at: inference/services/prices.py), rolled up daily (and into the key's
month, which the budget limiter seeds from) in the same transaction.

A row left in progress by a crashed process is closed by `usage_close_stale` as failed with
ERROR_SERVER_RESTARTED. In a deployment of several processes a starting process cannot tell a
dead process's rows from a live one's, so a real finish arriving later still wins: it replaces
the sweep's verdict and corrects the roll-ups. Either way the row is finished once and counted
once.
"""

import datetime
from collections.abc import Mapping

from django.contrib.auth.models import AbstractBaseUser
from django.db import transaction
from django.db.models import F, Q, QuerySet, Sum
from django.utils import timezone

from accounts.limits import PARALLEL_LEASE_SECONDS
from accounts.models import ApiKey, Team
from accounts.selectors import month_start, teams_visible_to
from accounts.services import api_key_monthly_usage_add
from inference.models import DailyUsage, UsageRecord
from inference.services.prices import Price, price_at

ERROR_SERVER_RESTARTED = "server_restarted"
DEFAULT_TIER = "default"
# A starting process cannot tell a crashed process's rows from a live one's, so by default it
# sweeps only rows as old as the parallel-slot lease: the limiter already treats a request that
# outlived it as abandoned (its slot is given back), and no real generation runs that long. The
# two agree on when a request counts as dead, and a live row swept anyway is still corrected by
# its real finish.
USAGE_STALE_AFTER = datetime.timedelta(seconds=PARALLEL_LEASE_SECONDS)

_STATUS_COUNTERS = {
    UsageRecord.Status.COMPLETED: "num_completed",
    UsageRecord.Status.CANCELLED: "num_cancelled",
    UsageRecord.Status.FAILED: "num_failed",
    UsageRecord.Status.REJECTED: "num_rejected",
}


def _record(
    *, request_id: str, api_key: ApiKey, model: str, endpoint: str, **fields
) -> UsageRecord:
    return UsageRecord.objects.create(
        request_id=request_id,
        api_key=api_key,
        team_id=api_key.team_id,
        user_id=api_key.user_id,
        model=model,
        endpoint=endpoint,
        **fields,
    )


def usage_open(
    *,
    request_id: str,
    api_key: ApiKey,
    model: str,
    endpoint: str,
    reserved_tokens: int = 0,
    service_tier: str = DEFAULT_TIER,
    batch_id: str = "",
    images: int = 0,
) -> UsageRecord:
    return _record(
        request_id=request_id,
        api_key=api_key,
        model=model,
        endpoint=endpoint,
        reserved_tokens=reserved_tokens,
        images=images,
        service_tier=service_tier,
        batch_id=batch_id,
        started_at=timezone.now(),
    )


# A day's refusals of one key for one model: (date, team id, key id, model).
RefusalBucket = tuple[datetime.date, int, int, str]


@transaction.atomic
def usage_refusals_add(*, counts: Mapping[RefusalBucket, int]) -> None:
    """Requests a limit refused, added to the day's roll-ups (`num_requests` and
    `num_rejected`, what the reports show) without a row each: a flood of refusals costs one
    write per key and model per flush (inference/services/refusals.py), not one per request.
    A refusal comes before the body, and its service tier, is read: it counts as default. A key
    deleted meanwhile has no roll-up to count in: its refusals are dropped."""
    keys = {api_key_id for _, _, api_key_id, _ in counts}
    existing = set(ApiKey.objects.filter(pk__in=keys).values_list("pk", flat=True))
    for (day, team_id, api_key_id, model), count in sorted(counts.items()):
        if api_key_id not in existing:
            continue
        daily, _ = DailyUsage.objects.select_for_update().get_or_create(
            date=day, team_id=team_id, api_key_id=api_key_id, model=model, service_tier=DEFAULT_TIER
        )
        DailyUsage.objects.filter(pk=daily.pk).update(
            num_requests=F("num_requests") + count, num_rejected=F("num_rejected") + count
        )


@transaction.atomic
def usage_record_finished(
    *,
    request_id: str,
    api_key: ApiKey,
    model: str,
    endpoint: str,
    status: str,
    started_at: datetime.datetime,
    prompt_tokens: int = 0,
    error_code: str = "",
    service_tier: str = DEFAULT_TIER,
) -> UsageRecord:
    """A row written once, finished, for a request that does not stream, rolled up at once."""
    now = timezone.now()
    cost = price_at(model=model, at=started_at).cost(
        prompt_tokens=prompt_tokens, cached_tokens=0, completion_tokens=0
    )
    record = _record(
        request_id=request_id,
        api_key=api_key,
        model=model,
        endpoint=endpoint,
        status=status,
        error_code=error_code,
        prompt_tokens=prompt_tokens,
        service_tier=service_tier,
        duration_ms=int((now - started_at).total_seconds() * 1000),
        started_at=started_at,
        finished_at=now,
        input_cost=cost.input,
    )
    _roll_up(record, sign=1)
    return record


@transaction.atomic
def usage_finish(
    *,
    record_id: int,
    status: str,
    prompt_tokens: int = 0,
    cached_tokens: int = 0,
    completion_tokens: int = 0,
    time_to_first_token_ms: int | None = None,
    error_code: str = "",
    finished_at: datetime.datetime | None = None,
    price: Price | None = None,
) -> bool:
    """Finish an open row with its cost and roll it up, in one transaction. `price` is the one
    the request was admitted at (None: the model's price when the row started). Returns False
    (and changes nothing) when the row was already finished, so a retry or a racing finish can
    never count twice. A row closed by the start-up sweep is the exception: the real finish
    replaces the sweep's."""
    if status not in _STATUS_COUNTERS:
        raise ValueError(f"Cannot finish a usage row as {status!r}.")
    record = UsageRecord.objects.select_for_update().get(pk=record_id)
    swept = (
        record.status == UsageRecord.Status.FAILED and record.error_code == ERROR_SERVER_RESTARTED
    )
    if record.status != UsageRecord.Status.IN_PROGRESS and not swept:
        return False
    if swept:
        _roll_up(record, sign=-1)
    now = finished_at or timezone.now()  # a retried write keeps the time the request ended
    record.status = status
    record.prompt_tokens = prompt_tokens
    record.cached_tokens = cached_tokens
    record.completion_tokens = completion_tokens
    record.time_to_first_token_ms = time_to_first_token_ms
    record.duration_ms = int((now - record.started_at).total_seconds() * 1000)
    record.error_code = error_code
    record.finished_at = now
    _price(record, price)
    record.save()
    _roll_up(record, sign=1)
    return True


def _price(record: UsageRecord, price: Price | None) -> None:
    """Write the row's cost for its tokens."""
    if price is None:
        price = price_at(model=record.model, at=record.started_at)
    cost = price.cost(
        prompt_tokens=record.prompt_tokens,
        cached_tokens=record.cached_tokens,
        completion_tokens=record.completion_tokens,
        # Images are billed once the prompt ran (a request refused or cancelled while it
        # waited read none of them).
        images=record.images if record.prompt_tokens else 0,
    )
    record.input_cost = cost.input
    record.cached_input_cost = cost.cached_input
    record.output_cost = cost.output


def _roll_up(record: UsageRecord, *, sign: int) -> None:
    day: datetime.date = record.started_at.date()
    daily, _ = DailyUsage.objects.select_for_update().get_or_create(
        date=day,
        team_id=record.team_id,
        api_key_id=record.api_key_id,
        model=record.model,
        service_tier=record.service_tier,
        batch=bool(record.batch_id),
    )
    counter = _STATUS_COUNTERS[record.status]
    DailyUsage.objects.filter(pk=daily.pk).update(
        num_requests=F("num_requests") + sign,
        prompt_tokens=F("prompt_tokens") + sign * record.prompt_tokens,
        cached_tokens=F("cached_tokens") + sign * record.cached_tokens,
        completion_tokens=F("completion_tokens") + sign * record.completion_tokens,
        images=F("images") + sign * record.images,
        input_cost=F("input_cost") + sign * record.input_cost,
        cached_input_cost=F("cached_input_cost") + sign * record.cached_input_cost,
        output_cost=F("output_cost") + sign * record.output_cost,
        **{counter: F(counter) + sign},
    )
    tokens = record.prompt_tokens + record.completion_tokens
    if tokens:
        api_key_monthly_usage_add(
            api_key_id=record.api_key_id, month=month_start(day), tokens=sign * tokens
        )


@transaction.atomic
def usage_discard(*, request_id: str) -> bool:
    """Remove a request's row, and its roll-up if it was finished: a run whose answer was lost
    and that runs again under the same request id (a batch's line after its runner stopped), so
    that it is counted and billed once. False when there was no row."""
    record = UsageRecord.objects.select_for_update().filter(request_id=request_id).first()
    if record is None:
        return False
    if record.status != UsageRecord.Status.IN_PROGRESS:
        _roll_up(record, sign=-1)
    record.delete()
    return True


def usage_close_stale(*, older_than: datetime.timedelta = USAGE_STALE_AFTER) -> int:
    """Finish rows left in progress (by a crashed process) as failed, if they started more than
    `older_than` ago; run at start-up. Several processes may sweep at once: each row is taken
    under a row lock, rows another sweeper or a live finish holds are skipped, and a row is
    closed at most once. Returns how many it closed."""
    cutoff = timezone.now() - older_than
    stale = list(
        UsageRecord.objects.filter(
            status=UsageRecord.Status.IN_PROGRESS, started_at__lte=cutoff
        ).values_list("pk", flat=True)
    )
    closed = 0
    for pk in stale:
        with transaction.atomic():
            record = (
                UsageRecord.objects.select_for_update(skip_locked=True)
                .filter(pk=pk, status=UsageRecord.Status.IN_PROGRESS)
                .first()
            )
            if record is None:
                continue
            now = timezone.now()
            record.status = UsageRecord.Status.FAILED
            record.error_code = ERROR_SERVER_RESTARTED
            record.duration_ms = int((now - record.started_at).total_seconds() * 1000)
            record.finished_at = now
            _price(record, None)  # the tokens it last wrote, at its start's price
            record.save()
            _roll_up(record, sign=1)
            closed += 1
    return closed


# Reads. Any member of a team sees all of the team's usage (accounts.selectors has the rules).


def usage_records_visible_to(*, user: AbstractBaseUser) -> QuerySet[UsageRecord]:
    if user.is_superuser:
        return UsageRecord.objects.all()
    return UsageRecord.objects.filter(team__in=teams_visible_to(user=user))


def daily_usage_visible_to(*, user: AbstractBaseUser) -> QuerySet[DailyUsage]:
    if user.is_superuser:
        return DailyUsage.objects.all()
    return DailyUsage.objects.filter(team__in=teams_visible_to(user=user))


_COST = F("input_cost") + F("cached_input_cost") + F("output_cost")
_TOTALS = {
    # The part that lines of batches (/v1/batches) made, shown apart. First: once the sums
    # below are annotated, "num_requests" names the sum, not the roll-up's field.
    "batch_requests": Sum("num_requests", filter=Q(batch=True), default=0),
    "batch_cost": Sum(_COST, filter=Q(batch=True), default=0),
    "num_requests": Sum("num_requests"),
    "num_rejected": Sum("num_rejected"),
    "prompt_tokens": Sum("prompt_tokens"),
    "cached_tokens": Sum("cached_tokens"),
    "completion_tokens": Sum("completion_tokens"),
    "images": Sum("images"),
    "cost": Sum(_COST),
}


def usage_totals(
    *,
    daily: QuerySet[DailyUsage],
    since: datetime.date,
    until: datetime.date,
    teams: QuerySet[Team] | None,
    api_keys: QuerySet[ApiKey] | None,
) -> dict[str, list[dict] | None]:
    """Per-team and per-key totals over [since, until] from the daily roll-ups (never from the
    rows, which may number millions), with the batch lines' part of them apart
    (`batch_requests`, `batch_cost`), for the `teams` and the `api_keys` a reader may see; None
    leaves that table out (None in the result)."""
    period = daily.filter(date__gte=since, date__lte=until)
    by_team = by_key = None
    if teams is not None:
        by_team = list(
            period.filter(team__in=teams)
            .values("team_id", "team__name")
            .annotate(**_TOTALS)
            .order_by("team__name")
        )
    if api_keys is not None:
        by_key = list(
            period.filter(api_key__in=api_keys)
            .values("api_key_id", "api_key__prefix", "api_key__name", "team__name")
            .annotate(**_TOTALS)
            .order_by("team__name", "api_key__prefix")
        )
    return {"teams": by_team, "keys": by_key}
