"""GET /v1/models and /v1/models/{id}: the enabled models this key may use, less those that
failed to load."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET

from accounts.models import ApiKey
from engine import folder_facts
from inference.api.common import authenticate
from inference.errors import model_not_found
from inference.models import ModelEntry
from inference.services.catalog import models_offered
from inference.services.registry import model_for_key, models_for_key


@csrf_exempt
@require_GET
async def models_list(request: HttpRequest) -> HttpResponse:
    api_key = await authenticate(request)
    objects = await sync_to_async(_objects)(api_key)
    return JsonResponse({"object": "list", "data": objects})


@csrf_exempt
@require_GET
async def model_detail(request: HttpRequest, model_id: str) -> HttpResponse:
    api_key = await authenticate(request)
    objects = await sync_to_async(_objects)(api_key, model_id)
    if not objects:
        raise model_not_found(model_id)
    return JsonResponse(objects[0])


def _objects(api_key: ApiKey, name: str | None = None) -> list[dict[str, Any]]:
    # On a thread: the engines' state and the folders' facts are read here.
    return [_model_object(entry) for entry in _offered_to(api_key, name)]


def _offered_to(api_key: ApiKey, name: str | None = None) -> list[ModelEntry]:
    # On a thread: the engines' state may be read from Redis (remote workers' beats).
    if name is None:
        return models_offered(models_for_key(api_key))
    entry = model_for_key(api_key, name)
    return models_offered([entry]) if entry is not None else []


def _model_object(entry: ModelEntry) -> dict[str, Any]:
    """OpenAI's model object, and what a prompt to the model may hold (`input_kinds`:
    ["text"], or ["text", "image"] for a vision-language model, from its folder)."""
    facts = folder_facts(entry.path) if entry.kind == ModelEntry.Kind.CHAT else None
    return {
        "id": entry.name,
        "object": "model",
        "created": int(entry.created_at.timestamp()),
        "owned_by": "orchard",
        "input_kinds": list(facts.input_kinds) if facts is not None else ["text"],
    }
