"""Admin for stored /v1/responses responses, read-only."""

import json

from django.contrib import admin
from django.db.models import Q
from django.utils.html import format_html

from accounts.admin import ReadOnlyAdmin, VisibleTeamFilter
from inference.admin.lists import CappedCountPaginator, WideListMixin
from inference.models import StoredResponse
from inference.services.stored_responses import responses_visible_to, stored_input_items


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
        return _pretty_json(stored_input_items(obj) or [])

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
