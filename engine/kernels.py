"""Fast SiLU / SwiGLU for MLX's CPU backend, installed into mlx-lm models by `install`.

MLX's CPU kernels compute exp with scalar library calls (about 12 ns an element against 0.45 ns
for an add), so `silu(gate) * up` in the MLP is about a quarter of a prefill. Here exp is built
from elementwise ops that `mx.compile` fuses into vectorised loops:

    e^-x = 2^k · e^r     k = round(-x / ln 2),  r = -x - k·ln 2 in [-ln2/2, ln2/2]
                         (ln 2 in two parts, so k·ln 2 is exact: Cody and Waite)
    e^r                  a degree-6 minimax polynomial (relative error 1.7e-8 with float32
                         coefficients), evaluated by Estrin's scheme (shallow, see below)
    2^k                  the float32 whose exponent bits are k + 127
    silu(x)              x / (1 + e^-x)

|x| is clamped to 86.5 for the range reduction; beyond that e^-x is set to +inf (silu -> -0) for
x < -86.5 and is below 2^-24 (silu -> x) for x > 86.5. NaN stays NaN, silu(inf) = inf and
silu(-inf) = -0 (MLX's own x * sigmoid(x) gives NaN there). Against float64 the relative error
is at most 2.5e-7 (4 ulps) wherever |silu| > 1e-30, the absolute error below 3e-36 elsewhere
(MLX's x * sigmoid(x): 3.7e-6). float16 and bfloat16 inputs are computed in float32 and rounded
once. Inference only: the bit trick has no gradient.

Why it looks the way it does (MLX 0.32's CPU compiler, g++ -O3 without -ffast-math, SSE2):
- Fusion stops at a depth of 11 ops and at 24 inputs (constants count), and a shapeless trace
  broadcasts every operand, doubling the depth. So the work is three kernels compiled per input
  shape (`_PerShape`): exponent bits, reduced argument, then polynomial and quotient; the bits
  are reinterpreted as float32 between them (a View, which no kernel can contain).
- g++ only vectorises a loop without branches: float minimum/maximum (their NaN test), a select
  between computed values (it sinks them into branches) or with a constant feeding more float
  math (it threads the constant through a branch), and bool-to-float casts all leave it scalar.
  So float clamps are selects between the input and a bound passed in as an array; integer
  clamps are fine.
- 2^k stays in the normal range (a denormal operand costs ~100 cycles on x86).

Off Linux-CPU (Metal, CUDA), for dtypes or shapes it does not handle, and under
`ORCHARD_FAST_KERNELS=0` everything stays on MLX's own kernels.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
from collections import OrderedDict
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import activations

logger = logging.getLogger(__name__)

ENV_SWITCH = "ORCHARD_FAST_KERNELS"

LIMIT = 86.5  # e^86.5 < 2^125: every 2^k below is a normal float32
LOG2E = 1.4426950408889634
LN2_HI = 0.693359375  # 9 significant bits: k * LN2_HI is exact for |k| < 2^15
LN2_LO = -2.12194440e-4
ROUND = 12582912.0  # 1.5 * 2^23: (t + ROUND) - ROUND rounds t to an integer for |t| < 2^22
# e^r on [-ln2/2, ln2/2], minimax in relative error (Remez, rounded to float32); c0 = c1 = 1.
EXP_COEFFS = (
    1.0,
    1.0,
    4.999999106e-01,
    1.666641980e-01,
    4.166822508e-02,
    8.374815807e-03,
    1.383684576e-03,
)
FLOAT_TYPES = (mx.float32, mx.float16, mx.bfloat16)


def fast_kernels_enabled() -> bool:
    """Whether `install` should patch models: on unless ORCHARD_FAST_KERNELS=0, and only where
    the default device is the CPU and MLX can compile CPU kernels (it runs g++)."""
    if os.environ.get(ENV_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    if os.environ.get("MLX_DISABLE_COMPILE") or mx.default_device() != mx.cpu:
        return False
    return shutil.which("g++") is not None and _self_check()


@functools.cache
def _self_check() -> bool:
    """Compile and check the kernels once (the first compile runs g++, seconds, then it is cached
    on disk), so that a machine where that fails keeps MLX's kernels instead of failing requests."""
    x = mx.linspace(-100.0, 100.0, 4001)
    try:
        fast = swiglu(x, mx.ones_like(x))  # the kernels the models' MLPs use
        mx.eval(fast)
    except Exception:
        logger.warning("fast CPU kernels unavailable: they failed to compile", exc_info=True)
        return False
    exact = x * mx.sigmoid(x)
    error = mx.abs(fast - exact) / mx.maximum(mx.abs(exact), 1e-30)
    if mx.max(mx.where(mx.abs(exact) > 1e-30, error, 0.0)).item() > 1e-5:
        logger.warning("fast CPU kernels off: they disagree with MLX's silu on this machine")
        return False
    return True


