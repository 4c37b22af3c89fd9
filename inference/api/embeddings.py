"""POST /v1/embeddings: validate → embeddings service → OpenAI's list of embedding objects
(`encoding_format` float, or base64 of little-endian float32 as the SDKs decode it)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from django.http import HttpRequest, HttpResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_POST
from rest_framework import serializers

from inference.api.common import intake_for, json_response, read_body
from inference.api.serializers import IntField, StrictCharField, _is_int
from inference.services.admission import Intake
from inference.services.embeddings import embeddings_create


class EmbeddingsSerializer(serializers.Serializer):
    model = StrictCharField(max_length=200)
    input = serializers.JSONField()
    encoding_format = serializers.ChoiceField(
        choices=("float", "base64"), required=False, allow_null=True
    )
    dimensions = IntField(required=False, allow_null=True)
    user = StrictCharField(required=False, allow_null=True, allow_blank=True)

    def validate_input(self, value: Any) -> list[str] | list[list[int]]:
        """A string, a list of strings, a list of token ids, or a list of such lists."""
        if isinstance(value, str) and value:
            return [value]
        if isinstance(value, list) and value:
            if all(isinstance(item, str) and item for item in value):
                return list(value)
            if all(_is_int(token) for token in value):
                return [list(value)]
            if all(isinstance(item, list) and item and all(map(_is_int, item)) for item in value):
                return [list(item) for item in value]
        raise serializers.ValidationError(
            "input must be a non-empty string, a list of non-empty strings, or token ids (a "
            "list of integers or a list of such lists)."
        )


def _encoded(vector: np.ndarray, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.astype(np.float32).tolist()


@csrf_exempt
@require_POST
async def embeddings(request: HttpRequest) -> HttpResponse:
    async with intake_for(request, "embeddings") as intake:
        data, _ = await intake.in_thread(read_body, request, EmbeddingsSerializer)
        body, headers = await embeddings_object(intake, data)
    return json_response(body, headers)


async def embeddings_object(
    intake: Intake, data: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, str]]:
    """The list of embeddings a validated body asks for (a response, a batch's line), and the
    response's headers."""
    result = await embeddings_create(
        intake=intake,
        model=data["model"],
        inputs=data["input"],
        dimensions=data.get("dimensions"),
    )
    encoding = data.get("encoding_format") or "float"
    body = {
        "object": "list",
        "data": [
            {"object": "embedding", "index": index, "embedding": _encoded(vector, encoding)}
            for index, vector in enumerate(result.vectors)
        ],
        "model": result.model,
        "usage": {"prompt_tokens": result.num_tokens, "total_tokens": result.num_tokens},
    }
    return body, result.headers
