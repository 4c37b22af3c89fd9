"""GET /v1/models and /v1/models/{id}: the enabled models this key may use."""

from __future__ import annotations

from typing import Any

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET

from inference.api.common import authenticate
from inference.errors import model_not_found
from inference.models import ModelEntry
from inference.services.registry import model_for_key, models_for_key


@csrf_exempt
@require_GET
async def models_list(request: HttpRequest) -> HttpResponse:
    api_key = await authenticate(request)
    entries = await sync_to_async(models_for_key)(api_key)
    return JsonResponse({"object": "list", "data": [_model_object(entry) for entry in entries]})


@csrf_exempt
@require_GET
async def model_detail(request: HttpRequest, model_id: str) -> HttpResponse:
    api_key = await authenticate(request)
    entry = await sync_to_async(model_for_key)(api_key, model_id)
    if entry is None:
        raise model_not_found(model_id)
    return JsonResponse(_model_object(entry))


def _model_object(entry: ModelEntry) -> dict[str, Any]:
    return {
        "id": entry.name,
        "object": "model",
        "created": int(entry.created_at.timestamp()),
        "owned_by": "orchard",
    }
