"""A /v1 body read as its endpoint reads it: parsed as strict JSON (jsonbody.py), validated by
the endpoint's serializer, and built into the endpoint's call. The web process runs this on a
preparation thread (common.read_body); a preflight process runs it on a large body first
(preflight.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from django.core.exceptions import RequestDataTooBig
from django.http import HttpRequest
from rest_framework import serializers

from inference.api import jsonbody
from inference.errors import APIError

T = TypeVar("T")

ERROR_UNPARSABLE = (
    "We could not parse the JSON body of your request. (HINT: This likely means you aren't using "
    "your HTTP library correctly.)"
)


def check_body_bytes(
    body: bytes,
    serializer_class: type[serializers.Serializer],
    build: Callable[[dict[str, Any]], T] | None = None,
) -> tuple[dict[str, Any], T | None]:
    data = validate(serializer_class, parse_json(body))
    return data, None if build is None else build(data)


def request_body(request: HttpRequest) -> bytes:
    try:
        return request.body
    except RequestDataTooBig:
        raise APIError(413, "Request body too large.", code="request_too_large") from None


def parse_json(body: bytes) -> dict[str, Any]:
    try:
        data = jsonbody.loads(body)
    except jsonbody.BodyError as exc:
        raise APIError(400, f"{ERROR_UNPARSABLE} {exc}") from None
    if not isinstance(data, dict):
        raise APIError(400, "The request body must be a JSON object.")
    return data


def validate(serializer_class: type[serializers.Serializer], data: dict) -> dict[str, Any]:
    serializer = serializer_class(data=data)
    try:
        if not serializer.is_valid():
            param, message = _first_error(serializer.errors)
            raise APIError(400, f"Invalid '{param}': {message}", param=param)
        return serializer.validated_data
    finally:
        _unbind(serializer)


def _unbind(field: serializers.Field) -> None:
    """Let go of DRF's links back up the tree: each field keeps its serializer (`parent`) and a
    list's item field its list, while the serializer keeps its fields. Each request's serializer
    (a chat's: some 200 objects) would otherwise wait for the cyclic garbage collector, whose
    full collections hold the interpreter lock (common/request_threads.py). Once the data is
    out, nothing reads the tree again."""
    children = []
    fields = field.__dict__.pop("fields", None)  # a serializer's (a cached property)
    if fields is not None:
        children += fields.values()
    child = field.__dict__.get("child")  # a list's or a dict's item field
    if child is not None:
        children.append(child)
    field.__dict__.pop("parent", None)
    for child in children:
        _unbind(child)


def _first_error(errors: Any, path: str = "") -> tuple[str, str]:
    if isinstance(errors, dict):
        key, value = next(iter(errors.items()))
        return _first_error(value, f"{path}.{key}" if path else str(key))
    if isinstance(errors, list):
        if isinstance(errors[0], dict | list):
            return _first_error(errors[0], path)
        return path, str(errors[0])
    return path, str(errors)
