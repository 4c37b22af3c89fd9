"""Admin for the model registry and for usage.

Usage pages are read-only and built to stay fast at millions of rows: searches are exact matches
on indexed columns, no filter runs a DISTINCT over the rows, the row count is capped, and totals
come from the daily roll-ups.
"""

import datetime
import json

from django.contrib import admin, messages
from django.core.paginator import Paginator
from django.db import transaction
from django.db.models import Q
from django.template.response import TemplateResponse
from django.urls import path
from django.utils import timezone
from django.utils.functional import cached_property
from django.utils.html import format_html

from accounts import keys
from accounts.admin import KeySearchMixin, VisibleTeamFilter
from engine import folder_context_length
from inference.models import (
    ERROR_DEFAULT_MUST_BE_ENABLED,
    DailyUsage,
    ModelEntry,
    StoredResponse,
    UsageRecord,
)
from inference.services.engines import get_engine_client, registry_changed
from inference.services.registry import model_set_default, model_spec
from inference.services.responses import responses_visible_to
from inference.services.usage import daily_usage_visible_to, usage_records_visible_to, usage_totals

# The changelist counts at most this many matching rows (then filters narrow it down).
USAGE_COUNT_CAP = 10_000
STATUS_LABELS = {
    "serving": "serving",
    "loading": "loading",
    "failed": "load failed",
    "stopped": "stopped (engine died)",
    "draining": "draining (its engine workers are shutting down)",
    "not_loaded": "not loaded",
}


class WideListMixin:
    """A changelist with many columns gets the whole width: no navigation sidebar beside it
    (the breadcrumbs and the home page still lead everywhere)."""

    def changelist_view(self, request, extra_context=None):
        return super().changelist_view(
            request, {**(extra_context or {}), "is_nav_sidebar_enabled": False}
        )


