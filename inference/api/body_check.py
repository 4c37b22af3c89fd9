"""What a preflight process runs (inference/api/preflight.py): a body read and checked as
its endpoint reads it, here only to learn whether it is refused.

Imported by a bare spawned process before Django is set up, so nothing at the top but the
standard library; Django starts on the first check.
"""

from __future__ import annotations

from typing import Any

_ready = False


def check_body(_tokenizer: None, body: bytes, serializer: str, build: str | None) -> Any:
    """The APIError `read_body` raises for `body` (its status, message, param, code and type),
    or None when it is accepted. `serializer` and `build` are dotted paths."""
    global _ready
    if not _ready:
        import django

        django.setup()
        _ready = True
    from django.utils.module_loading import import_string

    from inference.api.bodies import check_body_bytes
    from inference.errors import APIError

    try:
        check_body_bytes(body, import_string(serializer), import_string(build) if build else None)
    except APIError as exc:
        return (exc.status, exc.message, exc.param, exc.code, exc.type)
    return None
