"""The one module that reads and writes the contents of mlx-lm's cache objects.

mlx-lm's cache classes (KVCache, ArraysCache and their batch forms) change between releases;
what Orchard needs from their insides is here: making, merging and extending caches for the
batch, copying a sequence's keys, values and recurrent state out (for the prefix cache), seeding
a fresh cache from a prefix-cache hit, and measuring what a token and a sequence cost in bytes.
Only a model's engine thread calls into it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, make_prompt_cache

from engine.cache.prefix import KVSource, LayerKV, LayerState, PrefixCache, PrefixHit

Cache = list[Any]


@dataclass(frozen=True)
class CacheLayout:
    """What a model's cache is made of: per layer "kv" (attention: keys and values per token)
    or "state" (recurrent: fixed-size state), and what one token and one sequence cost."""

    kinds: tuple[str, ...]
    kv_bytes_per_token: int
    state_bytes_per_sequence: int

    @property
    def hybrid(self) -> bool:
        return "state" in self.kinds


def make_cache(model: nn.Module) -> Cache:
    return make_prompt_cache(model)


def merge(caches: list[Cache]) -> Cache:
    # Merging copies, so n choices forked from one prompt cache get independent rows.
    return [type(layers[0]).merge(list(layers)) for layers in zip(*caches, strict=True)]


def concatenate(first: Cache, second: Cache) -> Cache:
    for layer, other in zip(first, second, strict=True):
        layer.extend(other)
    return first


def layout(model: nn.Module) -> CacheLayout | None:
    """Probe the model's cache with one token; None when a layer's cache is of a kind the
    prefix cache cannot slice (sliding windows, quantized caches, ...)."""
    cache = make_cache(model)
    kinds = []
    for layer in cache:
        if type(layer) is KVCache:
            kinds.append("kv")
        elif type(layer) is ArraysCache:
            kinds.append("state")
        else:
            return None
    model(mx.array([[0]]), cache=cache)
    mx.eval([layer.state for layer in cache])
    per_token = sum(
        (layer.keys.nbytes + layer.values.nbytes) // layer.keys.shape[2]
        for layer in cache
        if isinstance(layer, KVCache)
    )
    per_sequence = sum(layer.nbytes for layer in cache if isinstance(layer, ArraysCache))
    return CacheLayout(tuple(kinds), per_token, per_sequence)


def seed(model: nn.Module, hit: PrefixHit, room: int = 0) -> Cache:
    """A fresh cache holding a prefix-cache hit: its first `hit.length` tokens computed, with
    space for `room` more allocated in the same copy (else the first tokens added would copy
    everything again to grow it)."""
    cache = make_cache(model)
    step = KVCache.step
    capacity = -(-(hit.length + room) // step) * step
    for index, layer in enumerate(cache):
        if isinstance(layer, KVCache):
            keys, values = hit.kv[index]
            pad = capacity - hit.length
            if pad:
                keys = mx.concatenate(
                    [keys, mx.zeros((*keys.shape[:2], pad, keys.shape[3]), keys.dtype)], axis=2
                )
                values = mx.concatenate(
                    [values, mx.zeros((*values.shape[:2], pad, values.shape[3]), values.dtype)],
                    axis=2,
                )
            layer.keys, layer.values = keys, values
            layer.offset = hit.length
        else:
            layer.cache = [mx.contiguous(a) for a in hit.state[index]]
    return cache


def kv_source(cache: Cache, row: int | None = None) -> KVSource:
    """Copies of a span of one sequence's keys and values: from a sequence's own cache
    (`row` None) or from row `row` of a batch cache."""
    if row is None:
        offsets = [0] * len(cache)
    else:
        offsets = [
            layer.left_padding[row].item() if isinstance(layer, BatchKVCache) else 0
            for layer in cache
        ]

    def source(start: int, end: int) -> LayerKV:
        layers: LayerKV = []
        for layer, pad in zip(cache, offsets, strict=True):
            if not isinstance(layer, KVCache | BatchKVCache):
                layers.append(None)
                continue
            rows = slice(None) if row is None else slice(row, row + 1)
            span = slice(pad + start, pad + end)
            layers.append(
                (
                    mx.contiguous(layer.keys[rows, :, span, :]),
                    mx.contiguous(layer.values[rows, :, span, :]),
                )
            )
        return layers

    return source


def state_of(cache: Cache, row: int | None = None) -> LayerState:
    """Copies of one sequence's recurrent state (None for attention layers)."""
    rows = slice(None) if row is None else slice(row, row + 1)
    return [
        tuple(mx.contiguous(a[rows]) for a in layer.cache)
        if isinstance(layer, ArraysCache)
        else None
        for layer in cache
    ]


def remember(
    prefix_cache: PrefixCache | None,
    tokens: Sequence[int],
    cache: Cache,
    *,
    scope: str,
    row: int | None = None,
    hybrid: bool = False,
) -> None:
    """Insert the computed state of `tokens` (the first len(tokens) positions of `cache`, or
    of its row `row`) into the prefix cache, under the request's `scope`."""
    if prefix_cache is None or not tokens:
        return
    state = state_of(cache, row) if hybrid else None
    prefix_cache.insert(tokens, kv_source(cache, row), state, scope=scope)


def start_cache(
    model: nn.Module, prefix_cache: PrefixCache | None, hit: PrefixHit | None, room: int = 0
) -> Cache:
    """A request's cache: seeded from its prefix-cache hit (then released) or empty; `room`:
    the tokens it will add."""
    if hit is None or not hit.length:
        return make_cache(model)
    cache = seed(model, hit, room)
    if prefix_cache is not None:
        prefix_cache.unlock(hit)
    return cache