@admin.register(ModelEntry)
class ModelEntryAdmin(WideListMixin, admin.ModelAdmin):
    list_display = [
        "name",
        "enabled",
        "is_default",
        "kind",
        "engine",
        "context",
        "status",
        "cache",
    ]
    list_editable = ["enabled"]
    list_filter = ["enabled", "kind", "engine"]
    search_fields = ["name", "path"]
    actions = ["enable", "disable", "make_default", "reload", "clear_cache"]
    readonly_fields = [
        "is_default",
        "status",
        "load_error",
        "cache_stats",
        "created_at",
        "updated_at",
    ]
    fieldsets = [
        (None, {"fields": ["name", "kind", "path", "enabled", "is_default", "engine"]}),
        ("Engine", {"fields": ["status", "load_error"]}),
        ("Parsers", {"fields": ["tool_parser", "reasoning_parser"]}),
        ("Generation", {"fields": ["context_length", "default_sampling"]}),
        (
            "Batching",
            {
                "fields": [
                    "max_num_seqs",
                    "max_num_batched_tokens",
                    "max_waiting",
                    "speculative_tokens",
                    "draft_model",
                ]
            },
        ),
        (
            "Memory and prefix cache",
            {
                "fields": [
                    "prefill_chunk_tokens",
                    "memory_budget_bytes",
                    "prefix_cache_bytes",
                    "cache_stats",
                ]
            },
        ),
        (None, {"fields": ["created_at", "updated_at"]}),
    ]

    @admin.display(description="context", ordering="context_length")
    def context(self, obj: ModelEntry) -> str:
        if obj.context_length:
            return f"{obj.context_length:,}"
        own = folder_context_length(obj.path)
        return f"{own:,} (model's own)" if own else "-"

    @admin.display(description="engine status")
    def status(self, obj: ModelEntry) -> str:
        """What this web process's engine serves under the name (its own view: each process
        runs its own engines)."""
        if obj.pk is None:
            return "-"
        if obj.kind == ModelEntry.Kind.EMBEDDING:
            serving = get_engine_client().embedders.is_serving(obj.name, obj.path)
            return "serving" if serving else "not loaded (loads on its first request)"
        status = get_engine_client().model_status(obj.name)
        text = STATUS_LABELS.get(status.state, status.state)
        if status.state == "serving" and status.loading is not None:
            text += ", reloading"
        if status.error and status.state != "failed":
            text += ", last reload failed"
        return text

    @admin.display(description="last load error")
    def load_error(self, obj: ModelEntry) -> str:
        if obj.pk is None:
            return "-"
        status = get_engine_client().model_status(obj.name)
        if not status.error:
            return "-"
        when = datetime.datetime.fromtimestamp(status.failed_at, tz=datetime.UTC)
        return f"{status.error} (at {when:%Y-%m-%d %H:%M:%S} UTC, path {status.failed_spec.path})"

    @admin.display(description="prefix cache")
    def cache(self, obj: ModelEntry) -> str:
        stats = self._cache_stats(obj)
        if stats is None:
            return "-"
        rate = f", {stats['hits'] / stats['lookups']:.0%} hits" if stats["lookups"] else ""
        return f"{_megabytes(stats['bytes'])} of {_megabytes(stats['max_bytes'])}{rate}"

    @admin.display(description="prefix cache statistics")
    def cache_stats(self, obj: ModelEntry) -> str:
        stats = self._cache_stats(obj)
        if stats is None:
            return "- (the model is not loaded in this process, or has no prefix cache)"
        return (
            f"{stats['nodes']:,} entries, {_megabytes(stats['bytes'])} of "
            f"{_megabytes(stats['max_bytes'])}; {stats['lookups']:,} lookups, "
            f"{stats['hits']:,} hits, {stats['hit_tokens']:,} prompt tokens not recomputed; "
            f"{stats['evictions']:,} evictions ({_megabytes(stats['evicted_bytes'])})"
        )

    def _cache_stats(self, obj: ModelEntry) -> dict | None:
        if obj.pk is None:
            return None
        status = get_engine_client().model_status(obj.name)
        return status.stats.prefix_cache if status.stats and status.stats.prefix_cache else None

    @admin.action(description="Clear the prefix cache of selected models", permissions=["change"])
    def clear_cache(self, request, queryset):
        client = get_engine_client()
        freed = sum(client.clear_prefix_cache(entry.name) for entry in queryset)
        self.message_user(request, f"Freed {_megabytes(freed)} of prefix cache.")

    @admin.action(
        description="Reload selected models (retries a failed load)", permissions=["change"]
    )
    def reload(self, request, queryset):
        client = get_engine_client()
        entries = list(queryset.filter(enabled=True, kind=ModelEntry.Kind.CHAT))
        for entry in entries:
            client.start_loading(model_spec(entry), force=True)
        self.message_user(
            request,
            f"Loading {len(entries)} model(s); each keeps serving its current version until the "
            "new one is ready. The engine status column shows how it went.",
        )

    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)
        transaction.on_commit(registry_changed)

    def delete_model(self, request, obj):
        super().delete_model(request, obj)
        transaction.on_commit(registry_changed)

    def delete_queryset(self, request, queryset):
        super().delete_queryset(request, queryset)
        transaction.on_commit(registry_changed)

    @admin.action(description="Enable selected models", permissions=["change"])
    def enable(self, request, queryset):
        self.message_user(request, f"Enabled {queryset.update(enabled=True)} model(s).")
        transaction.on_commit(registry_changed)

    @admin.action(description="Disable selected models", permissions=["change"])
    def disable(self, request, queryset):
        if queryset.filter(is_default=True).exists():
            self.message_user(request, ERROR_DEFAULT_MUST_BE_ENABLED, messages.WARNING)
        count = queryset.filter(is_default=False).update(enabled=False)
        self.message_user(request, f"Disabled {count} model(s).")
        transaction.on_commit(registry_changed)

    @admin.action(description="Make the selected model the default", permissions=["change"])
    def make_default(self, request, queryset):
        if queryset.count() != 1:
            self.message_user(request, "Select exactly one model.", messages.ERROR)
            return
        entry = queryset.get()
        if not entry.enabled:
            self.message_user(
                request, f"Enable {entry} before making it the default.", messages.ERROR
            )
            return
        model_set_default(entry=entry)
        self.message_user(request, f"{entry} is now the default model.")


def _megabytes(num_bytes: int) -> str:
    return f"{num_bytes / 1e6:,.1f} MB"


