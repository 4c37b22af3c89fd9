"""A model folder's config.json, read without loading the model (no MLX): for the loader and for
pages that describe models that are not loaded."""

from __future__ import annotations

import functools
import json
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_CONTEXT_LENGTH = 4096
_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")
# safetensors' dtype names, as a page says them.
_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


@dataclass(frozen=True)
class FolderFacts:
    """What a model folder says of its weights without loading them: how they are stored
    ("4-bit, group 64", "float32"; None when it cannot tell) and the folder's bytes on disk."""

    quantization: str | None
    size_bytes: int
    # What its prompts may hold: a vision-language model (a vision_config) takes images.
    input_kinds: tuple[str, ...] = ("text",)


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


def embedding_context_length(path: str | Path, config: Mapping[str, Any]) -> int:
    """The tokens an encoder folder takes per input: its sentence-transformers
    max_seq_length where it names one, within the model's positions."""
    positions = config["max_position_embeddings"]
    max_length = None
    settings = Path(path) / "sentence_bert_config.json"
    if settings.exists():
        max_length = json.loads(settings.read_text()).get("max_seq_length")
    return min(max_length or positions, positions)


def folder_embedding_context_length(path: str | Path) -> int | None:
    """`embedding_context_length` of an encoder folder; None when it cannot be read."""
    try:
        config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
        return embedding_context_length(path, config)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def folder_facts(path: str | Path) -> FolderFacts | None:
    """The folder's `FolderFacts`; None when it cannot be read. Reads config.json and the
    safetensors headers (a few kilobytes), cached while the folder is unchanged."""
    folder = Path(path)
    try:
        return _cached_facts(str(folder), folder.stat().st_mtime_ns)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
        return None


@functools.lru_cache(maxsize=256)
def _cached_facts(folder: str, mtime_ns: int) -> FolderFacts:
    path = Path(folder)
    files = [f for f in path.rglob("*") if f.is_file()]
    config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    quantization = config.get("quantization") if isinstance(config, dict) else None
    if isinstance(quantization, dict) and "bits" in quantization:
        described = f"{quantization['bits']}-bit"
        if "group_size" in quantization:
            described += f", group {quantization['group_size']}"
    else:
        described = _weights_dtype([f for f in files if f.suffix == ".safetensors"])
    vision = isinstance(config, dict) and isinstance(config.get("vision_config"), dict)
    return FolderFacts(
        quantization=described,
        size_bytes=sum(f.stat().st_size for f in files),
        input_kinds=("text", "image") if vision else ("text",),
    )


def _weights_dtype(files: list[Path]) -> str | None:
    """The dtype most of the weights' values are stored in, from the safetensors headers."""
    counts: Counter[str] = Counter()
    for file in files:
        with file.open("rb") as stream:
            (length,) = struct.unpack("<Q", stream.read(8))
            header = json.loads(stream.read(length))
        for name, tensor in header.items():
            if name != "__metadata__":
                counts[tensor["dtype"]] += tensor["data_offsets"][1] - tensor["data_offsets"][0]
    if not counts:
        return None
    dtype = counts.most_common(1)[0][0]
    return _DTYPES.get(dtype, dtype.lower())
