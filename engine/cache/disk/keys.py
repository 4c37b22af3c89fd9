"""Names on disk: which model folder, which scope, which tokens (no MLX, no I/O beyond reading a
model folder's listing).

An entry's key is a chained hash over the token ids from the root of its scope: the root's is a
hash of the format, the model's key and the scope; a block's is a hash of its parent's key and
its tokens, so equal keys mean equal tokens from the very first one, in the same scope of the
same model. The files still carry their token ids, checked on every read.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.cache.host import WEIGHT_SUFFIXES

if TYPE_CHECKING:
    from engine.cache.mlx_caches import CacheLayout

FORMAT_VERSION = 1
BLOCK = b"B"  # a block: exactly `block_tokens` tokens
END = b"E"  # an end: the tokens after the last whole block (and a hybrid model's state there)


def _sha(*parts: bytes) -> str:
    digest = hashlib.sha256()
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))  # unambiguous joins
        digest.update(part)
    return digest.hexdigest()


def token_bytes(tokens: Sequence[int]) -> bytes:
    return np.asarray(tokens, dtype="<u4").tobytes()


def root_key(model: str, scope: str) -> str:
    return _sha(b"orchard-prefix", str(FORMAT_VERSION).encode(), model.encode(), scope.encode())


def child_key(parent: str, kind: bytes, tokens: Sequence[int]) -> str:
    return _sha(parent.encode(), kind, token_bytes(tokens))


def chain(model: str, scope: str, tokens: Sequence[int], block_tokens: int, blocks: int) -> list:
    """The keys after 0, 1, ..., `blocks` whole blocks of `tokens`."""
    keys = [root_key(model, scope)]
    for index in range(blocks):
        span = tokens[index * block_tokens : (index + 1) * block_tokens]
        keys.append(child_key(keys[-1], BLOCK, span))
    return keys


def scope_folder(scope: str) -> str:
    """A scope's folder name: a hash, so that a scope's name (a team, a salt) is not on disk in
    the clear and every name is a valid one."""
    return _sha(b"scope", scope.encode())[:32]


def model_folder(name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name)[:48] or "model"
    return f"{slug}-{_sha(b'name', name.encode())[:8]}"


def model_key(path: str | Path, layout: CacheLayout, block_tokens: int) -> str | None:
    """A fingerprint of the model's weights and cache layout: its config.json, the name, size and
    modification time of every weight file, the layout's per-layer kinds and sizes (and its
    keys' quantization) and the block size. It changes whenever the weights, their layout or
    the format could, so a file computed by another model is never read. None when the path
    is not there to fingerprint."""
    folder = Path(path)
    try:
        if folder.is_file():
            files = [folder]
            config = b""
        else:
            files = sorted(f for f in folder.iterdir() if f.suffix in WEIGHT_SUFFIXES)
            config = (folder / "config.json").read_bytes()
        listing = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    except OSError:
        return None
    if not files:
        return None
    shape = [*layout.kinds, layout.kv_bytes_per_token, layout.state_bytes_per_sequence]
    if layout.quant is not None:  # the same bytes could hold keys at other bits or groups
        shape += [layout.quant.bits, layout.quant.group_size]
    described = json.dumps([FORMAT_VERSION, block_tokens, shape, listing])
    return _sha(b"model", config, described.encode())