class CappedCountPaginator(Paginator):
    @cached_property
    def count(self) -> int:
        return self.object_list[:USAGE_COUNT_CAP].count()


class ModelNameFilter(admin.SimpleListFilter):
    title = "model"
    parameter_name = "model"

    def lookups(self, request, model_admin):
        # From the roll-ups the user may see, never a DISTINCT over the usage rows.
        names = daily_usage_visible_to(user=request.user).values_list("model", flat=True)
        return [(name, name) for name in sorted(set(names.distinct()))]

    def queryset(self, request, queryset):
        return queryset.filter(model=self.value()) if self.value() else queryset


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


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
        "duration",
        "error_code",
    ]
    list_per_page = 50
    list_filter = [
        "status",
        ModelNameFilter,
        ("team", VisibleTeamFilter),
        ("started_at", admin.DateFieldListFilter),
    ]
    list_select_related = ["team", "api_key", "user"]
    search_fields = ["request_id"]  # get_search_results below decides how
    search_help_text = (
        "Exact request id, key prefix as shown (sk-orch-XXXXXXXX), team name or model name."
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
        return queryset.filter(Q(request_id=term) | Q(team__name=term) | Q(model=term)), False

    def get_urls(self):
        totals = path(
            "totals/",
            self.admin_site.admin_view(self.totals_view),
            name="inference_usagerecord_totals",
        )
        return [totals, *super().get_urls()]

    def totals_view(self, request):
        today = timezone.now().date()
        since = _parse_date(request.GET.get("since"), today.replace(day=1))
        until = _parse_date(request.GET.get("until"), today)
        totals = usage_totals(
            daily=daily_usage_visible_to(user=request.user), since=since, until=until
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
        "requests",
        "prompt_tokens",
        "cached_tokens",
        "completion_tokens",
    ]
    list_filter = [
        ("date", admin.DateFieldListFilter),
        ("team", VisibleTeamFilter),
        ModelNameFilter,
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

    def get_queryset(self, request):
        return daily_usage_visible_to(user=request.user)


@admin.register(StoredResponse)
class StoredResponseAdmin(WideListMixin, ReadOnlyAdmin):
    """Stored /v1/responses responses, read-only (`manage.py purge_responses` deletes by age)."""

    list_display = ["id", "created", "team", "key", "model", "status", "tokens"]
    list_filter = ["status", ("team", VisibleTeamFilter), ("created_at", admin.DateFieldListFilter)]
    list_select_related = ["team", "api_key"]
    search_fields = ["id"]
    search_help_text = "Exact response id (resp_...) or previous response id."
    paginator = CappedCountPaginator
    show_full_result_count = False
    fields = ["id", "created", "team", "key", "model", "status", "previous_response_id"]
    fields += ["tokens", "output", "conversation"]
    readonly_fields = fields

    @admin.display(description="created (UTC)", ordering="created_at")
    def created(self, obj: StoredResponse) -> str:
        return f"{obj.created_at:%Y-%m-%d %H:%M:%S}"

    @admin.display(description="key")
    def key(self, obj: StoredResponse) -> str:
        return f"{obj.api_key.prefix}…" if obj.api_key else "-"

    @admin.display(description="tokens in / out")
    def tokens(self, obj: StoredResponse) -> str:
        usage = obj.body.get("usage") or {}
        return f"{usage.get('input_tokens', 0):,} / {usage.get('output_tokens', 0):,}"

    @admin.display(description="output")
    def output(self, obj: StoredResponse):
        return _pretty_json(obj.body.get("output", []))

    @admin.display(description="input items (the conversation it answered)")
    def conversation(self, obj: StoredResponse):
        return _pretty_json(obj.input_items)

    def get_queryset(self, request):
        return responses_visible_to(user=request.user)

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip()
        if not term:
            return queryset, False
        return queryset.filter(Q(id=term) | Q(previous_response_id=term)), False


def _pretty_json(value) -> str:
    return format_html(
        '<pre style="white-space: pre-wrap; max-width: 100ch">{}</pre>',
        json.dumps(value, indent=2, ensure_ascii=False),
    )
