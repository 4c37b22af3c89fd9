"""Admin for batches (/v1/batches) and files (/v1/files): read-only lists and pages, the files'
downloads, "Cancel selected batches", and deleting files through the files' own service.

Who may (as for usage and the requests running now): "view batch" / "view stored file" to see
the batches and files of the teams one belongs to (superusers: all); cancel only the batches
of the teams one owns; "delete stored file" to delete the files of the teams one owns, never
one an active batch reads (the bytes go with the row: inference/batches/files.py).
"""

from __future__ import annotations

import json

from django.contrib import admin, messages
from django.core.exceptions import PermissionDenied
from django.http import Http404, HttpRequest, HttpResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.formats import date_format
from django.utils.html import format_html, format_html_join
from django.utils.safestring import mark_safe

from accounts.admin import ReadOnlyAdmin, VisibleTeamFilter, owns_team
from accounts.selectors import teams_owned_by
from engine import format_bytes
from inference.admin.lists import WideListMixin
from inference.batch_models import Batch, StoredFile
from inference.batches.file_views import file_attachment
from inference.batches.files import FileInUse, file_delete, file_open
from inference.batches.runner import wake_batch_runner
from inference.batches.selectors import (
    batch_finished_at,
    batches_managed_by,
    batches_visible_to,
    files_visible_to,
)
from inference.batches.services import batch_cancel
from inference.errors import APIError

MESSAGE_CANCELLING = "Cancelling {count} batch(es): what has finished is kept."
MESSAGE_NOT_CANCELLED = "Not cancelled (ended already, or not of a team you own): {ids}."
IN_USE = "{file}: the input of batch {batch_id}, which is still {status}"
NOT_YOURS = "{file}: a file of team {team}, which you do not own"


def _pretty_json(value) -> str:
    return format_html("<pre>{}</pre>", json.dumps(value, indent=2, ensure_ascii=False))


def _file_link(stored: StoredFile | None, fallback: str = "") -> str:
    if stored is None:
        return fallback or "-"
    return format_html(
        '<a href="{}">{}</a> ({}, {})',
        reverse("admin:inference_storedfile_download", args=[stored.pk]),
        stored.filename,
        stored.pk,
        format_bytes(stored.num_bytes),
    )


@admin.register(Batch)
class BatchAdmin(WideListMixin, ReadOnlyAdmin):
    # Every column fits a 1366-pixel screen beside the filters; the batch's page has them in full.
    list_display = [
        "batch",
        "team",
        "key_prefix",
        "endpoint",
        "model",
        "status",
        "progress",
        "created",
        "expires",
    ]
    list_filter = ["status", ("team", VisibleTeamFilter), "endpoint"]
    list_select_related = ["team", "api_key"]
    search_fields = ["=id", "=input_file_name", "metadata"]
    # No search_help_text: axe counts the admin's aria-describedby on the box as its only label.
    actions = ["cancel_batches"]
    fields = [
        "id",
        "team",
        "key",
        "endpoint",
        "model",
        "completion_window",
        "status",
        "request_counts",
        "usage",
        "files",
        "error_list",
        "metadata_shown",
        "created_at",
        "in_progress_at",
        "finalizing_at",
        "finished",
        "expires_at",
        "runner",
        "attempts",
        "heartbeat_at",
    ]
    readonly_fields = fields

    def get_queryset(self, request):
        return batches_visible_to(user=request.user).select_related(
            "team", "api_key__user", "input_file", "output_file", "error_file"
        )

    def has_cancel_permission(self, request: HttpRequest) -> bool:
        return self.has_view_permission(request) and owns_team(request.user, None)

    @admin.action(description="Cancel selected batches", permissions=["cancel"])
    def cancel_batches(self, request: HttpRequest, queryset) -> None:
        selected = list(queryset.values_list("pk", flat=True))
        managed = batches_managed_by(user=request.user).filter(pk__in=selected)
        mine = set(managed.values_list("pk", flat=True))
        cancelled, refused = 0, []
        for batch_id in selected:
            try:
                batch = batch_cancel(team_id=None, batch_id=batch_id) if batch_id in mine else None
            except APIError:  # it has ended
                batch = None
            if batch is None:
                refused.append(batch_id)
            else:
                cancelled += 1
        if cancelled:
            wake_batch_runner()
            self.message_user(request, MESSAGE_CANCELLING.format(count=cancelled))
        if refused:
            ids = ", ".join(refused)
            self.message_user(request, MESSAGE_NOT_CANCELLED.format(ids=ids), messages.WARNING)

    @admin.display(description="batch", ordering="id")
    def batch(self, obj: Batch) -> str:
        return obj.id[:14] + "…" if len(obj.id) > 15 else obj.id

    @admin.display(description="key", ordering="api_key__prefix")
    def key_prefix(self, obj: Batch) -> str:
        return f"{obj.api_key.prefix}…" if obj.api_key else "-"

    @admin.display(description="key")
    def key(self, obj: Batch) -> str:
        return str(obj.api_key) if obj.api_key else "-"

    @admin.display(description="progress")
    def progress(self, obj: Batch) -> str:
        if not obj.num_total:
            return "-"
        done = obj.num_completed + obj.num_failed
        failed = f", {obj.num_failed:,} failed" if obj.num_failed else ""
        return format_html(
            '<progress value="{}" max="{}"></progress><br>{} of {}{}',
            done,
            obj.num_total,
            f"{done:,}",
            f"{obj.num_total:,}",
            failed,
        )

    # Times in UTC, as the usage list shows them (its headings say so; these have no room).
    @admin.display(description="created", ordering="created_at")
    def created(self, obj: Batch) -> str:
        return f"{obj.created_at:%Y-%m-%d %H:%M}"

    @admin.display(description="expires", ordering="expires_at")
    def expires(self, obj: Batch) -> str:
        return f"{obj.expires_at:%Y-%m-%d %H:%M}"

    @admin.display(description="requests")
    def request_counts(self, obj: Batch) -> str:
        return (
            f"{obj.num_total:,} in all: {obj.num_completed:,} completed, {obj.num_failed:,} failed"
        )

    @admin.display(description="tokens")
    def usage(self, obj: Batch) -> str:
        return (
            f"{obj.input_tokens:,} in ({obj.cached_tokens:,} cached), {obj.output_tokens:,} out, "
            f"{obj.input_tokens + obj.output_tokens:,} in all"
        )

    @admin.display(description="files")
    def files(self, obj: Batch) -> str:
        rows = [
            ("input", _file_link(obj.input_file, f"{obj.input_file_name} (deleted)")),
            ("output", _file_link(obj.output_file)),
            ("errors", _file_link(obj.error_file)),
        ]
        return format_html_join(mark_safe("<br>"), "{}: {}", rows)

    @admin.display(description="errors")
    def error_list(self, obj: Batch) -> str:
        return _pretty_json(obj.errors) if obj.errors else "-"

    @admin.display(description="metadata")
    def metadata_shown(self, obj: Batch) -> str:
        return _pretty_json(obj.metadata) if obj.metadata else "-"

    @admin.display(description="finished")
    def finished(self, obj: Batch) -> str:
        at = batch_finished_at(obj)
        return date_format(timezone.localtime(at), "DATETIME_FORMAT") if at else "-"


