"""A model folder's config.json, read without loading the model (no MLX): for the loader and for
pages that describe models that are not loaded."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

DEFAULT_CONTEXT_LENGTH = 4096
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def context_length(config: Mapping[str, Any]) -> int:
    """The model's own maximum context, from its config (or the text config of a multimodal
    one); DEFAULT_CONTEXT_LENGTH when it says nothing."""
    for source in (config, config.get("text_config") or {}):
        for key in _CONTEXT_KEYS:
            if isinstance(source.get(key), int):
                return source[key]
    return DEFAULT_CONTEXT_LENGTH


def folder_context_length(path: str | Path) -> int | None:
    """`context_length` of the folder's config.json; None when it cannot be read."""
    file = Path(path) / "config.json"
    try:
        return _cached_context_length(str(file), file.stat().st_mtime_ns)
    except (OSError, ValueError, AttributeError):
        return None


@functools.lru_cache(maxsize=256)
def _cached_context_length(file: str, mtime_ns: int) -> int:
    config = json.loads(Path(file).read_text(encoding="utf-8"))
    if not isinstance(config, dict):
        raise ValueError("config.json is not an object")
    return context_length(config)
