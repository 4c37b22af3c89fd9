"""GET /v1/organization/costs: what the teams' requests cost, shaped like OpenAI's organization
costs API (daily buckets of `organization.costs.result`, `amount: {value, currency}`,
`group_by` = `project_id` / `line_item` / `api_key_id`, cursor pages).

The same readers as the usage endpoint (inference/api/usage.py): a team owner's or a superuser's
session (their teams), or a key marked `reads_usage` (its own team only). `project_id` is the
team; `api_key_id` a key's prefix; a `line_item` is a model and a kind of token ("MODEL, input",
"MODEL, cached input", "MODEL, output"), with its tokens as `quantity`. Costs are those recorded
on the usage rows (each at the price in force when its request started), read from the daily
roll-ups.
"""

from __future__ import annotations

import datetime

from django.db.models import Sum
from rest_framework import serializers
from rest_framework.response import Response

from inference.api.usage import (
    LATEST_TIME,
    UsageCompletions,
    bucket_page,
    money_amount,
    page_of_days,
)
from inference.services import reports

LIST_PARAMS = {"group_by", "project_ids", "api_key_ids"}
GROUP_FIELDS = {"project_id": "team_id", "api_key_id": "api_key__prefix", "line_item": "model"}
LINE_ITEMS = (
    # (name, cost field, its tokens)
    ("input", "input_cost", lambda row: row["prompt_tokens"] - row["cached_tokens"]),
    ("cached input", "cached_input_cost", lambda row: row["cached_tokens"]),
    ("output", "output_cost", lambda row: row["completion_tokens"]),
)
SUMS = {
    name: Sum(name)
    for name in (
        "input_cost",
        "cached_input_cost",
        "output_cost",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
    )
}


class CostsQuery(serializers.Serializer):
    start_time = serializers.IntegerField(min_value=0, max_value=LATEST_TIME)
    end_time = serializers.IntegerField(min_value=1, max_value=LATEST_TIME, required=False)
    bucket_width = serializers.ChoiceField(choices=["1d"], required=False, default="1d")
    group_by = serializers.ListField(
        child=serializers.ChoiceField(choices=list(GROUP_FIELDS)), required=False, default=list
    )
    project_ids = serializers.ListField(child=serializers.IntegerField(), required=False)
    api_key_ids = serializers.ListField(child=serializers.CharField(max_length=40), required=False)
    limit = serializers.IntegerField(min_value=1, max_value=180, required=False, default=7)
    page = serializers.DateField(required=False)


class OrganizationCosts(UsageCompletions):
    def get(self, request):
        q, teams = self.validated(request, CostsQuery)
        days, page_days, more = page_of_days(q)
        results: dict[datetime.date, list[dict]] = {}
        if page_days:
            rows = reports.daily_rows(since=page_days[0], until=page_days[-1], teams=teams)
            if q.get("api_key_ids"):
                rows = rows.filter(api_key__prefix__in=q["api_key_ids"])
            groups = [GROUP_FIELDS[name] for name in GROUP_FIELDS if name in q["group_by"]]
            summed = rows.values("date", *groups).annotate(**SUMS).order_by("date", *groups)
            for row in summed:
                results.setdefault(row["date"], []).extend(_results(row, q["group_by"]))
        return Response(bucket_page(days, page_days, more, results, q["limit"]))


def _results(row: dict, group_by: list[str]) -> list[dict]:
    base = {
        "object": "organization.costs.result",
        "line_item": None,
        "project_id": row["team_id"] if "project_id" in group_by else None,
        "api_key_id": row["api_key__prefix"] if "api_key_id" in group_by else None,
        "quantity": None,
    }
    if "line_item" not in group_by:
        total = sum(row[field] for _, field, _ in LINE_ITEMS)
        return [{**base, "amount": money_amount(total)}]
    return [
        {
            **base,
            "amount": money_amount(row[field]),
            "line_item": f"{row['model']}, {name}",
            "quantity": tokens(row),
        }
        for name, field, tokens in LINE_ITEMS
        if tokens(row) or row[field]
    ]


organization_costs = OrganizationCosts.as_view()