@admin.register(StoredFile)
class StoredFileAdmin(WideListMixin, admin.ModelAdmin):
    list_display = ["id", "team", "purpose", "filename", "size", "created"]
    list_filter = ["purpose", ("team", VisibleTeamFilter)]
    list_select_related = ["team"]
    search_fields = ["=id", "filename"]
    fields = ["id", "team", "key", "purpose", "filename", "size", "sha256", "created_at"]
    fields += ["expires_at", "download"]
    readonly_fields = fields

    def get_queryset(self, request):
        return files_visible_to(user=request.user)

    def get_urls(self):
        view = self.admin_site.admin_view(self.download_view)
        return [
            path("<str:file_id>/download/", view, name="inference_storedfile_download"),
            *super().get_urls(),
        ]

    def has_add_permission(self, request: HttpRequest) -> bool:
        return False  # uploads come through /v1/files, outputs from the batches

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        team_id = obj.team_id if obj is not None else None
        return super().has_delete_permission(request, obj) and owns_team(request.user, team_id)

    def get_deleted_objects(self, objs, request):
        """Files an active batch reads, or of teams the user does not own, are shown as
        protected: Django then deletes none of the selection."""
        deleted, counts, perms_needed, protected = super().get_deleted_objects(objs, request)
        files = list(objs)
        owned = set(teams_owned_by(user=request.user).values_list("pk", flat=True))
        readers = Batch.objects.filter(
            input_file_id__in=[f.pk for f in files], status__in=Batch.ACTIVE_STATES
        ).values_list("input_file_id", "id", "status")
        by_file = {file_id: (batch_id, status) for file_id, batch_id, status in readers}
        for stored in files:
            if stored.team_id not in owned:
                protected.append(NOT_YOURS.format(file=stored, team=stored.team))
            elif stored.pk in by_file:
                batch_id, status = by_file[stored.pk]
                protected.append(IN_USE.format(file=stored, batch_id=batch_id, status=status))
        return deleted, counts, perms_needed, protected

    def delete_model(self, request: HttpRequest, obj: StoredFile) -> None:
        try:
            file_delete(team_id=obj.team_id, file_id=obj.pk)
        except FileInUse as exc:  # a batch made from it since the confirmation page
            raise PermissionDenied(exc.message) from None

    def delete_queryset(self, request: HttpRequest, queryset) -> None:
        for stored in queryset:
            self.delete_model(request, stored)

    @admin.display(description="key")
    def key(self, obj: StoredFile) -> str:
        return str(obj.api_key) if obj.api_key else "-"

    @admin.display(description="created", ordering="created_at")  # UTC, as the batches'
    def created(self, obj: StoredFile) -> str:
        return f"{obj.created_at:%Y-%m-%d %H:%M}"

    @admin.display(description="size", ordering="num_bytes")
    def size(self, obj: StoredFile) -> str:
        return format_bytes(obj.num_bytes)

    @admin.display(description="content")
    def download(self, obj: StoredFile) -> str:
        url = reverse("admin:inference_storedfile_download", args=[obj.pk])
        return format_html('<a href="{}">Download</a>', url)

    def download_view(self, request: HttpRequest, file_id: str) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        stored = self.get_queryset(request).filter(pk=file_id).first()
        if stored is None:
            raise Http404("No such file.")
        try:
            handle = file_open(stored)
        except FileNotFoundError:
            raise Http404("No such file.") from None
        return file_attachment(stored, handle)
