"""/v1/batches: create, retrieve, list (cursor pagination) and cancel, in OpenAI's shapes; a
key sees its team's batches only (another team's id is a 404)."""

from __future__ import annotations

from asgiref.sync import sync_to_async
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_http_methods, require_POST
from rest_framework import serializers

from inference.api.bodies import validate
from inference.api.common import authenticate, json_response, parse_json_body
from inference.batches.runner import wake_batch_runner
from inference.batches.services import (
    batch_cancel,
    batch_create,
    batch_get,
    batch_list,
    batch_not_found,
    batch_object,
)


class BatchListQuery(serializers.Serializer):
    after = serializers.CharField(required=False, max_length=64)
    limit = serializers.IntegerField(required=False, min_value=1, max_value=100, default=20)


@csrf_exempt
@require_http_methods(["GET", "POST"])
async def batches(request: HttpRequest) -> HttpResponse:
    api_key = await authenticate(request)
    if request.method == "POST":
        data = await sync_to_async(parse_json_body, thread_sensitive=False)(request)
        batch = await sync_to_async(batch_create)(
            api_key=api_key,
            input_file_id=data.get("input_file_id"),
            endpoint=data.get("endpoint"),
            completion_window=data.get("completion_window"),
            metadata=data.get("metadata"),
        )
        wake_batch_runner()
        return json_response(batch_object(batch), {})
    query = validate(BatchListQuery, request.GET.dict())
    page, has_more = await sync_to_async(batch_list)(
        team_id=api_key.team_id, after=query.get("after"), limit=query["limit"]
    )
    body = {
        "object": "list",
        "data": [batch_object(batch) for batch in page],
        "first_id": page[0].id if page else None,
        "last_id": page[-1].id if page else None,
        "has_more": has_more,
    }
    return json_response(body, {})


@csrf_exempt
@require_GET
async def batch_detail(request: HttpRequest, batch_id: str) -> HttpResponse:
    api_key = await authenticate(request)
    batch = await sync_to_async(batch_get)(team_id=api_key.team_id, batch_id=batch_id)
    if batch is None:
        raise batch_not_found(batch_id)
    return json_response(batch_object(batch), {})


@csrf_exempt
@require_POST
async def batch_cancel_view(request: HttpRequest, batch_id: str) -> HttpResponse:
    api_key = await authenticate(request)
    batch = await sync_to_async(batch_cancel)(team_id=api_key.team_id, batch_id=batch_id)
    if batch is None:
        raise batch_not_found(batch_id)
    wake_batch_runner()
    return json_response(batch_object(batch), {})
