"""The one module that reads and writes the contents of mlx-lm's cache objects.

mlx-lm's cache classes (KVCache, ArraysCache and their batch forms) change between releases;
what Orchard needs from their insides is here: making, merging and extending caches for the
batch, copying a sequence's keys, values and recurrent state out (for the prefix cache), seeding
a fresh cache from a prefix-cache hit, and measuring what a token and a sequence cost in bytes.
Only a model's engine thread calls into it.

An attention layer's keys and values for a span of tokens travel (to the prefix cache, its disk
tier and back) as one flat tuple of arrays with the tokens on axis 2: (keys, values) at the
model's precision, or, with a quantized cache (`KVQuant`, engine/cache/quantized.py), the packed
keys, their scales and biases, then the same three for the values, stored as computed (never
dequantized and quantized again, which would drift).
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

from engine.cache.cohorts import CohortKVCache, wrap
from engine.cache.prefix import KVSource, LayerKV, LayerState, PrefixCache, PrefixHit
from engine.cache.quantized import QuantizedCache, check_bits, check_group, quantize_layers

Cache = list[Any]


@dataclass(frozen=True)
class KVQuant:
    """Keys and values kept at `bits` bits per element, in groups of `group_size` along the
    head dimension (a model setting: ModelSpec.kv_cache_bits)."""

    bits: int
    group_size: int = 64


@dataclass(frozen=True)
class CacheLayout:
    """What a model's cache is made of: per layer "kv" (attention: keys and values per token)
    or "state" (recurrent: fixed-size state), and what one token and one sequence cost;
    `quant`: how its keys and values are quantized (None: not)."""

    kinds: tuple[str, ...]
    kv_bytes_per_token: int
    state_bytes_per_sequence: int
    quant: KVQuant | None = None

    @property
    def hybrid(self) -> bool:
        return "state" in self.kinds

    @property
    def kv_slots(self) -> int:
        """Arrays per attention layer in a span of keys and values."""
        return 6 if self.quant is not None else 2


def make_cache(model: nn.Module, quant: KVQuant | None = None) -> Cache:
    cache = make_prompt_cache(model)
    return quantize_layers(cache, quant.bits, quant.group_size) if quant is not None else cache


def merge(caches: list[Cache]) -> Cache:
    # Merging copies, so n choices forked from one prompt cache get independent rows.
    return [type(layers[0]).merge(list(layers)) for layers in zip(*caches, strict=True)]


def concatenate(first: Cache, second: Cache) -> Cache:
    for layer, other in zip(first, second, strict=True):
        layer.extend(other)
    return first


def layout(model: nn.Module, quant: KVQuant | None = None) -> CacheLayout | None:
    """Probe the model's cache with one token; None when a layer's cache is of a kind the
    prefix cache cannot slice (sliding windows, a model's own quantized caches, ...)."""
    cache = make_cache(model, quant)
    kinds = []
    for layer in cache:
        if type(layer) in (KVCache, QuantizedCache):
            kinds.append("kv")
        elif type(layer) is ArraysCache:
            kinds.append("state")
        else:
            return None
    model(mx.array([[0]]), cache=cache)
    mx.eval([layer.state for layer in cache])
    per_token = sum(
        a.nbytes // a.shape[2]
        for layer in cache
        if isinstance(layer, KVCache | QuantizedCache)
        for a in _flat(layer)
    )
    per_sequence = sum(layer.nbytes for layer in cache if isinstance(layer, ArraysCache))
    return CacheLayout(tuple(kinds), per_token, per_sequence, quant)


def check_quant(model: nn.Module, quant: KVQuant) -> None:
    """ValueError, saying why, unless `quant` can hold this model's keys and values: 4 or 8
    bits, in groups that divide every attention layer's head dimensions."""
    check_bits(quant.bits)
    cache = make_cache(model)
    model(mx.array([[0]]), cache=cache)
    dims = {a.shape[3] for layer in cache if isinstance(layer, KVCache) for a in _flat(layer)}
    if not dims:
        raise ValueError("this model has no attention layers whose keys could be quantized")
    check_group(dims, quant.group_size)
    try:  # mlx-lm's quantized attention has no attention sinks (gpt-oss), for one
        model(mx.array([[0]]), cache=make_cache(model, quant))
    except Exception as exc:
        raise ValueError(f"its attention cannot read a quantized cache: {exc}") from exc


def check_cohorts(model: nn.Module, quant: KVQuant | None = None) -> None:
    """ValueError, saying why, unless the model's attention reads a batch in length cohorts
    (engine/cache/cohorts.py) as it reads one padded batch: a model that builds its own masks
    or calls attention by another name would not."""
    singles = []
    for prompt in ([1, 2, 3], [4, 5, 6, 7, 8, 9]):
        cache = make_cache(model, quant)
        model(mx.array([prompt]), cache=cache)
        singles.append(cache)
    tokens = mx.array([[7], [8]])
    try:
        grouped = concatenate(wrap(merge(singles[:1]), pad_limit=0), merge(singles[1:]))
        got = model(tokens, cache=grouped)
    except Exception as exc:
        raise ValueError(f"its attention cannot read length cohorts: {exc}") from exc
    if not any(getattr(layer, "num_cohorts", 0) == 2 for layer in grouped):
        raise ValueError("its attention layers have no batch cache to split")
    expected = model(tokens, cache=merge(singles)).astype(mx.float32)
    if not mx.allclose(got.astype(mx.float32), expected, rtol=1e-2, atol=1e-2).item():
        raise ValueError("its attention reads length cohorts differently from one batch")


def _flat(layer) -> tuple[mx.array, ...]:
    """An attention layer's key and value arrays, as one flat tuple (see the module's doc)."""
    if isinstance(layer.keys, tuple):
        return (*layer.keys, *layer.values)
    return layer.keys, layer.values


def seed(model: nn.Module, hit: PrefixHit, room: int = 0, quant: KVQuant | None = None) -> Cache:
    """A fresh cache holding a prefix-cache hit: its first `hit.length` tokens computed, with
    space for `room` more allocated in the same copy (else the first tokens added would copy
    everything again to grow it)."""
    cache = make_cache(model, quant)
    step = KVCache.step
    pad = -(-(hit.length + room) // step) * step - hit.length
    for index, layer in enumerate(cache):
        if isinstance(layer, KVCache | QuantizedCache):
            arrays = hit.kv[index]
            if pad:
                arrays = tuple(
                    mx.concatenate([a, mx.zeros((*a.shape[:2], pad, a.shape[3]), a.dtype)], axis=2)
                    for a in arrays
                )
            if isinstance(layer, QuantizedCache):  # (keys' three arrays, then values')
                layer.keys, layer.values = tuple(arrays[:3]), tuple(arrays[3:])
            else:
                layer.keys, layer.values = arrays
            layer.offset = hit.length
        else:
            layer.cache = [mx.contiguous(a) for a in hit.state[index]]
    return cache


def kv_source(cache: Cache, row: int | None = None) -> KVSource:
    """Copies of a span of one sequence's keys and values: from a sequence's own cache
    (`row` None) or from row `row` of a batch cache."""
    located = []  # per layer: the cache holding the row, the row in it, its left padding
    for layer in cache:
        local = row
        if row is not None and isinstance(layer, CohortKVCache):
            layer, local = layer.locate(row)
        batch = local is not None and isinstance(layer, BatchKVCache)
        pad = layer.left_padding[local].item() if batch else 0
        located.append((layer, local, pad))

    def source(start: int, end: int) -> LayerKV:
        layers: LayerKV = []
        for layer, local, pad in located:
            if not isinstance(layer, KVCache | BatchKVCache | QuantizedCache):
                layers.append(None)
                continue
            rows = slice(None) if local is None else slice(local, local + 1)
            span = slice(pad + start, pad + end)
            layers.append(tuple(mx.contiguous(a[rows, :, span, :]) for a in _flat(layer)))
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
    model: nn.Module,
    prefix_cache: PrefixCache | None,
    hit: PrefixHit | None,
    room: int = 0,
    quant: KVQuant | None = None,
) -> Cache:
    """A request's cache: seeded from its prefix-cache hit (then released) or empty; `room`:
    the tokens it will add."""
    if hit is None or not hit.length:
        return make_cache(model, quant)
    cache = seed(model, hit, room, quant)
    if prefix_cache is not None:
        prefix_cache.unlock(hit)
    return cache
