"""GET /v1/organization/usage/completions: the team report's data for scripts and billing, shaped
like OpenAI's organization usage API (daily buckets of results, `group_by`, cursor pages).

Who may read: a signed-in session of a team owner or a superuser (their teams), or an API key
marked `reads_usage` (its own team). `project_id` is the team; `api_key_id` a key's prefix;
`user_id` a member's username; `service_tier` the tier requests were served in; `batch` whether
they were lines of batches (/v1/batches), as a filter (`batch=true|false`, both when absent) and
a grouping, as in OpenAI's; each result also says what its requests cost (`cost`, Orchard's own
field). Read from the daily roll-ups, so a year of a busy team is cheap. The costs endpoint
(inference/api/costs.py) shares the authorization and the paging; like OpenAI's, it has no
`batch` parameter.
"""

from __future__ import annotations

import datetime

from django.utils import timezone
from rest_framework import authentication, exceptions, permissions, serializers
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.views import exception_handler as drf_exception_handler

from accounts.authentication import AuthenticationError, authenticate_header
from accounts.models import Team
from accounts.selectors import teams_owned_by
from common.money import currency, from_nanos
from inference.errors import APIError, error_response
from inference.services import reports

LATEST_TIME = 32_503_680_000  # 3000-01-01: later times are not usage
LIST_PARAMS = {"group_by", "models", "api_key_ids", "user_ids", "project_ids"}
GROUP_FIELDS = {
    "model": "model",
    "api_key_id": "key",
    "user_id": "member",
    "project_id": "team",
    "service_tier": "tier",
    "batch": "batch",
}


class UsageKeyAuthentication(authentication.BaseAuthentication):
    """`Authorization: Bearer <an Orchard key with reads_usage>`."""

    def authenticate(self, request):
        header = request.headers.get("Authorization")
        if not header:
            return None
        try:
            api_key = authenticate_header(header)
        except AuthenticationError as exc:
            raise exceptions.AuthenticationFailed(exc.message) from None
        if not api_key.reads_usage:
            raise exceptions.PermissionDenied("This API key may not read usage.")
        return api_key.user, api_key

    def authenticate_header(self, request):
        return "Bearer"


class UsageQuery(serializers.Serializer):
    start_time = serializers.IntegerField(min_value=0, max_value=LATEST_TIME)
    end_time = serializers.IntegerField(min_value=1, max_value=LATEST_TIME, required=False)
    bucket_width = serializers.ChoiceField(choices=["1d"], required=False, default="1d")
    group_by = serializers.ListField(
        child=serializers.ChoiceField(choices=list(GROUP_FIELDS)), required=False, default=list
    )
    models = serializers.ListField(child=serializers.CharField(max_length=100), required=False)
    api_key_ids = serializers.ListField(child=serializers.CharField(max_length=40), required=False)
    user_ids = serializers.ListField(child=serializers.CharField(max_length=150), required=False)
    project_ids = serializers.ListField(child=serializers.IntegerField(), required=False)
    batch = serializers.BooleanField(required=False)  # absent: batch and interactive alike
    limit = serializers.IntegerField(min_value=1, max_value=31, required=False, default=7)
    page = serializers.DateField(required=False)


def _day(timestamp: int) -> datetime.date:
    return datetime.datetime.fromtimestamp(timestamp, tz=datetime.UTC).date()


def _start(day: datetime.date) -> int:
    return int(datetime.datetime.combine(day, datetime.time(), tzinfo=datetime.UTC).timestamp())


def _openai_error(exc, context):
    """DRF's errors in OpenAI's shape, as every /v1 route answers."""
    response = drf_exception_handler(exc, context)
    if response is None:
        return None
    param, message = None, str(getattr(exc, "detail", exc))
    if isinstance(exc, exceptions.ValidationError) and isinstance(exc.detail, dict):
        param, errors = next(iter(exc.detail.items()))
        message = f"Invalid '{param}': {errors[0] if isinstance(errors, list) else errors}"
    return error_response(APIError(response.status_code, message, param=param))


