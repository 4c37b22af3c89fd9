"""Admin for usage: the usage rows, their totals page and the daily roll-ups, read-only."""

import datetime
import functools

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.db.models import Q
from django.template.response import TemplateResponse
from django.urls import path
from django.utils import timezone

from accounts import keys
from accounts.admin import KeySearchMixin, ReadOnlyAdmin, VisibleTeamFilter
from accounts.models import ApiKey, Team
from common.money import format_money
from inference.admin.lists import CappedCountPaginator, WideListMixin, admin_list_rows
from inference.admin.running import running_view
from inference.models import DailyUsage, UsageRecord
from inference.services.usage import daily_usage_visible_to, usage_records_visible_to, usage_totals


class ModelNameFilter(admin.SimpleListFilter):
    title = "model"
    parameter_name = "model"

    def lookups(self, request, model_admin):
        # From the roll-ups the user may see, never a DISTINCT over the usage rows.
        names = daily_usage_visible_to(user=request.user).values_list("model", flat=True)
        return [(name, name) for name in sorted(set(names.distinct()))]

    def queryset(self, request, queryset):
        return queryset.filter(model=self.value()) if self.value() else queryset


class BatchFilter(admin.SimpleListFilter):
    """Lines of batches (/v1/batches) apart from interactive requests."""

    title = "kind"
    parameter_name = "kind"

    def lookups(self, request, model_admin):
        return [("batch", "batch lines"), ("interactive", "interactive")]

    def queryset(self, request, queryset):
        if self.value() == "batch":
            return queryset.exclude(batch_id="")
        if self.value() == "interactive":
            return queryset.filter(batch_id="")
        return queryset


@admin.register(UsageRecord)
class UsageRecordAdmin(WideListMixin, KeySearchMixin, ReadOnlyAdmin):
    # Every column fits a 1366-pixel screen beside the filters (a browser test measures it);
    # the row's own page has every field in full.
    list_display = [
        "request",
        "started",
        "key",
        "model",
        "status",
        "tokens",
        "cost",
        "duration",
        "error_code",
    ]
    list_per_page = 50
    list_filter = [
        "status",
        "service_tier",
        BatchFilter,
        ModelNameFilter,
        ("team", VisibleTeamFilter),
        ("started_at", admin.DateFieldListFilter),
    ]
    list_select_related = ["team", "api_key", "user"]
    search_fields = ["request_id"]  # get_search_results below decides how
    search_help_text = (
        "Exact request id, batch id, key prefix as shown (sk-orch-XXXXXXXX), team name or "
        "model name."
    )
    paginator = CappedCountPaginator
    show_full_result_count = False
    change_list_template = "admin/inference/usagerecord/change_list.html"

    @admin.display(description="request", ordering="request_id")
    def request(self, obj: UsageRecord) -> str:
        return obj.request_id[:12] + "…" if len(obj.request_id) > 13 else obj.request_id

    @admin.display(description="started (UTC)", ordering="started_at")
    def started(self, obj: UsageRecord) -> str:
        return f"{obj.started_at:%Y-%m-%d %H:%M:%S}"

    @admin.display(description="key", ordering="api_key__prefix")
    def key(self, obj: UsageRecord) -> str:
        return f"{obj.api_key.prefix}…"

    @admin.display(description="tokens in / out")
    def tokens(self, obj: UsageRecord) -> str:
        cached = f" ({obj.cached_tokens:,} cached)" if obj.cached_tokens else ""
        return f"{obj.prompt_tokens:,}{cached} / {obj.completion_tokens:,}"

    @admin.display(description="cost")
    def cost(self, obj: UsageRecord) -> str:
        return format_money(obj.cost, with_currency=False) if obj.cost else "-"

    @admin.display(description="duration", ordering="duration_ms")
    def duration(self, obj: UsageRecord) -> str:
        return "-" if obj.duration_ms is None else f"{obj.duration_ms / 1000:.1f} s"

    def get_queryset(self, request):
        return usage_records_visible_to(user=request.user)

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip().rstrip("…")
        if not term:
            return queryset, False
        if term.startswith(keys.KEY_PREFIX):
            return queryset.filter(api_key__prefix=keys.lookup_prefix(term)), False
        exact = Q(request_id=term) | Q(batch_id=term) | Q(team__name=term) | Q(model=term)
        return queryset.filter(exact), False

    def get_urls(self):
        totals = path(
            "totals/",
            self.admin_site.admin_view(self.totals_view),
            name="inference_usagerecord_totals",
        )
        running = path(
            "running/",
            self.admin_site.admin_view(functools.partial(running_view, self)),
            name="inference_usagerecord_running",
        )
        return [totals, running, *super().get_urls()]

    def totals_view(self, request):
        """Per-team and per-key totals, under the lists' own permissions: the page needs the
        usage list's; the team table lists only the teams the team list shows the user, the key
        table only the keys the key list shows (neither table without its list's permission)."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        today = timezone.now().date()
        since = _parse_date(request.GET.get("since"), today.replace(day=1))
        until = _parse_date(request.GET.get("until"), today)
        totals = usage_totals(
            daily=daily_usage_visible_to(user=request.user),
            since=since,
            until=until,
            teams=admin_list_rows(request, Team),
            api_keys=admin_list_rows(request, ApiKey),
        )
        context = {
            **self.admin_site.each_context(request),
            "title": f"Usage totals {since} – {until}",
            "opts": self.model._meta,
            "since": since,
            "until": until,
            **totals,
        }
        return TemplateResponse(request, "admin/inference/usagerecord/totals.html", context)


def _parse_date(value: str | None, default: datetime.date) -> datetime.date:
    try:
        return datetime.date.fromisoformat(value) if value else default
    except ValueError:
        return default


@admin.register(DailyUsage)
class DailyUsageAdmin(WideListMixin, ReadOnlyAdmin):
    list_display = [
        "date",
        "team",
        "key",
        "model",
        "service_tier",
        "batch",
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
        "cost",
    ]
    list_filter = [
        ("date", admin.DateFieldListFilter),
        ("team", VisibleTeamFilter),
        ModelNameFilter,
        "service_tier",
        "batch",
    ]
    list_select_related = ["team", "api_key", "api_key__user"]

    @admin.display(description="key", ordering="api_key__prefix")
    def key(self, obj: DailyUsage) -> str:
        return f"{obj.api_key.prefix}…"

    @admin.display(description="requests", ordering="num_requests")
    def requests(self, obj: DailyUsage) -> str:
        parts = [
            f"{count:,} {label}"
            for label, count in (
                ("cancelled", obj.num_cancelled),
                ("failed", obj.num_failed),
                ("rejected", obj.num_rejected),
            )
            if count
        ]
        return f"{obj.num_requests:,}" + (f" ({', '.join(parts)})" if parts else "")

    @admin.display(description="cost")
    def cost(self, obj: DailyUsage) -> str:
        return format_money(obj.input_cost + obj.cached_input_cost + obj.output_cost)

    def get_queryset(self, request):
        return daily_usage_visible_to(user=request.user)
