"""Usage reports for the web pages and the usage and costs APIs, read from the daily roll-ups
(`DailyUsage`: one row per day × team × key × model × service tier × batch or interactive, with
their tokens and cost), never from the per-request rows, so they stay fast however many requests
there were."""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from django.db.models import F, QuerySet, Sum

from accounts.models import Team
from inference.models import DailyUsage

GROUPS = {
    "day": "date",
    "model": "model",
    "key": "api_key__prefix",
    "member": "api_key__user__username",
    "tier": "service_tier",
    "batch": "batch",  # True: lines of batches (/v1/batches), False: interactive requests
}
SUMS = {
    "requests": Sum("num_requests"),
    "prompt_tokens": Sum("prompt_tokens"),
    "cached_tokens": Sum("cached_tokens"),
    "images": Sum("images"),
    "completion_tokens": Sum("completion_tokens"),
    # Nano-units of ORCHARD_CURRENCY (common/money.py), the three line items together.
    "cost": Sum(F("input_cost") + F("cached_input_cost") + F("output_cost")),
}


@dataclass
class Report:
    rows: list[dict[str, Any]]
    totals: dict[str, int]
    by_day: list[tuple[datetime.date, int]] = field(default_factory=list)
    by_model: list[tuple[str, int, int]] = field(default_factory=list)  # (model, tokens, cost)
    by_tier: list[tuple[str, int, int]] = field(default_factory=list)
    by_batch: list[tuple[bool, int, int]] = field(default_factory=list)  # interactive first


def daily_rows(
    *,
    since: datetime.date,
    until: datetime.date,
    teams: Iterable[Team] | None = None,
    user_id: int | None = None,
    model: str | None = None,
    key_prefix: str | None = None,
    member: str | None = None,
) -> QuerySet[DailyUsage]:
    rows = DailyUsage.objects.filter(date__gte=since, date__lte=until)
    if teams is not None:
        rows = rows.filter(team__in=list(teams))
    if user_id is not None:
        rows = rows.filter(api_key__user_id=user_id)
    if model:
        rows = rows.filter(model=model)
    if key_prefix:
        rows = rows.filter(api_key__prefix=key_prefix)
    if member:
        rows = rows.filter(api_key__user__username=member)
    return rows


def grouped(rows: QuerySet[DailyUsage], groups: list[str]) -> list[dict[str, Any]]:
    """`rows` summed per combination of `groups` (names of GROUPS), newest day first."""
    same = [name for name in groups if GROUPS[name] == name]  # "model" is the field itself
    renamed = {name: F(GROUPS[name]) for name in groups if GROUPS[name] != name}
    out = rows.values(*same, **renamed).annotate(**SUMS).order_by(*_order(groups))
    return [{**row, "total_tokens": row["prompt_tokens"] + row["completion_tokens"]} for row in out]


def _order(groups: list[str]) -> list[str]:
    return [("-" if name == "day" else "") + name for name in groups]


def totals(rows: QuerySet[DailyUsage]) -> dict[str, int]:
    summed = rows.aggregate(**SUMS)
    summed = {name: value or 0 for name, value in summed.items()}
    summed["total_tokens"] = summed["prompt_tokens"] + summed["completion_tokens"]
    return summed


def totals_by_team(rows: QuerySet[DailyUsage]) -> dict[int, dict[str, int]]:
    """`rows` summed per team: team id → the sums of SUMS and `total_tokens`."""
    out = rows.values("team_id").annotate(**SUMS).order_by("team_id")
    return {
        row.pop("team_id"): {**row, "total_tokens": row["prompt_tokens"] + row["completion_tokens"]}
        for row in out
    }


def report(rows: QuerySet[DailyUsage], groups: list[str]) -> Report:
    by_day = [(r["day"], r["total_tokens"]) for r in grouped(rows, ["day"])]
    by_model = [(r["model"], r["total_tokens"], r["cost"]) for r in grouped(rows, ["model"])]
    by_tier = [(r["tier"], r["total_tokens"], r["cost"]) for r in grouped(rows, ["tier"])]
    by_batch = [(r["batch"], r["total_tokens"], r["cost"]) for r in grouped(rows, ["batch"])]
    return Report(grouped(rows, groups), totals(rows), sorted(by_day), by_model, by_tier, by_batch)