def _to_float(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _lower_clamped(x: mx.array, low: mx.array) -> mx.array:
    return mx.where(x < low, low, x)


def _clamped(x: mx.array, low: mx.array, high: mx.array) -> mx.array:
    x = _lower_clamped(x, low)
    return mx.where(x > high, high, x)


def _round_exponent(x: mx.array) -> mx.array:
    """k = round(-x / ln 2), as a float."""
    return (x * -LOG2E + ROUND) - ROUND


def _exponent_bits(x: mx.array) -> mx.array:
    """The int32 bits of 2^k, and of +inf where x < -LIMIT. k is clamped as an integer (that
    vectorises, a float clamp would not): a |k| past 2^31 (or NaN) converts to INT_MIN on x86,
    clamped to the smallest k, right for large positive x; large negative x is masked anyway."""
    biased = mx.clip(_round_exponent(_to_float(x)).astype(mx.int32) + 127, 2, 252)
    overflow = mx.where(_to_float(x) < -LIMIT, 255, 0)
    return mx.left_shift(mx.maximum(biased, overflow), 23)


def _reduced(x: mx.array, low: mx.array, high: mx.array) -> mx.array:
    """r = -x - k·ln 2, in [-ln2/2, ln2/2] (x clamped to ±LIMIT)."""
    xc = _clamped(_to_float(x), low, high)
    k = _round_exponent(xc)
    return (-xc - k * LN2_HI) - k * LN2_LO


def _silu_times(
    x: mx.array,
    r: mx.array,
    scale: mx.array,
    low: mx.array,
    up: mx.array | None,
    dtype: mx.Dtype,
) -> mx.array:
    """silu(x) (* up): x / (1 + e^r · 2^k), e^-x overflowing to +inf below -LIMIT."""
    c = EXP_COEFFS
    r2 = r * r
    exp_r = ((1.0 + r) + r2 * (c[2] + c[3] * r)) + (r2 * r2) * ((c[4] + c[5] * r) + r2 * c[6])
    numerator = _lower_clamped(_to_float(x), low)  # -inf / inf would be NaN
    if up is not None:
        numerator = numerator * _to_float(up)
    out = numerator / (1.0 + exp_r * scale)
    return out if out.dtype == dtype else out.astype(dtype)


class _PerShape:
    """The three kernels compiled for each (shape, dtypes), least recently used ones dropped.

    Fixed-shape compilation fuses twice as deep as shapeless; a new shape costs one trace (about
    a millisecond). Each entry compiles its own function objects, so MLX keeps one cache entry
    per function instead of scanning a growing list on every call."""

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def __call__(self, x: mx.array, up: mx.array | None, dtype: mx.Dtype) -> mx.array:
        key = (x.shape, x.dtype, None if up is None else up.dtype, dtype)
        with self._lock:
            kernels = self._entries.get(key)
            if kernels is None:
                kernels = self._entries[key] = (
                    mx.compile(functools.partial(_exponent_bits)),
                    mx.compile(functools.partial(_reduced)),
                    mx.compile(functools.partial(_silu_times, dtype=dtype)),
                )
                if len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
        bits, reduced, tail = kernels
        scale = bits(x).view(mx.float32)
        return tail(x, reduced(x, _LOW, _HIGH), scale, _LOW, up)

    def __len__(self) -> int:
        return len(self._entries)


_kernels = _PerShape()
# The clamp bounds are inputs, not constants: g++ threads a select of a constant into branches.
_LOW, _HIGH = mx.array(-LIMIT), mx.array(LIMIT)


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
    return _kernels(x, None, x.dtype)


def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `activations.swiglu`: silu(gate) * x."""
    if not _fast_path(gate, x) or gate.dtype != x.dtype:
        return activations.swiglu(gate, x)
    return _kernels(gate, x, x.dtype)


def precise_swiglu(h: mx.array, gate: mx.array, x: mx.array) -> mx.array:
    """mlx-lm's `activations.precise_swiglu`: silu(gate) * x in float32, cast to h's dtype."""
    if not _fast_path(gate, x) or h.dtype not in FLOAT_TYPES:
        return activations.precise_swiglu(h, gate, x)
    return _kernels(gate, x, h.dtype)


# What mlx-lm's modules call (by these global names) -> what they call instead.
_REPLACEMENTS = {
    "swiglu": (activations.swiglu, swiglu),
    "precise_swiglu": (activations.precise_swiglu, precise_swiglu),
}


def install(model: nn.Module) -> int:
    """Give every module of `model` whose `__call__` uses mlx-lm's `swiglu` or `precise_swiglu`
    the fast ones; returns how many modules changed.

    A module is replaced in its parent by a copy of a subclass whose `__call__` is the same code
    with those names bound to the fast functions (parameters are shared, not copied). Copies
    rather than in-place class changes: mlx-lm shares one default `SwiGLU()` instance among all
    its MoE layers, of every model in the process."""
    copies: dict[int, nn.Module] = {}

    def swap(value: Any) -> Any:
        if isinstance(value, nn.Module):
            if id(value) not in copies:
                copies[id(value)] = _fast_copy(value)
                visit(copies[id(value)])
            return copies[id(value)]
        if isinstance(value, list):
            value[:] = [swap(v) for v in value]
        elif isinstance(value, tuple):
            return tuple(swap(v) for v in value)
        elif isinstance(value, dict):
            for key in value:
                value[key] = swap(value[key])
        return value

    def visit(module: nn.Module) -> None:
        for key in list(module.keys()):
            module[key] = swap(module[key])

    visit(model)
    return sum(1 for module in copies.values() if getattr(module, "_orchard_fast", False))


def _fast_copy(module: nn.Module) -> nn.Module:
    cls = _fast_class(type(module))
    if cls is type(module):
        return module
    copy = cls.__new__(cls)
    dict.update(copy, module)
    copy.__dict__.update(module.__dict__)
    return copy


@functools.cache
def _fast_class(cls: type) -> type:
    call = next((vars(k)["__call__"] for k in cls.__mro__ if "__call__" in vars(k)), None)
    code = getattr(call, "__code__", None)
    if code is None or getattr(cls, "_orchard_fast", False):
        return cls
    swaps = {
        name: fast
        for name, (original, fast) in _REPLACEMENTS.items()
        if name in code.co_names and call.__globals__.get(name) is original
    }
    if not swaps:
        return cls
    fast_call = type(call)(
        code, {**call.__globals__, **swaps}, call.__name__, call.__defaults__, call.__closure__
    )
    fast_call.__kwdefaults__ = call.__kwdefaults__
    fast_call.__qualname__ = call.__qualname__
    return type(
        cls.__name__,
        (cls,),
        {
            "__call__": fast_call,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_orchard_fast": True,
        },
    )
