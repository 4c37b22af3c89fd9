"""One entry, one file: a checked header and the raw bytes of its arrays (no MLX).

    MAGIC (8 bytes) | header length (u32) | CRC-32 of header and payload (u32) | header | payload

The header is JSON: the model's key, the scope, the entry's kind, key, parent key, first token
position and token ids, and per array its layer, part ("kv" or "state"), slot, dtype and shape;
the payload is the arrays' bytes in that order. A file whose length, checksum or header does
not agree is refused (`BadEntry`): a truncated, corrupt or foreign file is a miss, never data.
Writes go to a temporary file renamed into place, so a file is whole or absent.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import threading
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"ORCHPKV1"
PREAMBLE = struct.Struct("<8sII")
MAX_HEADER_BYTES = 64 << 20
SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
# The dtypes an entry may hold, by name, with their sizes in bytes.
ITEM_BYTES = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "int16": 2,
    "uint16": 2,
    "int8": 1,
    "uint8": 1,
}


class BadEntry(Exception):
    """A file that is not a whole, intact entry of the expected model and scope."""


@dataclass(frozen=True)
class ArraySpec:
    layer: int
    part: str  # "kv" (slot 0 keys, 1 values) or "state" (slot: index in the layer's state)
    slot: int
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return ITEM_BYTES[self.dtype] * int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class Header:
    model: str
    scope: str
    kind: str  # "block" | "end"
    key: str
    parent: str
    start: int  # position of the first token
    tokens: tuple[int, ...]
    arrays: tuple[ArraySpec, ...]

    @property
    def payload_bytes(self) -> int:
        return sum(spec.nbytes for spec in self.arrays)

    def encode(self) -> bytes:
        data = {
            **self.__dict__,
            "tokens": list(self.tokens),
            "arrays": [[a.layer, a.part, a.slot, a.dtype, list(a.shape)] for a in self.arrays],
        }
        return json.dumps(data, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Header:
        try:
            data = json.loads(raw)
            arrays = tuple(
                ArraySpec(int(layer), str(part), int(slot), str(dtype), tuple(map(int, shape)))
                for layer, part, slot, dtype, shape in data.pop("arrays")
            )
            header = cls(**{**data, "tokens": tuple(map(int, data["tokens"])), "arrays": arrays})
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise BadEntry(f"unreadable header: {exc}") from None
        if any(a.dtype not in ITEM_BYTES or min(a.shape, default=1) < 0 for a in header.arrays):
            raise BadEntry("unknown dtype or bad shape")
        return header


def file_name(key: str) -> str:
    return key + SUFFIX


def write_entry(folder: Path, header: Header, payload: Sequence) -> int:
    """Write an entry atomically (temporary file, then rename); returns the file's size.
    `payload`: one bytes-like object per array of the header, in order."""
    raw = header.encode()
    crc = zlib.crc32(raw)
    for part in payload:
        crc = zlib.crc32(part, crc)
    final = folder / file_name(header.key)
    temp = folder / f".{header.key}.{os.getpid()}.{threading.get_ident()}{TEMP_SUFFIX}"
    try:
        with open(temp, "wb") as out:
            _write(out, PREAMBLE.pack(MAGIC, len(raw), crc))
            _write(out, raw)
            for part in payload:
                _write(out, part)
        os.replace(temp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            temp.unlink(missing_ok=True)
        raise
    return PREAMBLE.size + len(raw) + header.payload_bytes


def _write(out, data) -> None:
    out.write(data)


def read_header(path: Path) -> tuple[Header, int]:
    """An entry's header and the file's size, checking that the size is the header's (the payload's
    checksum is checked when the entry is read)."""
    with open(path, "rb") as source:
        size = os.fstat(source.fileno()).st_size
        length, _ = _preamble(source.read(PREAMBLE.size), size)
        header = Header.decode(source.read(length))
    if size != PREAMBLE.size + length + header.payload_bytes:
        raise BadEntry(f"{size} bytes where the header says {header.payload_bytes} of payload")
    return header, size


def read_entry(path: Path) -> tuple[Header, memoryview]:
    """An entry's header and payload, after checking its length and checksum."""
    with open(path, "rb") as source:
        size = os.fstat(source.fileno()).st_size
        length, crc = _preamble(source.read(PREAMBLE.size), size)
        data = bytearray(size - PREAMBLE.size)
        if source.readinto(data) != len(data):
            raise BadEntry("the file changed while it was read")
    header = Header.decode(bytes(data[:length]))
    if len(data) != length + header.payload_bytes:
        raise BadEntry(f"{size} bytes where the header says {header.payload_bytes} of payload")
    if zlib.crc32(data) != crc:
        raise BadEntry("checksum mismatch")
    return header, memoryview(data)[length:]


def _preamble(raw: bytes, size: int) -> tuple[int, int]:
    if len(raw) != PREAMBLE.size:
        raise BadEntry("truncated")
    magic, length, crc = PREAMBLE.unpack(raw)
    if magic != MAGIC:
        raise BadEntry("not a prefix-cache entry")
    if length > min(MAX_HEADER_BYTES, size - PREAMBLE.size):
        raise BadEntry("truncated header")
    return length, crc
