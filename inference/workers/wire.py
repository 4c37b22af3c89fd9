"""What crosses the channel layer between web processes and engine workers.

Web → worker, on the worker's channel: `generate` (a GenerationRequest and the reply channel),
`abort` (model and request id: a generation's, or the `request_id` of an embed call),
`call` (an operation with a reply: render, detokenize, clear_cache, tokenize, embed; server.py
has them), and, on the registry group every worker joins, `registry.changed`, `load` and
`unload`. Worker → web, on the web process's reply channel: `events`, numbered per worker
(`seq`) so the receiver can restore their order, each a list of `[kind, id, payload]`: `out` (a
GenerationOutput), `rej` (a request refused before it ran), `res` (a call's result; an
embedding's vectors as float32 bytes with the tokens computed, or those tokens alone when an
abort stopped it).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from engine import (
    EngineError,
    EngineOverloadedError,
    GenerationOutput,
    InvalidRequestError,
    ModelCapacityError,
    ModelLoadError,
    ModelNotLoadedError,
    ModelUnavailableError,
)

_ERROR_KINDS: dict[str, type[EngineError]] = {
    "invalid": InvalidRequestError,
    "overloaded": EngineOverloadedError,
    "not_loaded": ModelNotLoadedError,
    "load_failed": ModelLoadError,
    "unavailable": ModelUnavailableError,
    "capacity": ModelCapacityError,
    "engine": EngineError,
}
# Fields a GenerationOutput always carries on the wire; the others only when set.
_ALWAYS = ("index", "text", "token_ids")
_DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(GenerationOutput) if f.name not in _ALWAYS
}


def worker_channel(namespace: str, worker_id: str) -> str:
    return f"{namespace}.worker.{worker_id}"


def registry_group(namespace: str) -> str:
    return f"{namespace}.registry"


def reply_prefix(namespace: str) -> str:
    return f"{namespace}.reply"


def safe_name(text: str) -> str:
    """`text` as a channel-name part (letters, digits, - _ .)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "-", text)[:60]


def encode_output(output: GenerationOutput) -> dict[str, Any]:
    data = dataclasses.asdict(output)
    return {key: value for key, value in data.items() if key in _ALWAYS or value != _DEFAULTS[key]}


def decode_output(data: dict[str, Any]) -> GenerationOutput:
    return GenerationOutput.from_dict(data)


def encode_error(exc: BaseException, *, retry: bool = False) -> dict[str, Any]:
    """An error for the caller; `retry`: another worker may take the request."""
    kind = next(
        (name for name, cls in _ERROR_KINDS.items() if type(exc) is cls),
        "invalid" if isinstance(exc, InvalidRequestError) else "engine",
    )
    return {
        "kind": kind,
        "message": str(exc) or type(exc).__name__,
        "param": getattr(exc, "param", None),
        "code": getattr(exc, "code", None),
        "retry": retry,
    }


def decode_error(data: dict[str, Any]) -> EngineError:
    cls = _ERROR_KINDS.get(data.get("kind"), EngineError)
    if cls is InvalidRequestError:
        return InvalidRequestError(data["message"], param=data.get("param"), code=data.get("code"))
    return cls(data["message"])
