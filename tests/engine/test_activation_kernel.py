"""The fast SiLU / SwiGLU (engine/kernels/fast.py, engine/kernels/fastexp.py) and exact GELU
(engine/kernels/activation.py, the sentence encoder's) against float64 and MLX over float32's
range, special values and half precision; what they leave to MLX; the per-shape compile cache
they share with attention."""

import math
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import activations

from engine.kernels import activation, fastexp
from engine.kernels import fast as kernels

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu or shutil.which("g++") is None,
    reason="the fast kernels are for MLX's CPU backend, whose compiler runs g++",
)

INF, NAN = math.inf, math.nan


def wide_range() -> np.ndarray:
    rng = np.random.default_rng(0)
    return np.concatenate(
        [
            np.linspace(-100, 100, 200_001),
            rng.standard_normal(100_000) * 10,
            rng.standard_normal(10_000) * 1e-3,
            -np.geomspace(1e-30, 1e4, 5_000),
            np.geomspace(1e-30, 1e4, 5_000),
        ]
    ).astype(np.float32)


def reference(x: np.ndarray) -> np.ndarray:
    """silu in float64 (x / (1 + e^-x), e^-x overflowing to inf gives -0)."""
    x = x.astype(np.float64)
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def assert_close(fast: np.ndarray, expected: np.ndarray, rel: float = 1e-5) -> None:
    """Relative error below `rel` where |silu| > 1e-30, absolute error below 1e-30 elsewhere."""
    fast, expected = fast.astype(np.float64), expected.astype(np.float64)
    big = np.abs(expected) > 1e-30
    relative = np.abs(fast[big] - expected[big]) / np.abs(expected[big])
    assert relative.max() < rel, f"max relative error {relative.max():.3g}"
    assert np.abs(fast[~big] - expected[~big]).max(initial=0) < 1e-30


def test_silu_matches_float64_and_mlx_over_a_wide_range():
    x = wide_range()
    fast = np.array(kernels.silu(mx.array(x)))
    assert_close(fast, reference(x), rel=1e-6)
    exact = mx.array(x) * mx.sigmoid(mx.array(x))
    assert_close(fast, np.array(exact))


def test_special_values():
    values = [0.0, -0.0, INF, -INF, NAN, 1e-45, -1e-45, 1e-40, -1e-38, -87.0, -200.0, -1e30]
    values += [87.0, 200.0, 1e30, 3.4e38, -3.4e38, 5e6, -5e6]
    out = kernels.silu(mx.array(values, dtype=mx.float32)).tolist()
    got = dict(zip(values, out, strict=True))
    assert got[0.0] == 0.0 and got[INF] == INF
    assert math.isnan(out[values.index(NAN)])
    for x in (-INF, -200.0, -1e30, -3.4e38, -5e6):  # large negative -> 0, no NaN
        assert got[x] == 0.0, x
    for x in (200.0, 1e30, 3.4e38, 5e6):  # large positive -> x
        assert got[x] == np.float32(x), x
    for x in (1e-45, -1e-45, 1e-40, -1e-38, -87.0, 87.0):
        assert abs(got[x] - reference(np.float32([x]))[0]) <= 1e-30 + 2e-6 * abs(got[x]), x


def test_swiglu_and_precise_swiglu_match_mlx_lm():
    rng = np.random.default_rng(1)
    gate = mx.array(rng.standard_normal((4, 7, 96)).astype(np.float32) * 6)
    up = mx.array(rng.standard_normal((4, 7, 96)).astype(np.float32))
    expected = activations.swiglu(gate, up)
    assert kernels.swiglu(gate, up).dtype == mx.float32
    assert_close(np.array(kernels.swiglu(gate, up)), np.array(expected))

    h = mx.zeros((1,), dtype=mx.bfloat16)
    precise = kernels.precise_swiglu(h, gate.astype(mx.bfloat16), up)
    assert precise.dtype == mx.bfloat16
    theirs = activations.precise_swiglu(h, gate.astype(mx.bfloat16), up)
    assert_bfloat16_close(precise, theirs)


