"""The running-now page for staff: each request in progress (key, member, team, model, tokens
so far, elapsed time) with a Cancel button for the teams the user owns. The rows are those of
every web process (inference/services/running.py); the page refreshes its table itself
(inference/static/web/running.js)."""

from __future__ import annotations

from django.contrib import messages
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.utils import timezone

from inference.models import UsageRecord
from inference.services.running import (
    CANCEL_REQUESTED,
    TICK_S,
    running_request_cancel,
    running_requests_cancellable_by,
    running_requests_visible_to,
)

TEMPLATE = "admin/inference/usagerecord/running.html"
MESSAGE_CANCELLING = "Cancelling {request}: it stops within {seconds:g} s."
MESSAGE_NOT_RUNNING = "{request} is no longer running, or is not yours to stop."
ROWS_SHOWN = 200  # the oldest first; more than this many at once is a page of its own


def running_view(model_admin, request: HttpRequest) -> HttpResponse:
    if not model_admin.has_view_permission(request):
        raise PermissionDenied
    if request.method == "POST":
        return _cancel(request)
    now = timezone.now()
    records = list(running_requests_visible_to(user=request.user)[:ROWS_SHOWN])
    may_cancel = running_requests_cancellable_by(user=request.user)
    rows = [
        {
            "record": record,
            "elapsed": _elapsed((now - record.started_at).total_seconds()),
            "cancelling": record.error_code == CANCEL_REQUESTED,
            "may_cancel": may_cancel(record),
        }
        for record in records
    ]
    context = {
        **model_admin.admin_site.each_context(request),
        "title": "Requests running now",
        "opts": UsageRecord._meta,
        "rows": rows,
        "shown_max": ROWS_SHOWN,
        "is_nav_sidebar_enabled": False,
    }
    return TemplateResponse(request, TEMPLATE, context)


def _cancel(request: HttpRequest) -> HttpResponse:
    record_id = request.POST.get("record") or ""
    label = request.POST.get("label") or "That request"
    if record_id.isdigit() and running_request_cancel(user=request.user, record_id=int(record_id)):
        messages.success(request, MESSAGE_CANCELLING.format(request=label, seconds=TICK_S))
    else:
        messages.warning(request, MESSAGE_NOT_RUNNING.format(request=label))
    return HttpResponseRedirect(request.path)


def _elapsed(seconds: float) -> str:
    """12.3 s, 4 min 05 s."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, rest = divmod(int(seconds), 60)
    return f"{minutes} min {rest:02d} s"
