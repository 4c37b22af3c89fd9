"""What a preflight process runs (inference/api/preflight.py): a body read and checked as
its endpoint reads it; the error it is refused with, or the checked data it comes to.

Imported by a bare spawned process before Django is set up, so nothing at the top but the
standard library; Django starts when the process is sent `DJANGO`.
"""

from __future__ import annotations

from typing import Any


class Django:
    """What a preflight process is sent in place of a tokenizer: unpickling it there sets Django
    up, in the process's setup (a second or so of imports), which no check's deadline counts."""

    def __reduce__(self):
        return (_set_up, ())


def _set_up() -> Django:
    import django
    from django.apps import apps

    if not apps.ready:
        django.setup()
    return Django()


DJANGO = Django()


def check_body(_django: Django, body: bytes, serializer: str, build: str | None) -> tuple[str, Any]:
    """("refused", the status, message, param, code and type of the APIError `read_body`
    raises for `body`) or ("accepted", the serializer's validated data). `serializer` and
    `build` are dotted paths."""
    from django.utils.module_loading import import_string

    from inference.api.bodies import check_body_bytes
    from inference.errors import APIError

    try:
        data, _ = check_body_bytes(
            body, import_string(serializer), import_string(build) if build else None
        )
    except APIError as exc:
        return "refused", (exc.status, exc.message, exc.param, exc.code, exc.type)
    return "accepted", data
