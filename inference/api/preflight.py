"""Large request bodies checked in a process before the web process reads them.

Parsing JSON holds the interpreter lock for as long as the body is long (`json.loads` of a
2.6 MB schema: about 20 ms of C code with no break), and while it does, every request of every
team in the web process waits: its event loop, its engine's thread, its token streams. A body
that the checks then refuse bought nothing for that time, and a team can send one after
another. So a body of ORCHARD_PREFLIGHT_BYTES or more is read and checked first in a process
of this pool (in Linux's idle scheduling class, like the tokenizer processes' long jobs), as a
job of its team on the fair preparation gate: a body the checks refuse is answered with their error
without the web process ever parsing it. A body they accept comes back as the serializer's
checked data, which the web process only builds its call from: unpickling it is a fraction of
parsing and validating the body again (a 1 MB message: 0.1 ms against 5.5 ms of the lock,
measured here), and a flood of long prompts would otherwise take that lock in turns with every
team's requests (bench/isolation.py's renders).

A process that fails, or a check past ORCHARD_PREFLIGHT_TIMEOUT_SECONDS of its CPU time (or six
times as long in all: a machine too busy to give an idle-class process time), lets the body
through to the in-process read: the preflight only ever spares work, it never refuses what the
endpoint itself would accept. /v1/embeddings skips it: its large bodies are token ids or texts
that are mostly valid, with no grammar to refuse.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from django.conf import settings
from rest_framework import serializers

from engine import EngineError, InvalidRequestError, TokenizerProcesses
from inference.errors import APIError
from inference.services import metrics
from inference.services.admission import Intake
from inference.services.engines import tokenizer_pool

logger = logging.getLogger(__name__)

ERROR_TIMEOUT = "The preflight check took longer than {seconds:g} s."

_pool: TokenizerProcesses | None = None
_pool_lock = threading.Lock()


def _processes() -> TokenizerProcesses:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = TokenizerProcesses(tokenizer_pool())
        return _pool


def _path(thing: Callable | type) -> str:
    path = f"{thing.__module__}.{thing.__qualname__}"
    if "<locals>" in path:
        raise ValueError(f"{path} cannot be imported by a preflight process")
    return path


def needed(body: bytes) -> bool:
    return 0 < settings.ORCHARD_PREFLIGHT_BYTES <= len(body)


async def preflight(
    intake: Intake,
    body: bytes,
    serializer_class: type[serializers.Serializer],
    build: Callable[[dict[str, Any]], Any] | None,
) -> dict[str, Any] | None:
    """Raise the APIError the endpoint's read of `body` would raise, found in a process; or
    return the serializer's validated data. None: not checked (the web process reads it)."""
    from inference.api.body_check import DJANGO, check_body

    args = (body, _path(serializer_class), _path(build) if build is not None else None)
    seconds = settings.ORCHARD_PREFLIGHT_TIMEOUT_SECONDS
    timeout = InvalidRequestError(ERROR_TIMEOUT.format(seconds=seconds))
    try:
        verdict, found = await intake.prepare(
            lambda: _processes().run(
                DJANGO,
                check_body,
                *args,
                timeout_s=seconds,
                timeout_error=timeout,
                low=True,
            )
        )
    except (EngineError, InvalidRequestError) as exc:
        logger.warning("preflight of a %d-byte body failed (%s); reading it here", len(body), exc)
        metrics.PREFLIGHTS.labels("failed").inc()
        return None
    if verdict == "accepted":
        metrics.PREFLIGHTS.labels("accepted").inc()
        return found
    metrics.PREFLIGHTS.labels("refused").inc()
    status, message, param, code, kind = found
    raise APIError(status, message, param=param, code=code, type=kind)
