"""Quantized KV caches that batch: keys and values stored at 8 or 4 bits, as mlx-lm's
QuantizedKVCache stores them, in Orchard's continuous batching.

A float32 cache costs 4 bytes a key and a value element; at 8 bits with groups of 64 it is
1.125, at 4 bits 0.625 (each group keeps a float scale and bias), so the same memory holds
3.5-6x the tokens. mlx-lm 0.32 quantizes only a single sequence's cache (QuantizedKVCache): its
batch cache (BatchKVCache) keeps plain arrays, and nothing merges, extends, filters, rolls or
extracts quantized rows. Here:
- `QuantizedCache`: one sequence's cache (a prefill alone), quantized from its first token;
  it merges into the batch form as a KVCache merges into BatchKVCache.
- `BatchQuantizedKVCache`: the batch form, left-padded as BatchKVCache. Keys and values are
  mlx-lm's triples (packed uint32, scales, biases), token axis 2; its `bits` and `group_size`
  send attention to mlx-lm's quantized SDPA (Orchard's CPU attention passes such caches on).
  Every row operation is BatchKVCache's own, run once on each array of the triples.
- `quantize_layers`: a model's prompt cache with its plain KVCache layers made quantized.

Quantization is per token (groups along the head dimension), so a token's stored values do
not depend on its batch: a row decodes to the same tokens alone or batched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache, QuantizedKVCache

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
# What BatchKVCache keeps besides its arrays (mlx-lm 0.32).
_BOOKKEEPING = ("offset", "left_padding", "_idx", "_right_padding")


def check_group(head_dims: Iterable[int], group_size: int) -> None:
    """Raise ValueError unless `group_size` is one mlx-lm quantizes with and divides every
    attention head dimension of the model (keys and values are quantized in groups along it)."""
    if group_size not in GROUP_SIZES:
        raise ValueError(
            f"KV cache group size must be one of {', '.join(map(str, GROUP_SIZES))}, "
            f"not {group_size}"
        )
    bad = sorted(d for d in set(head_dims) if d % group_size)
    if bad:
        raise ValueError(
            f"KV cache group size {group_size} does not divide the model's head dimension "
            f"{', '.join(map(str, bad))}: choose a group size that does"
        )


def check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"KV cache bits must be 4 or 8, not {bits}")


def quantize_layers(cache: list, bits: int, group_size: int) -> list:
    """`cache` (a model's prompt cache, mlx-lm's make_prompt_cache) with each plain KVCache
    layer replaced by an empty QuantizedCache; other layers (recurrent state, sliding
    windows) are kept as they are."""
    check_bits(bits)
    return [QuantizedCache(group_size, bits) if type(c) is KVCache else c for c in cache]


class QuantizedCache(QuantizedKVCache):
    """One sequence's cache, quantized from token 0 (mlx-lm's QuantizedKVCache), with what
    Orchard's runner asks of a single-sequence cache: its size, bytes, and the merge."""

    def size(self) -> int:
        return self.offset

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else super().nbytes

    @classmethod
    def merge(cls, caches: list[QuantizedCache]) -> BatchQuantizedKVCache:
        return BatchQuantizedKVCache.merge(caches)


def _plain(cache: Any, part: int, own: bool) -> Any:
    """Array `part` of a quantized cache's triples as the plain cache BatchKVCache's (or, for a
    QuantizedCache, KVCache's) methods work on; with its bookkeeping (`own`) or a copy."""
    plain = BatchKVCache.__new__(BatchKVCache) if hasattr(cache, "_idx") else KVCache()
    plain.keys = None if cache.keys is None else cache.keys[part]
    plain.values = None if cache.values is None else cache.values[part]
    for name in _BOOKKEEPING:
        if hasattr(cache, name):
            value = getattr(cache, name)
            # Copied: BatchKVCache updates some in place (`left_padding += ...`).
            copy = not own and isinstance(value, mx.array)
            setattr(plain, name, mx.array(value) if copy else value)
    return plain


def _parts(*caches: Any) -> int:
    return max((len(c.keys) for c in caches if c.keys is not None), default=1)


class BatchQuantizedKVCache(BatchKVCache):
    """The batch form of QuantizedCache: BatchKVCache's left-padded rows, with keys and values
    as quantized triples. `bits` and `group_size` route attention to the quantized SDPA."""

    def __init__(self, left_padding: list[int], group_size: int = 64, bits: int = 8):
        super().__init__(left_padding)
        self.group_size = group_size
        self.bits = bits

    def _apply(
        self, method: Callable, parts: int, args: Callable[[int], tuple] = lambda part: ()
    ) -> list:
        """Run BatchKVCache's `method` on each array of the triples (`args(part)` its arguments):
        the arrays come back to the triples, the bookkeeping from the first run (every run
        keeps the same). The runs' results, by part."""
        plains = [_plain(self, part, own=part == 0) for part in range(parts)]
        results = [method(plain, *args(part)) for part, plain in enumerate(plains)]
        self._adopt(plains)
        return results

    def _adopt(self, plains: list) -> None:
        for name in _BOOKKEEPING:
            setattr(self, name, getattr(plains[0], name))
        if plains[0].keys is None:
            self.keys = self.values = None
        else:
            self.keys = tuple(p.keys for p in plains)
            self.values = tuple(p.values for p in plains)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple:
        keys, values = (
            mx.quantize(x, group_size=self.group_size, bits=self.bits) for x in (keys, values)
        )
        fetched = self._apply(
            BatchKVCache.update_and_fetch, len(keys), lambda part: (keys[part], values[part])
        )
        return tuple(zip(*fetched, strict=True))

    def keys_and_values(self) -> tuple:
        fetched = self._apply(BatchKVCache.keys_and_values, _parts(self))
        return tuple(zip(*fetched, strict=True))

    def finalize(self) -> None:
        self._apply(BatchKVCache.finalize, _parts(self))

    def filter(self, batch_indices: Any) -> None:
        self._apply(BatchKVCache.filter, _parts(self), lambda part: (batch_indices,))

    def extend(self, other: BatchQuantizedKVCache) -> None:
        if (other.bits, other.group_size) != (self.bits, self.group_size):
            raise ValueError("cannot batch KV caches quantized differently")
        self._apply(
            BatchKVCache.extend,
            _parts(self, other),
            lambda part: (_plain(other, part, own=False),),
        )

    def extract(self, idx: int) -> QuantizedCache:
        rows = [BatchKVCache.extract(_plain(self, p, own=False), idx) for p in range(_parts(self))]
        cache = QuantizedCache(self.group_size, self.bits)
        cache.keys = tuple(row.keys for row in rows)
        cache.values = tuple(row.values for row in rows)
        cache.offset = rows[0].offset
        return cache

    @classmethod
    def merge(cls, caches: list[QuantizedCache]) -> BatchQuantizedKVCache:
        kinds = {(c.group_size, c.bits) for c in caches}
        if len(kinds) != 1:
            raise ValueError("cannot batch KV caches quantized differently")
        ((group_size, bits),) = kinds
        merged = cls([0] * len(caches), group_size, bits)
        if max(c.size() for c in caches) == 0:
            return merged
        parts = [[_plain(c, part, own=True) for c in caches] for part in range(_parts(*caches))]
        merged._adopt([BatchKVCache.merge(plains) for plains in parts])
        return merged

    @property
    def state(self) -> tuple:
        return (*super().state, self.group_size, self.bits)

    @state.setter
    def state(self, v: tuple) -> None:
        *base, self.group_size, self.bits = v
        BatchKVCache.state.fset(self, tuple(base))

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in (*self.keys, *self.values))
