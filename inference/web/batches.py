"""The members' Batches page: their teams' batches (/v1/batches) with their progress, links to
download their files, and Cancel; and the download itself (session-authenticated, no key).

Who sees and cancels what is in inference/batches/selectors.py: a member sees every batch of
their teams (another team's batch or file is a 404), and cancels those made with their own
keys; a team's owners cancel any of the team's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from asgiref.sync import sync_to_async
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.http import Http404, HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import render
from django.urls import reverse
from django.views.decorators.http import require_GET, require_POST

from inference.batch_models import Batch
from inference.batches.file_views import file_attachment
from inference.batches.files import file_open
from inference.batches.runner import wake_batch_runner
from inference.batches.selectors import (
    BatchRights,
    batch_finished_at,
    batch_rights,
    member_batch_get,
    member_batches,
    member_file_get,
)
from inference.batches.services import batch_cancel
from inference.errors import APIError

BATCHES_PER_PAGE = 50
MESSAGE_CANCELLING = "Cancelling {batch_id}: what has finished is kept in its output file."
KEY_NOT_SHOWN = "a teammate's key"


@login_required
@require_GET
def batches_page(request: HttpRequest) -> HttpResponse:
    page = Paginator(member_batches(user=request.user), BATCHES_PER_PAGE).get_page(
        request.GET.get("page")
    )
    rights = batch_rights(user=request.user)
    context = {"page": page, "rows": [batch_row(batch, rights) for batch in page]}
    return render(request, "web/batches.html", context)


def batch_row(batch: Batch, rights: BatchRights) -> dict[str, Any]:
    """What the page shows of one batch."""
    done = batch.num_completed + batch.num_failed
    total = batch.num_total
    holds = rights.holds(batch)
    return {
        "batch": batch,
        "key": str(batch.api_key) if holds and batch.api_key else KEY_NOT_SHOWN,
        "done": done,
        "percent": round(100 * done / total) if total else None,
        "finished_at": batch_finished_at(batch),
        "input_name": batch.input_file.filename if batch.input_file else batch.input_file_name,
        "first_error": (batch.errors or [{}])[0].get("message"),
        "may_cancel": rights.may_cancel(batch),
    }


@login_required
@require_POST
def batch_cancel_page(request: HttpRequest, batch_id: str) -> HttpResponse:
    batch = member_batch_get(user=request.user, batch_id=batch_id)
    if batch is None or not batch_rights(user=request.user).holds(batch):
        raise Http404("No such batch.")
    try:
        batch_cancel(team_id=batch.team_id, batch_id=batch.id)
    except APIError as exc:  # it ended meanwhile (or had ended): nothing to stop
        messages.error(request, exc.message)
    else:
        wake_batch_runner()
        messages.success(request, MESSAGE_CANCELLING.format(batch_id=batch.id))
    target = reverse("web-batches")
    page = request.POST.get("page") or ""
    return HttpResponseRedirect(f"{target}?page={page}" if page.isdigit() else target)


@login_required
@require_GET
async def batch_file_download(request: HttpRequest, file_id: str) -> HttpResponse:
    stored = await sync_to_async(member_file_get)(user=await request.auser(), file_id=file_id)
    if stored is None:
        raise Http404("No such file.")
    try:
        handle = await asyncio.to_thread(file_open, stored)
    except FileNotFoundError:  # deleted since it was looked up
        raise Http404("No such file.") from None
    return file_attachment(stored, handle)