class UsageCompletions(APIView):
    authentication_classes = [authentication.SessionAuthentication, UsageKeyAuthentication]
    permission_classes = [permissions.IsAuthenticated]

    def get_exception_handler(self):
        return _openai_error

    def teams(self, request) -> list[Team]:
        api_key = request.auth if hasattr(request.auth, "reads_usage") else None
        if api_key is not None:
            return [api_key.team]
        return list(teams_owned_by(user=request.user))

    def validated(self, request, serializer) -> tuple[dict, list[Team]]:
        """The query's fields checked by `serializer`, and the teams it may read (narrowed to
        its project_ids)."""
        data = {
            key: request.query_params.getlist(key) if key in LIST_PARAMS else value
            for key, value in request.query_params.items()
        }
        query = serializer(data=data)
        query.is_valid(raise_exception=True)
        q = query.validated_data
        teams = self.teams(request)
        if q.get("project_ids"):
            teams = [t for t in teams if t.pk in set(q["project_ids"])]
        return q, teams

    def get(self, request):
        q, teams = self.validated(request, UsageQuery)
        days, page_days, more = page_of_days(q)
        begin = days[0] if days else _day(q["start_time"])
        rows = reports.daily_rows(
            since=begin, until=page_days[-1] if page_days else begin, teams=teams
        )
        if q.get("models"):
            rows = rows.filter(model__in=q["models"])
        if q.get("api_key_ids"):
            rows = rows.filter(api_key__prefix__in=q["api_key_ids"])
        if q.get("user_ids"):
            rows = rows.filter(api_key__user__username__in=q["user_ids"])
        if "batch" in q:
            rows = rows.filter(batch=q["batch"])
        groups = ["day", *[GROUP_FIELDS[g] for g in q["group_by"] if GROUP_FIELDS[g] != "team"]]
        by_team = "project_id" in q["group_by"]
        results: dict[datetime.date, list[dict]] = {day: [] for day in page_days}
        if by_team:
            for team in teams:
                for row in reports.grouped(rows.filter(team=team), groups):
                    results.setdefault(row["day"], []).append(_result(row, q["group_by"], team))
        else:
            for row in reports.grouped(rows, groups):
                results.setdefault(row["day"], []).append(_result(row, q["group_by"], None))
        return Response(bucket_page(days, page_days, more, results, q["limit"]))


def page_of_days(q: dict) -> tuple[list[datetime.date], list[datetime.date], bool]:
    """The query's days from its page on, this page's (at most `limit`), and whether more
    follow."""
    first = _day(q["start_time"])
    last = _day(q["end_time"] - 1) if q.get("end_time") else timezone.now().date()
    begin = max(first, q["page"]) if q.get("page") else first
    days = [begin + datetime.timedelta(days=i) for i in range((last - begin).days + 1)]
    return days, days[: q["limit"]], len(days) > q["limit"]


def bucket_page(days, page_days, more, results: dict, limit: int) -> dict:
    """OpenAI's page of daily buckets."""
    data = [
        {
            "object": "bucket",
            "start_time": _start(day),
            "end_time": _start(day + datetime.timedelta(days=1)),
            "results": results.get(day, []),
        }
        for day in page_days
    ]
    return {
        "object": "page",
        "data": data,
        "has_more": more,
        "next_page": days[limit].isoformat() if more else None,
    }


def money_amount(nanos: int) -> dict:
    """OpenAI's `amount`: a number and the currency in lower case."""
    return {"value": float(from_nanos(nanos)), "currency": currency().lower()}


def _result(row: dict, group_by: list[str], team: Team | None) -> dict:
    return {
        "object": "organization.usage.completions.result",
        "input_tokens": row["prompt_tokens"],
        "input_cached_tokens": row["cached_tokens"],
        "output_tokens": row["completion_tokens"],
        "input_audio_tokens": 0,
        "output_audio_tokens": 0,
        "num_model_requests": row["requests"],
        "project_id": team.pk if team is not None else None,
        "user_id": row.get("member") if "user_id" in group_by else None,
        "api_key_id": row.get("key") if "api_key_id" in group_by else None,
        "model": row.get("model") if "model" in group_by else None,
        "service_tier": row.get("tier") if "service_tier" in group_by else None,
        "batch": row.get("batch") if "batch" in group_by else None,
        # Orchard's own: what these requests cost (the costs endpoint has it by line item).
        "cost": money_amount(row["cost"]),
    }


usage_completions = UsageCompletions.as_view()
