"""mlx-lm's `scaled_dot_product_attention` on MLX's CPU backend, with a vectorised softmax.

On the CPU `mx.fast.scaled_dot_product_attention` has no kernel: it runs its unfused fallback,
`q * scale`, a matmul against keys broadcast over each KV head's query heads (GQA), the mask as
a `where`, a precise `softmax` and a second matmul. Two costs stand out (bench/RESULTS.md):
- The softmax's exp, one element at a time: 2.1 of 2.7 ms per layer of a 128-token prefill.
- The broadcast matmuls: at decode each query head is its own matrix-vector product (B·H of
  them); here the `H / n_kv` query heads (and query positions) of a KV head are the rows of one
  matrix product, B·n_kv of them. A batch-16 decode step's two matmuls: 0.96 -> 0.55 ms a layer.

The softmax keeps the row maximum for safety and takes the exp from fastexp.py:

    x = scores + additive mask                  (bool masks become 0 / float32 min first)
    u = max(x) - x >= 0                         e = e^(-scale · u)   (0 for u = +inf)
    out = (e @ values) / sum(e)                 normalised after the product: fewer elements

A bool mask's masked scores become float32's min, as MLX's fallback makes them: their weight is
exactly 0, and a row with every key masked averages the values instead of giving NaN (MLX's
does the same); an additive -inf mask over a whole row gives NaN, as MLX's does. The scale is
applied inside the exp kernels (an additive mask is divided by it first). For float16 and
bfloat16 inputs the softmax is float32 (MLX's is `precise` there too); the weights are rounded
to the input dtype for the second matmul, as MLX's are, and the normalisation is float32.
Against float64 the weights' relative error is at most 4e-6 on rows of 4096 keys (the float32
row sum), 1.3e-7 on rows of 160; MLX's: 7.4e-6 and 3.4e-6 (its exp).

The exp kernels are compiled per shape, and at decode the key count grows by one each step: one
trace of the three per step for all layers (about 0.35 ms; the kernels' code is shared, so g++
runs once per machine).

Decode steps and other short query blocks in float32 (at most 24 query rows per KV head, head
dimensions multiples of 8 up to 256, no mask or a bool or causal one) go instead to one fused
kernel, engine/kernels/native/attention.c as an MLX primitive
(engine/kernels/native/mlx_extension.py): the whole attention of a layer in one op, its (sequence,
KV head) tasks on the sgemm pool's threads, keys and values read once (bench/RESULTS.md, "Fused
decode attention"). `ORCHARD_FUSED_ATTENTION=0`, or `FUSED` set False, keeps them on the path above.

Anything else goes to mlx-lm's own: off the CPU, attention sinks, quantized caches, inputs it
does not recognise (dtypes, ranks, mask shapes), and calls too small to gain (`MIN_SCORES`).
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import base

from engine.kernels import blas
from engine.kernels.fastexp import (
    FLOAT_TYPES,
    HIGH,
    LOW,
    PerShape,
    exp_reduced,
    exponent_bits,
    reduced,
)
from engine.kernels.native import mlx_extension

logger = logging.getLogger(__name__)

FUSED_SWITCH = "ORCHARD_FUSED_ATTENTION"
# Whether calls the fused kernel takes go to it (when it is built): the switch, or tests and
# benchmarks comparing both paths in one process.
FUSED = os.environ.get(FUSED_SWITCH, "1").strip().lower() not in ("0", "false", "off", "no")

MASKED = float(np.finfo(np.float32).min)
# Below this many scores MLX's fallback is as fast or faster: this path is ~11 MLX ops to its 5,
# ~40 us more, which the exp saves from about 1500 scores on (batch-1 decode at 160 keys in the
# default model: a tie; at 40 keys MLX's is 0.05 ms to this one's 0.09).
MIN_SCORES = 2048


def _exponent_bits(u: mx.array, scale: mx.array) -> mx.array:
    return exponent_bits(u * scale, overflow=False)


def _reduced(u: mx.array, scale: mx.array, low: mx.array, high: mx.array) -> mx.array:
    return reduced(u * scale, low, high)


def _weights(r: mx.array, two_k: mx.array) -> mx.array:
    return exp_reduced(r) * two_k


# Query positions past which a quantized cache's keys are read dequantized (a prompt's chunk;
# a decode step has one, a speculative check at most 17).
QUANTIZED_QUERIES = 32

KERNELS = PerShape(lambda key: (_exponent_bits, _reduced, _weights))


def scaled_dot_product_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    cache: Any,
    scale: float,
    mask: mx.array | str | None,
    sinks: mx.array | None = None,
) -> mx.array:
    """mlx-lm's `base.scaled_dot_product_attention`, on the CPU path described above."""
    if hasattr(cache, "bits") and queries.shape[2] > QUANTIZED_QUERIES:
        # A prompt's chunk over a quantized cache (engine/cache/quantized.py): MLX's CPU
        # quantized product is 4x slower there than the fast path over the keys and values
        # dequantized (one layer's, for this call: the cache keeps them quantized). Decode
        # steps, and drafts' checks, keep the quantized product: faster for a few queries.
        keys, values = (
            mx.dequantize(*x, group_size=cache.group_size, bits=cache.bits) for x in (keys, values)
        )
        cache = None
    additive = _UNHANDLED
    if _handles(queries, keys, values, cache, scale, sinks):
        fused = _fused(queries, values, mask)
        if fused is not None:
            causal = isinstance(mask, str) and queries.shape[2] > 1
            return fused.decode_attention(
                queries, keys, values, None if isinstance(mask, str) else mask, scale, causal
            )
        if queries.size // queries.shape[-1] * keys.shape[2] >= MIN_SCORES:
            additive = _additive_mask(mask, scale, queries, keys)
    if additive is _UNHANDLED:
        return base.scaled_dot_product_attention(
            queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks
        )
    B, H, L, D = queries.shape
    n_kv, S = keys.shape[1], keys.shape[2]
    rows, dtype = (H // n_kv) * L, queries.dtype
    scores = queries.reshape(B, n_kv, rows, D) @ keys.swapaxes(-1, -2)
    # As (B, n_kv, heads per KV head, L, S), so a mask's heads and positions line up.
    scores = scores.reshape(B, n_kv, H // n_kv, L, S)
    x = scores.astype(mx.float32) if additive is None else scores + additive
    u = mx.max(x, axis=-1, keepdims=True) - x
    bits, reduce, weights = KERNELS[u.shape]
    factor = _scalar(scale)
    e = weights(reduce(u, factor, LOW, HIGH), bits(u, factor).view(mx.float32))
    total = mx.sum(e, axis=-1, keepdims=True).reshape(B, n_kv, rows, 1)
    out = (e.reshape(B, n_kv, rows, S).astype(dtype) @ values) / total
    return out.reshape(B, H, L, values.shape[-1]).astype(dtype)


_UNHANDLED = object()


def _fused(queries: mx.array, values: mx.array, mask: Any) -> Any:
    """The fused kernel's module when it takes this call (past `_handles`), else None."""
    module = fused_kernel() if FUSED and queries.dtype == mx.float32 else None
    if module is None:
        return None
    (B, H, L, D), (n_kv, Dv) = queries.shape, values.shape[1::2]
    if H // n_kv * L > module.MAX_ROWS or D % 8 or Dv % 8 or max(D, Dv) > module.MAX_DIM:
        return None  # the kernel's state is on its stack
    if isinstance(mask, str):
        if mask != "causal" or L > values.shape[2]:  # more queries than keys: MLX's own
            return None
    elif mask is not None:
        if not isinstance(mask, mx.array) or mask.dtype != mx.bool_ or mask.ndim > 4:
            return None
        full = (B, H, L, values.shape[2])[4 - mask.ndim :]
        if not all(m in (1, n) for m, n in zip(mask.shape, full, strict=True)):
            return None
    return module


@functools.cache
def fused_kernel() -> Any:
    """The fused kernel's module, built and loaded on first call (engine/kernels' `install`
    calls this when a model loads: the first build on a machine takes 20-30 s), once checked
    against MLX's attention here; None where it is not available or disagrees."""
    module = mlx_extension.load_extension(blas.attention_kernel())
    if module is None:
        return None
    rng = np.random.default_rng(0)
    q, k, v = (
        mx.array(rng.standard_normal(shape).astype(np.float32))
        for shape in ((3, 6, 2, 64), (3, 2, 70, 64), (3, 2, 70, 32))
    )
    mask = mx.array(rng.random((3, 1, 2, 70)) > 0.3)
    try:
        ours = module.decode_attention(q, k, v, mask, 0.125, False)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        agrees = mx.allclose(ours, theirs, rtol=1e-5, atol=1e-6).item()
    except Exception:  # e.g. TypeError: an extension that does not take MLX's arrays
        logger.warning("fused decode attention off: it failed its check", exc_info=True)
        return None
    if not agrees:
        logger.warning("fused decode attention off: it disagrees with MLX's on this machine")
        return None
    return module


def _handles(queries, keys, values, cache, scale, sinks) -> bool:
    # Once per layer per forward: plain checks, no generators (MLX's own fallback builds its
    # graph in 7 us; a small call pays ~1 us more for coming here). A quantized cache's keys
    # (mlx-lm's packed triples) go to MLX's quantized attention.
    if hasattr(cache, "bits"):
        return False
    shapes = queries.shape, keys.shape, values.shape
    if len(shapes[0]) != 4 or len(shapes[1]) != 4 or len(shapes[2]) != 4:
        return False
    (B, H, L, D), (Bk, n_kv, S, Dk), (Bv, n_v, Sv, Dv) = shapes
    if (Bk, Bv, Dk, n_v, Sv) != (B, B, D, n_kv, S):
        return False
    if not B * L * S * D * Dv or H % n_kv or sinks is not None:
        return False
    dtype = queries.dtype
    if dtype not in FLOAT_TYPES or keys.dtype != dtype or values.dtype != dtype:
        return False
    return isinstance(scale, float | int) and scale > 0 and mx.default_device() == mx.cpu


# The last array mask and what it became: a model passes one mask to all its layers. Held by
# a weak reference, so the converted mask (float32, 4x a bool mask) goes with the forward.
_NO_MASK: tuple = (lambda: None, None, None)
_last_mask: tuple = _NO_MASK


def _forget(ref: weakref.ref) -> None:
    global _last_mask
    if _last_mask[0] is ref:
        _last_mask = _NO_MASK


def _additive_mask(mask: Any, scale: float, queries: mx.array, keys: mx.array) -> Any:
    """The mask as float32 to add to unscaled scores of shape (B, n_kv, H / n_kv, L, S), None
    for none, or _UNHANDLED for what mlx-lm's function should have (or refuse)."""
    global _last_mask
    if mask is None or isinstance(mask, str):
        L, S = queries.shape[2], keys.shape[2]
        if mask is None or (mask == "causal" and L == 1):  # the last query sees every key
            return None
        return _causal(L, S) if mask == "causal" else _UNHANDLED
    key = (scale, queries.shape, queries.dtype, keys.shape[1:3])
    last, last_key, additive = _last_mask  # one read: another thread may replace it
    if last() is mask and last_key == key:
        return additive
    additive = _converted(mask, scale, queries, keys)
    if isinstance(mask, mx.array):
        _last_mask = (weakref.ref(mask, _forget), key, additive)
    return additive


def _converted(mask: Any, scale: float, queries: mx.array, keys: mx.array) -> Any:
    (B, H, L, _), (n_kv, S) = queries.shape, keys.shape[1:3]
    if not isinstance(mask, mx.array) or mask.ndim > 4:
        return _UNHANDLED
    if mask.dtype != mx.bool_ and mask.dtype not in FLOAT_TYPES:
        return _UNHANDLED
    if mask.dtype not in (mx.bool_, queries.dtype) and queries.dtype != mx.float32:
        return _UNHANDLED  # MLX refuses a mask that would promote the output
    full = (B, H, L, S)[4 - mask.ndim :]
    if not all(m in (1, n) for m, n in zip(mask.shape, full, strict=True)):
        return _UNHANDLED
    mask = mask.reshape((1,) * (4 - mask.ndim) + mask.shape)
    if mask.shape[1] == H and H != n_kv:
        mask = mask.reshape(mask.shape[0], n_kv, H // n_kv, *mask.shape[2:])
    else:
        mask = mx.expand_dims(mask, 2)
    if mask.dtype == mx.bool_:
        # An add broadcasts in MLX's vectorised binary loops, a where (4x slower) does not.
        return mx.where(mask, 0.0, MASKED)
    return mask.astype(mx.float32) * (1.0 / scale)


@functools.lru_cache(maxsize=64)
def _causal(L: int, S: int) -> mx.array:
    """Query i (the last L of S positions) sees keys up to S - L + i. From numpy, so the array
    holds data and is no graph of anyone's stream (nor of a compile trace)."""
    visible = np.arange(S - L, S)[:, None] >= np.arange(S)[None]
    return mx.array(np.where(visible, 0.0, MASKED).astype(np.float32))


@functools.lru_cache(maxsize=64)
def _scalar(value: float) -> mx.array:
    return mx.array(value, dtype=mx.float32)
