"""Fast SiLU / SwiGLU on MLX's CPU backend: silu(x) = x / (1 + e^-x), e^-x from fastexp.py.

MLX's own `silu(gate) * up` in the MLP is about a quarter of a prefill (its exp is scalar).

|x| is clamped to 86.5 for the range reduction; beyond that e^-x is set to +inf (silu -> -0) for
x < -86.5 and is below 2^-24 (silu -> x) for x > 86.5. NaN stays NaN, silu(inf) = inf and
silu(-inf) = -0 (MLX's own x * sigmoid(x) gives NaN there). Against float64 the relative error
is at most 2.5e-7 (4 ulps) wherever |silu| > 1e-30, the absolute error below 3e-36 elsewhere
(MLX's x * sigmoid(x): 3.7e-6). float16 and bfloat16 inputs are computed in float32 and rounded
once.

Exact GELU on the same backend (BERT's MLP, engine/models/embeddings.py): x/2 · (1 + erf(x/√2)).
MLX's `erf` is scalar too (`nn.gelu` costs ~50 ns an element here, half of a sentence encoder's
forward). Here erf(z) = z · P(z²) / Q(z²) on z clamped to ±4 (erf(4) is 1 - 1.5e-8: 1 in
float32), P of degree 6 and Q of degree 4, fitted to erf in float64 by iteratively reweighted
least squares (this module's test repeats the check): no exp, no branch, so the compiled
kernels vectorise (fastexp.py says what that takes), ~25x faster. Against float64 erf the
absolute error is below 5e-7; GELU's below 1.4e-6 on [-12, 12] (MLX's: 4.7e-7).
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations

from engine.kernels.fastexp import (
    FLOAT_TYPES,
    HIGH,
    LOW,
    PerShape,
    exp_reduced,
    exponent_bits,
    lower_clamped,
    reduced,
    to_float,
)


def _silu_times(
    x: mx.array,
    r: mx.array,
    scale: mx.array,
    low: mx.array,
    up: mx.array | None,
    dtype: mx.Dtype,
) -> mx.array:
    """silu(x) (* up): x / (1 + e^r · 2^k), e^-x overflowing to +inf below -LIMIT."""
    numerator = lower_clamped(to_float(x), low)  # -inf / inf would be NaN
    if up is not None:
        numerator = numerator * to_float(up)
    out = numerator / (1.0 + exp_reduced(r) * scale)
    return out if out.dtype == dtype else out.astype(dtype)


def _build(key: tuple) -> tuple:
    dtype = key[-1]
    return (
        functools.partial(exponent_bits, overflow=True),
        reduced,
        functools.partial(_silu_times, dtype=dtype),
    )


KERNELS = PerShape(_build)

# erf(z) / z = P(z²) / Q(z²) on [-4, 4], ascending powers (see the module docstring). P is the
# fit's times 1 - 2^-24, so that erf(±4) comes out exactly ±1 in float32: then GELU is exactly
# -0 for every x below -4√2 (with the fit's -1 - 1.2e-7 there it would grow as x · 6e-8).
ERF_P = (
    1.1283786296844482,
    0.20763444900512695,
    0.05158856511116028,
    0.004028530325740576,
    0.00014957383973523974,
    -1.978482487174915e-06,
    1.9557994335173134e-08,
)
ERF_Q = (1.0, 0.5173401832580566, 0.11818291991949081, 0.015010129660367966, 0.001035194844007492)
ERF_LIMIT = 4.0
ERF_LOW, ERF_HIGH = mx.array(-ERF_LIMIT), mx.array(ERF_LIMIT)


def _erf_argument(x: mx.array, low: mx.array, high: mx.array) -> mx.array:
    """z = x / √2 clamped to ±ERF_LIMIT (selects against array bounds: they vectorise)."""
    z = to_float(x) * (1.0 / math.sqrt(2.0))
    z = mx.where(z < low, low, z)
    return mx.where(z > high, high, z)


def _erf_numerator(z: mx.array) -> mx.array:
    """z · P(z²), Estrin's scheme (shallow: MLX fuses at most 11 ops deep)."""
    p, s = ERF_P, z * z
    s2 = s * s
    return z * (
        ((p[0] + p[1] * s) + s2 * (p[2] + p[3] * s)) + (s2 * s2) * ((p[4] + p[5] * s) + s2 * p[6])
    )


def _erf_denominator(z: mx.array) -> mx.array:
    q, s = ERF_Q, z * z
    s2 = s * s
    return ((q[0] + q[1] * s) + s2 * (q[2] + q[3] * s)) + (s2 * s2) * q[4]


def _gelu_tail(
    x: mx.array, numerator: mx.array, denominator: mx.array, dtype: mx.Dtype
) -> mx.array:
    out = (0.5 * to_float(x)) * (1.0 + numerator / denominator)
    return out if out.dtype == dtype else out.astype(dtype)


GELU_KERNELS = PerShape(
    lambda key: (
        _erf_argument,
        _erf_numerator,
        _erf_denominator,
        functools.partial(_gelu_tail, dtype=key[-1]),
    )
)


def _silu_times_up(x: mx.array, up: mx.array | None, dtype: mx.Dtype) -> mx.array:
    bits, reduce, tail = KERNELS[(x.shape, x.dtype, None if up is None else up.dtype, dtype)]
    scale = bits(x).view(mx.float32)
    return tail(x, reduce(x, LOW, HIGH), scale, LOW, up)


def _fast_path(*arrays: mx.array) -> bool:
    first = arrays[0]
    return (
        mx.default_device() == mx.cpu
        and first.size > 0
        and all(a.dtype in FLOAT_TYPES and a.shape == first.shape for a in arrays)
    )


def silu(x: mx.array) -> mx.array:
    """`nn.silu` on the CPU path described above."""
    if not _fast_path(x):
        return nn.silu(x)
    return _silu_times_up(x, None, x.dtype)


def gelu(x: mx.array) -> mx.array:
    """`nn.gelu` (exact, erf's) on the CPU path described above."""
    if not _fast_path(x):
        return nn.gelu(x)
    argument, numerator, denominator, tail = GELU_KERNELS[(x.shape, x.dtype)]
    z = argument(x, ERF_LOW, ERF_HIGH)
    return tail(x, numerator(z), denominator(z))


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `activations.swiglu`: silu(gate) * x."""
    if not _fast_path(gate, x) or gate.dtype != x.dtype:
        return activations.swiglu(gate, x)
    return _silu_times_up(gate, x, x.dtype)


def precise_swiglu(h: mx.array, gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `activations.precise_swiglu`: silu(gate) * x in float32, cast to h's dtype."""
    if not _fast_path(gate, x) or h.dtype not in FLOAT_TYPES:
        return activations.precise_swiglu(h, gate, x)
    return _silu_times_up(gate, x, h.dtype)