def assert_bfloat16_close(ours: mx.array, theirs: mx.array) -> None:
    """Within one bfloat16 rounding step (2^-8 relative) of each other."""
    ours, theirs = np.array(ours.astype(mx.float32)), np.array(theirs.astype(mx.float32))
    big = np.abs(theirs) > 1e-30
    assert (np.abs(ours - theirs)[big] / np.abs(theirs[big])).max() <= 2**-8
    assert np.abs(ours - theirs)[~big].max(initial=0) < 1e-30


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_half_precision_is_computed_in_float32_and_rounded_once(dtype):
    x = mx.array(np.linspace(-60, 60, 20_001).astype(np.float32)).astype(dtype)
    up = mx.array(np.linspace(2, -2, 20_001).astype(np.float32)).astype(dtype)
    fast = kernels.swiglu(x, up)
    assert fast.dtype == dtype
    x32, up32 = x.astype(mx.float32), up.astype(mx.float32)
    assert_bfloat16_close(fast, (x32 * mx.sigmoid(x32) * up32).astype(dtype))
    assert kernels.silu(x).dtype == dtype


def test_what_it_does_not_handle_goes_to_mlx():
    ints = mx.arange(-5, 5)
    assert kernels.silu(ints).tolist() == nn.silu(ints).tolist()
    gate, up = mx.array([[1.0, -2.0]]), mx.array([3.0])  # broadcasting
    assert kernels.swiglu(gate, up).tolist() == activations.swiglu(gate, up).tolist()
    assert kernels.silu(mx.zeros((0, 3))).shape == (0, 3)


def gelu_reference(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return 0.5 * x * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))


def test_gelu_matches_float64_erf_and_mlx():
    x = wide_range()
    fast = np.array(activation.gelu(mx.array(x))).astype(np.float64)
    expected = gelu_reference(x)
    error = np.abs(fast - expected)
    # Within 1.4e-6 where BERT's activations live; everywhere, within 3e-7 of max(|x|, 1)
    # (positive x gives x, negative gives -0 past -4√2: see the next test).
    assert error[np.abs(x) <= 12].max() < 1.4e-6
    assert (error / np.maximum(np.abs(x), 1.0)).max() < 3e-7
    mlx = np.array(nn.gelu(mx.array(x))).astype(np.float64)
    assert np.abs(fast - mlx)[np.abs(x) <= 12].max() < 2e-6


def test_gelu_special_values():
    values = [0.0, -0.0, INF, NAN, 1e-40, -1e-40, -5.66, -6.0, -200.0, -3.4e38, 200.0, 3.4e38]
    out = activation.gelu(mx.array(values, dtype=mx.float32)).tolist()
    got = dict(zip(values, out, strict=True))
    assert got[0.0] == 0.0 and got[INF] == INF and math.isnan(got[NAN])
    assert abs(got[1e-40] - 5e-41) < 1e-45 and abs(got[-1e-40] + 5e-41) < 1e-45
    for x in (-6.0, -200.0, -3.4e38):  # below -4√2: erf is exactly -1, GELU exactly 0
        assert got[x] == 0.0, x
    assert abs(got[-5.66]) < 5e-7  # the last point before the clamp: erf's error times x/2
    for x in (200.0, 3.4e38):
        assert got[x] == np.float32(x), x


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_gelu_in_half_precision_is_computed_in_float32_and_rounded_once(dtype):
    x = mx.array(np.linspace(-8, 8, 20_001).astype(np.float32)).astype(dtype)
    fast = activation.gelu(x)
    assert fast.dtype == dtype
    ours = np.array(fast.astype(mx.float32))
    theirs = np.array(nn.gelu(x.astype(mx.float32)).astype(dtype).astype(mx.float32))
    # One rounding step apart at most (GELU's tail toward -0 is below half precision's steps).
    assert (np.abs(ours - theirs) <= 2**-8 * np.abs(theirs) + 2**-14).all()


def test_gelu_leaves_what_it_does_not_handle_to_mlx():
    ints = mx.arange(-3, 3)
    assert activation.gelu(ints).tolist() == nn.gelu(ints).tolist()
    assert activation.gelu(mx.zeros((0, 4))).shape == (0, 4)


def test_kernels_are_compiled_per_shape_and_old_shapes_dropped():
    built = []

    def build(key):
        built.append(key)
        return (lambda x: x * 2.0, lambda x: x + 1.0)

    cache = fastexp.PerShape(build, max_entries=2)
    for n in (3, 4, 5, 4):
        double, inc = cache[((n,), mx.float32)]
        assert inc(double(mx.ones(n))).tolist() == [3.0] * n
    assert len(cache) == 2 and len(built) == 3  # 4 again is a hit
    assert [key[0] for key in cache._entries] == [(5,), (4,)]  # 3 dropped, 4 used last
    first, second = cache[((4,), mx.float32)][0], cache[((5,), mx.float32)][0]
    assert first is not second  # one MLX compile cache entry per function
