"""/v1/files: OpenAI's Files API over a team's files (inference/batches/files.py).

Like GET /v1/models and /v1/responses/{id}, these routes authenticate the key but spend none of
its rpm or tokens: they run no model (an upload's size is bounded by the body cap and the team's
storage quota). The key is checked before the body is parsed: an upload's multipart body (which
Django's ASGI handler has spooled to a temporary file, past FILE_UPLOAD_MAX_MEMORY_SIZE, before
the view runs) is parsed only for a known key, off the event loop, its file part written to a
temporary file by Django's upload handlers and streamed from there into the team's folder.
Content is streamed back in chunks, never read whole.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, BinaryIO

from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.exceptions import RequestDataTooBig, SuspiciousOperation
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.http.multipartparser import MultiPartParserError
from django.utils.http import content_disposition_header
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_http_methods
from rest_framework import serializers

from accounts.models import ApiKey
from inference.api.bodies import validate
from inference.api.common import ClosingStreamingResponse, authenticate
from inference.batch_models import StoredFile
from inference.batches.files import (
    UPLOAD_PURPOSES,
    FileError,
    FileInUse,
    FileTooLarge,
    file_create,
    file_delete,
    file_get,
    file_list,
    file_open,
)
from inference.errors import APIError

# An upload's body is its file and a few form fields, each with a part header and boundaries:
# the body cap on POST /v1/files (config/asgi.py) is the file limit plus this.
MULTIPART_OVERHEAD_BYTES = 64 * 1024
CONTENT_CHUNK_BYTES = 1 << 20
ERROR_PURPOSE = "Invalid 'purpose': {purpose!r}. Files may be uploaded for: {purposes}."
ERROR_MISSING = "Missing required parameter: '{param}'."
ERROR_NOT_FOUND = "No such File object: {file_id}"
ERROR_MULTIPART = "The body must be multipart/form-data with a 'file' and a 'purpose': {reason}"


def upload_body_cap() -> int:
    """The most bytes a POST /v1/files body may have (inference/body_cap.py)."""
    return settings.ORCHARD_FILE_MAX_BYTES + MULTIPART_OVERHEAD_BYTES


class FileListQuerySerializer(serializers.Serializer):
    purpose = serializers.CharField(max_length=40, required=False)
    limit = serializers.IntegerField(min_value=1, max_value=10000, required=False, default=10000)
    order = serializers.ChoiceField(choices=("asc", "desc"), required=False, default="desc")
    after = serializers.CharField(max_length=200, required=False)


def file_object(stored: StoredFile) -> dict[str, Any]:
    """`stored` as OpenAI's file object."""
    expires_at = stored.expires_at
    return {
        "id": stored.pk,
        "object": "file",
        "bytes": stored.num_bytes,
        "created_at": int(stored.created_at.timestamp()),
        "expires_at": int(expires_at.timestamp()) if expires_at is not None else None,
        "filename": stored.filename,
        "purpose": stored.purpose,
        "status": "processed",
        "status_details": None,
    }


def _not_found(file_id: str) -> APIError:
    return APIError(404, ERROR_NOT_FOUND.format(file_id=file_id), param="id")


@csrf_exempt
@require_http_methods(["GET", "POST"])
async def files(request: HttpRequest) -> HttpResponse:
    api_key = await authenticate(request)  # before a byte of the body is parsed
    if request.method == "POST":
        stored = await sync_to_async(_upload)(request, api_key)
        return JsonResponse(file_object(stored))
    query = validate(FileListQuerySerializer, request.GET.dict())
    page, has_more = await sync_to_async(file_list)(
        team_id=api_key.team_id,
        purpose=query.get("purpose"),
        after=query.get("after"),
        limit=query["limit"],
        order=query["order"],
    )
    return JsonResponse(
        {
            "object": "list",
            "data": [file_object(stored) for stored in page],
            "first_id": page[0].pk if page else None,
            "last_id": page[-1].pk if page else None,
            "has_more": has_more,
        }
    )


def _upload(request: HttpRequest, api_key: ApiKey) -> StoredFile:
    # On the request's thread: parsing the multipart body and copying the file are disk work.
    try:
        purpose = request.POST.get("purpose")
        upload = request.FILES.get("file")
    except RequestDataTooBig:
        raise APIError(413, "The form fields are too large.", code="request_too_large") from None
    except (MultiPartParserError, SuspiciousOperation) as exc:
        raise APIError(400, ERROR_MULTIPART.format(reason=exc)) from None
    if not purpose:
        raise APIError(400, ERROR_MISSING.format(param="purpose"), param="purpose")
    if purpose not in UPLOAD_PURPOSES:
        purposes = ", ".join(UPLOAD_PURPOSES)
        message = ERROR_PURPOSE.format(purpose=purpose, purposes=purposes)
        raise APIError(400, message, param="purpose", code="invalid_value")
    if upload is None:
        raise APIError(400, ERROR_MISSING.format(param="file"), param="file")
    try:
        return file_create(
            api_key=api_key,
            purpose=purpose,
            filename=upload.name or "file.jsonl",
            chunks=upload.chunks(CONTENT_CHUNK_BYTES),
        )
    except FileTooLarge as exc:
        raise APIError(413, exc.message, param="file", code=exc.code) from None
    except FileError as exc:  # FileQuotaExceeded, not UTF-8, empty
        raise APIError(400, exc.message, param="file", code=exc.code) from None
    finally:
        upload.close()


@csrf_exempt
@require_http_methods(["GET", "DELETE"])
async def file_detail(request: HttpRequest, file_id: str) -> HttpResponse:
    api_key = await authenticate(request)
    if request.method == "DELETE":
        try:
            deleted = await sync_to_async(file_delete)(team_id=api_key.team_id, file_id=file_id)
        except FileInUse as exc:
            raise APIError(409, exc.message, param="id", code=exc.code) from None
        if not deleted:
            raise _not_found(file_id)
        return JsonResponse({"id": file_id, "object": "file", "deleted": True})
    stored = await sync_to_async(file_get)(team_id=api_key.team_id, file_id=file_id)
    if stored is None:
        raise _not_found(file_id)
    return JsonResponse(file_object(stored))


@csrf_exempt
@require_GET
async def file_content(request: HttpRequest, file_id: str) -> HttpResponse:
    api_key = await authenticate(request)
    stored = await sync_to_async(file_get)(team_id=api_key.team_id, file_id=file_id)
    if stored is None:
        raise _not_found(file_id)
    try:
        handle = await asyncio.to_thread(file_open, stored)
    except FileNotFoundError:  # deleted since it was looked up
        raise _not_found(file_id) from None
    return file_attachment(stored, handle)


def file_attachment(stored: StoredFile, handle: BinaryIO) -> HttpResponse:
    """`stored`'s bytes from `handle` (closed once sent) as a download named as the file was
    (this route, and the pages' downloads). Not FileResponse: under ASGI Django reads a
    synchronous iterator whole before sending it."""
    response = ClosingStreamingResponse(_read(handle), content_type="application/octet-stream")
    response["Content-Length"] = str(stored.num_bytes)
    response["Content-Disposition"] = content_disposition_header(True, stored.filename)
    return response


async def _read(handle: BinaryIO) -> AsyncIterator[bytes]:
    try:
        while chunk := await asyncio.to_thread(handle.read, CONTENT_CHUNK_BYTES):
            yield chunk
    finally:
        handle.close()
