"""Pulls from the Hugging Face hub in the admin: "Pull a model" (a hub id, an optional revision,
the name, kind and quantization; linked from the model list and its "Add model" page), each
pull's page and the list with their live progress (phase, bytes, rate, time left, the error),
and Cancel. The pull itself runs outside the request, on a web process's pull runner
(inference/services/pulls/); the pages read its row, through a small JSON view that
inference/static/web/pulls.js polls, so the progress survives a reload.

Who may: "add model pull" and "add model entry" to pull (it registers a model), "view model
pull" to watch, "change model pull" to cancel. Superusers, by default.
"""

from __future__ import annotations

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.http import (
    HttpRequest,
    HttpResponse,
    HttpResponseNotAllowed,
    HttpResponseRedirect,
    JsonResponse,
)
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from engine import GROUP_SIZES, format_bytes
from inference.models import ModelEntry, ModelPull
from inference.services.pulls import (
    PullRequestError,
    pull_cancel,
    pull_create,
    pull_eta_s,
    pull_is_stale,
    wake_pull_runner,
)

ADD_TEMPLATE = "admin/inference/modelpull/add.html"
MESSAGE_STARTED = "Pulling {source} as {name}: its progress is below."
MESSAGE_CANCELLING = "Cancelling pull #{pk}: it stops within a few seconds."
MESSAGE_NOT_ACTIVE = "Pull #{pk} has ended already."
STALE_NOTE = "its process stopped; a web process resumes it"
LIVE_ROWS = 100  # the most pulls one progress poll answers for


class PullForm(forms.Form):
    source = forms.CharField(
        label="Hub id",
        max_length=300,
        help_text="org/name, optionally @revision: mlx-community/Qwen3-0.6B-4bit, "
        "Qwen/Qwen3-0.6B@main.",
    )
    revision = forms.CharField(
        required=False, max_length=200, help_text="A branch, tag or commit; empty: main."
    )
    name = forms.CharField(
        required=False,
        max_length=100,
        help_text="The name clients will send; empty: the repo's name in lower case (with "
        "-4bit or -8bit when quantized here).",
    )
    kind = forms.ChoiceField(choices=ModelEntry.Kind.choices, initial=ModelEntry.Kind.CHAT)
    quantize = forms.TypedChoiceField(
        choices=[("", "No"), ("4", "4-bit"), ("8", "8-bit")],
        coerce=int,
        empty_value=None,
        required=False,
        help_text="Quantize while converting (a checkpoint that is not MLX is converted "
        "either way, at its own precision when not quantized).",
    )
    group_size = forms.TypedChoiceField(
        choices=[(str(size), str(size)) for size in GROUP_SIZES],
        coerce=int,
        initial="64",
        help_text="Weights sharing one scale when quantizing.",
    )


