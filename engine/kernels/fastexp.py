"""e^-x from elementwise ops that MLX's CPU compiler fuses into vectorised loops.

MLX's CPU kernels compute exp one element at a time (its `exp`, and the one inside `softmax`,
about 12-14 ns an element against 0.45 ns for an add). Here:

    e^-x = 2^k · e^r     k = round(-x / ln 2),  r = -x - k·ln 2 in [-ln2/2, ln2/2]
                         (ln 2 in two parts, so k·ln 2 is exact: Cody and Waite)
    e^r                  a degree-6 minimax polynomial (relative error 1.7e-8 with float32
                         coefficients), evaluated by Estrin's scheme (shallow, see below)
    2^k                  the float32 whose exponent bits are k + 127

x is clamped to ±86.5 for the range reduction; past it 2^k is set by the caller's choice (`+inf`
for SiLU's overflow, 0 for softmax's underflow). Inference only: the bit trick has no gradient.

Why it looks the way it does (MLX 0.32's CPU compiler, g++ -O3 without -ffast-math, SSE2):
- Fusion stops at a depth of 11 ops and at 24 inputs (constants count), and a shapeless trace
  broadcasts every operand, doubling the depth. So the work is three kernels compiled per input
  shape (`PerShape`): exponent bits, reduced argument, then the polynomial and what the caller
  makes of it; the bits are reinterpreted as float32 between them (a View, which no kernel can
  contain). Two outputs from one compiled function do not help: the shared input is split out
  into a kernel of its own, and the two outputs still get one loop each.
- An input broadcast against the others (a row maximum, say) makes the kernel the strided
  variant, which advances a pointer per element and does not vectorise: the inputs here all
  have the output's shape, or are scalars.
- g++ only vectorises a loop without branches: float minimum/maximum (their NaN test), a select
  between computed values (it sinks them into branches) or with a constant feeding more float
  math (it threads the constant through a branch), and bool-to-float casts all leave it scalar.
  So float clamps are selects between the input and a bound passed in as an array; integer
  clamps are fine.
- 2^k stays in the normal range or is exactly 0 (a denormal operand costs ~100 cycles on x86).
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable

import mlx.core as mx

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


def to_float(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def lower_clamped(x: mx.array, low: mx.array) -> mx.array:
    return mx.where(x < low, low, x)


def _clamped(x: mx.array, low: mx.array, high: mx.array) -> mx.array:
    x = lower_clamped(x, low)
    return mx.where(x > high, high, x)


def _round_exponent(x: mx.array) -> mx.array:
    """k = round(-x / ln 2), as a float."""
    return (x * -LOG2E + ROUND) - ROUND


def exponent_bits(x: mx.array, *, overflow: bool) -> mx.array:
    """The int32 bits of 2^k. k is clamped as an integer (that vectorises, a float clamp would
    not); a |k| past 2^31 (or NaN) converts to INT_MIN on x86.

    With `overflow` (SiLU) the bits are +inf's where x < -LIMIT and the smallest k is 2^-125,
    which INT_MIN clamps to, right for large positive x. Without (softmax, whose x >= 0) the
    smallest is exactly 0, so that e^-x is 0 for x past ~88 and for x = +inf (masked scores)."""
    x = to_float(x)
    biased = mx.clip(_round_exponent(x).astype(mx.int32) + 127, 2 if overflow else 0, 252)
    if overflow:
        biased = mx.maximum(biased, mx.where(x < -LIMIT, 255, 0))
    return mx.left_shift(biased, 23)


def reduced(x: mx.array, low: mx.array, high: mx.array) -> mx.array:
    """r = -x - k·ln 2, in [-ln2/2, ln2/2] (x clamped to ±LIMIT)."""
    xc = _clamped(to_float(x), low, high)
    k = _round_exponent(xc)
    return (-xc - k * LN2_HI) - k * LN2_LO


def exp_reduced(r: mx.array) -> mx.array:
    """e^r by the polynomial, Estrin's scheme (depth 5 where Horner's is 12)."""
    c = EXP_COEFFS
    r2 = r * r
    return ((1.0 + r) + r2 * (c[2] + c[3] * r)) + (r2 * r2) * ((c[4] + c[5] * r) + r2 * c[6])


class PerShape:
    """Kernels compiled for each key (shapes and dtypes), least recently used ones dropped.

    Fixed-shape compilation fuses twice as deep as shapeless; a new shape costs one trace (about
    a millisecond). Each entry compiles its own function objects (partials of what `build(key)`
    returns), so MLX keeps one cache entry per function instead of scanning a growing list of
    traces on every call."""

    def __init__(self, build: Callable[[tuple], tuple], max_entries: int = 256) -> None:
        self.build = build
        self.max_entries = max_entries
        self._entries: OrderedDict[Hashable, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def __getitem__(self, key: tuple) -> tuple:
        with self._lock:
            kernels = self._entries.get(key)
            if kernels is None:
                kernels = self._entries[key] = tuple(
                    mx.compile(functools.partial(f)) for f in self.build(key)
                )
                if len(self._entries) > self.max_entries:
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(key)
            return kernels

    def __len__(self) -> int:
        return len(self._entries)


# The clamp bounds are inputs, not constants: g++ threads a select of a constant into branches.
LOW, HIGH = mx.array(-LIMIT), mx.array(LIMIT)
