"""The playground: a member tries a chat model in the browser, with a short-lived key the page
makes from one of their own keys (accounts.services.playground_key_create) and revokes when it
is left or they sign out. The page calls /v1/chat/completions itself (inference/static/web/
playground.js), so every request is metered, limited and logged like any other."""

from __future__ import annotations

from dataclasses import dataclass

from django.contrib.auth.decorators import login_required
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_POST

from accounts.selectors import playground_parent_keys
from accounts.services import (
    ERROR_PLAYGROUND_MODEL,
    ERROR_PLAYGROUND_PARENT,
    PlaygroundKeyRefused,
    playground_key_create,
    playground_key_revoke,
)
from inference.models import ModelEntry
from inference.services.registry import models_for_key


@dataclass(frozen=True)
class ParentKey:
    id: int
    label: str
    models: list[str]  # the chat models it allows


def _parent_keys(user) -> list[ParentKey]:
    """The user's keys the page may make a playground key from, each with the chat models it
    allows; keys that allow none are left out."""
    parents = []
    for key in playground_parent_keys(user=user):
        names = sorted(e.name for e in models_for_key(key) if e.kind == ModelEntry.Kind.CHAT)
        if names:
            label = f"{key.name or 'unlabelled'} ({key.prefix}…, {key.team})"
            parents.append(ParentKey(id=key.pk, label=label, models=names))
    return parents


@login_required
def playground(request: HttpRequest) -> HttpResponse:
    parents = _parent_keys(request.user)
    models = sorted({name for parent in parents for name in parent.models})
    default = ModelEntry.objects.filter(is_default=True, name__in=models).first()
    context = {
        "parents": parents,
        "models": models,
        "default_model": default.name if default else (models[0] if models else ""),
        "base_url": request.build_absolute_uri("/v1").rstrip("/"),
    }
    return render(request, "web/playground.html", context)


@login_required
@require_POST
def playground_key(request: HttpRequest) -> JsonResponse:
    """Make the page's key: `key` (the id of the user's key to spend) and `model`. The raw key
    goes to the page's script only, in this response, never stored."""
    model = request.POST.get("model") or ""
    parent_id = request.POST.get("key") or ""
    parent = next((p for p in _parent_keys(request.user) if str(p.id) == parent_id), None)
    if parent is None:
        return JsonResponse({"error": ERROR_PLAYGROUND_PARENT}, status=400)
    if model not in parent.models:
        return JsonResponse({"error": ERROR_PLAYGROUND_MODEL.format(model=model)}, status=400)
    try:
        api_key, raw_key = playground_key_create(
            user=request.user, parent_id=parent.id, model=model
        )
    except PlaygroundKeyRefused as exc:
        return JsonResponse({"error": str(exc)}, status=400)
    body = {
        "id": api_key.pk,
        "key": raw_key,
        "prefix": api_key.prefix,
        "expires_at": api_key.expires_at.isoformat(),
    }
    response = JsonResponse(body, status=201)
    response["Cache-Control"] = "no-store"
    return response


@login_required
@require_POST
def playground_key_end(request: HttpRequest) -> HttpResponse:
    """Revoke the page's key (sent as a beacon when the page is left, or when it changes key)."""
    key_id = request.POST.get("id") or ""
    if key_id.isdigit():
        playground_key_revoke(user=request.user, key_id=int(key_id))
    return HttpResponse(status=204)