@admin.register(ModelPull)
class ModelPullAdmin(admin.ModelAdmin):
    list_display = [
        "id",
        "source_and_revision",
        "name",
        "state_now",
        "progress",
        "who",
        "created_at",
    ]
    list_display_links = ["id", "source_and_revision"]
    list_filter = ["state", "origin"]
    search_fields = ["source", "name"]
    change_list_template = "admin/inference/modelpull/change_list.html"
    change_form_template = "admin/inference/modelpull/change_form.html"
    fields = [
        "source",
        "revision",
        "commit",
        "name",
        "kind",
        "quantize_bits",
        "group_size",
        "state",
        "error",
        "model",
        "origin",
        "started_by",
        "attempts",
        "runner",
        "heartbeat_at",
        "created_at",
        "started_at",
        "finished_at",
    ]
    readonly_fields = fields

    def has_add_permission(self, request: HttpRequest) -> bool:
        user = request.user
        return user.has_perm("inference.add_modelpull") and user.has_perm(
            "inference.add_modelentry"
        )

    def has_change_permission(self, request: HttpRequest, obj=None) -> bool:
        return False  # a pull is asked for and cancelled, never edited

    def has_delete_permission(self, request: HttpRequest, obj=None) -> bool:
        return super().has_delete_permission(request, obj) and (obj is None or not obj.active)

    def delete_queryset(self, request, queryset):
        super().delete_queryset(request, queryset.exclude(state__in=ModelPull.ACTIVE_STATES))

    def may_cancel(self, request: HttpRequest) -> bool:
        return request.user.has_perm("inference.change_modelpull")

    def get_urls(self):
        view = self.admin_site.admin_view
        return [
            path("progress/", view(self.progress_view), name="inference_modelpull_progress"),
            path("<int:pk>/cancel/", view(self.cancel_view), name="inference_modelpull_cancel"),
            *super().get_urls(),
        ]

    @admin.display(description="hub id", ordering="source")
    def source_and_revision(self, obj: ModelPull) -> str:
        return f"{obj.source}@{obj.revision}" if obj.revision else obj.source

    @admin.display(description="state", ordering="state")
    def state_now(self, obj: ModelPull) -> str:
        return _live(obj, "state", pull_display(obj)["state"])

    @admin.display(description="progress")
    def progress(self, obj: ModelPull) -> str:
        shown = pull_display(obj)
        return _live(obj, "summary", shown["summary"])

    @admin.display(description="started by")
    def who(self, obj: ModelPull) -> str:
        return obj.started_by.get_username() if obj.started_by else f"({obj.origin})"

    def add_view(self, request: HttpRequest, form_url="", extra_context=None) -> HttpResponse:
        if not self.has_add_permission(request):
            raise PermissionDenied
        form = PullForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            data = form.cleaned_data
            try:
                pull = pull_create(
                    source=data["source"],
                    revision=data["revision"],
                    name=data["name"],
                    kind=data["kind"],
                    bits=data["quantize"],
                    group_size=data["group_size"],
                    started_by=request.user,
                    origin=ModelPull.Origin.ADMIN,
                )
            except PullRequestError as exc:
                form.add_error(None, str(exc))
            else:
                wake_pull_runner()
                messages.success(request, MESSAGE_STARTED.format(source=pull, name=pull.name))
                return HttpResponseRedirect(
                    reverse("admin:inference_modelpull_change", args=[pull.pk])
                )
        context = {
            **self.admin_site.each_context(request),
            "title": "Pull a model from the hub",
            "opts": self.model._meta,
            "adminform": helpers.AdminForm(form, [(None, {"fields": list(form.fields)})], {}),
            "form": form,
            "endpoint": settings.HF_ENDPOINT,
            "runs_here": settings.ORCHARD_PULL_RUNNER,
        }
        return TemplateResponse(request, ADD_TEMPLATE, context)

    def change_view(self, request, object_id, form_url="", extra_context=None):
        pull = self.get_object(request, object_id)
        extra = {
            "pull": pull,
            "shown": pull_display(pull) if pull else None,
            "may_cancel": pull is not None and pull.active and self.may_cancel(request),
        }
        return super().change_view(request, object_id, form_url, {**(extra_context or {}), **extra})

    def progress_view(self, request: HttpRequest) -> JsonResponse:
        """The pulls asked for (`?ids=1,2`; else the latest), as the pages show them."""
        if not self.has_view_permission(request):
            raise PermissionDenied
        rows = ModelPull.objects.select_related("model").order_by("-created_at")
        ids = [int(i) for i in request.GET.get("ids", "").split(",") if i.strip().isdigit()]
        if ids:
            rows = rows.filter(pk__in=ids[:LIVE_ROWS])
        # (admin_view marks it never to be cached)
        return JsonResponse({"pulls": [pull_json(p) for p in rows[:LIVE_ROWS]]})

    def cancel_view(self, request: HttpRequest, pk: int) -> HttpResponse:
        if request.method != "POST":
            return HttpResponseNotAllowed(["POST"])
        if not self.may_cancel(request):
            raise PermissionDenied
        pull = get_object_or_404(ModelPull, pk=pk)
        if pull_cancel(pull_id=pull.pk):
            wake_pull_runner()
            messages.success(request, MESSAGE_CANCELLING.format(pk=pull.pk))
        else:
            messages.warning(request, MESSAGE_NOT_ACTIVE.format(pk=pull.pk))
        return HttpResponseRedirect(reverse("admin:inference_modelpull_change", args=[pull.pk]))


def pull_display(pull: ModelPull) -> dict[str, str]:
    """The row in words: its state, a one-line summary, bytes, rate, time left and error."""
    state = pull.state
    if pull.cancel_requested and pull.active:
        state += " (cancelling)"
    elif pull_is_stale(pull):
        state += f" ({STALE_NOTE})"
    done, total = pull.done_bytes, pull.total_bytes
    amount = ""
    if total:
        amount = (
            f"{min(100.0, 100 * done / total):.1f}% · {format_bytes(done)} of {format_bytes(total)}"
        )
    elif done:
        amount = format_bytes(done)
    rate = (
        f"{format_bytes(pull.rate_bytes_per_s)}/s" if pull.active and pull.rate_bytes_per_s else ""
    )
    eta = pull_eta_s(pull)
    left = _duration(eta) if eta is not None else ""
    parts = [p for p in (amount, rate, f"{left} left" if left else "") if p]
    summary = " · ".join(parts) or "-"
    if pull.error and not pull.active:
        summary = pull.error if pull.state == ModelPull.State.FAILED else summary
    return {
        "state": state,
        "summary": summary,
        "amount": amount or "-",
        "rate": rate or "-",
        "eta": left or "-",
        "error": pull.error,
    }


def pull_json(pull: ModelPull) -> dict:
    eta = pull_eta_s(pull)
    return {
        "id": pull.pk,
        "source": pull.source,
        "revision": pull.revision,
        "commit": pull.commit,
        "name": pull.name,
        "state": pull.state,
        "active": pull.active,
        "done_bytes": pull.done_bytes,
        "total_bytes": pull.total_bytes,
        "rate_bytes_per_s": pull.rate_bytes_per_s if pull.active else None,
        "eta_s": round(eta, 1) if eta is not None else None,
        "error": pull.error,
        "cancel_requested": pull.cancel_requested,
        "model_url": (
            reverse("admin:inference_modelentry_change", args=[pull.model_id])
            if pull.model_id
            else None
        ),
        "shown": pull_display(pull),
    }


def _live(pull: ModelPull, field: str, text: str) -> str:
    return format_html('<span data-pull="{}" data-field="{}">{}</span>', pull.pk, field, text)


def _duration(seconds: float) -> str:
    seconds = int(seconds + 0.5)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
