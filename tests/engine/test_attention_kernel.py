"""The fast attention on MLX ops (engine/kernels/attention.py): softmax weights against float64
over float32's range, outputs against MLX for every kind of mask, head layout and precision;
what it leaves to mlx-lm; the mask converted once per forward. Keys and values that are identity
matrices make the output the softmax weights themselves (q @ I and P @ I are exact), so the
weights can be checked one by one. (The fused kernel has its own tests: test_fused_attention.py.)"""

import math
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import QuantizedKVCache

from engine.kernels import attention
from engine.kernels import fast as kernels

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu or shutil.which("g++") is None,
    reason="the fast kernels are for MLX's CPU backend, whose compiler runs g++",
)


@pytest.fixture
def any_size(monkeypatch):
    """The fast path of MLX ops for calls of every size (below attention.MIN_SCORES MLX's is
    used); the fused kernel off, so that its float32 calls take this path too (the fused
    kernel has its own tests: test_fused_attention.py)."""
    monkeypatch.setattr(attention, "MIN_SCORES", 0)
    monkeypatch.setattr(attention, "FUSED", False)


def softmax_reference(logits: np.ndarray, scale: float, mask: np.ndarray | None) -> np.ndarray:
    """softmax(scale * logits + mask) in float64; a bool mask's False is -inf. A row with every
    key masked by a bool mask averages (MLX's fallback gives masked scores float32's min)."""
    z = scale * logits.astype(np.float64)
    if mask is not None and mask.dtype == bool:
        z = np.where(mask, z, -np.inf)
        z = np.where(mask.any(-1, keepdims=True), z, 0.0)
    elif mask is not None:
        z = z + mask.astype(np.float64)
    with np.errstate(invalid="ignore"):
        e = np.exp(z - z.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)


def softmax_weights(logits: np.ndarray, scale: float, mask: np.ndarray | None, *, fast=True):
    """The attention weights of queries `logits` (B, H, L, S) against S one-hot keys, 1 KV head."""
    B, S = logits.shape[0], logits.shape[-1]
    eye = mx.broadcast_to(mx.eye(S), (B, 1, S, S))
    q, m = mx.array(logits), None if mask is None else mx.array(mask)
    if fast:
        return np.array(kernels.scaled_dot_product_attention(q, eye, eye, None, scale, m))
    return np.array(mx.fast.scaled_dot_product_attention(q, eye, eye, scale=scale, mask=m))


def wide_logits(rng, shape: tuple, spread: float) -> np.ndarray:
    return (rng.standard_normal(shape) * spread).astype(np.float32)


def max_relative_error(ours: np.ndarray, expected: np.ndarray) -> float:
    """Relative error where the weight is above 1e-30; below, the absolute error must be."""
    big = expected > 1e-30
    assert np.abs(ours[~big] - expected[~big]).max(initial=0) < 1e-30
    return float((np.abs(ours[big] - expected[big]) / expected[big]).max())


@pytest.mark.parametrize(
    ("S", "spread", "scale"),
    [
        (160, 10.0, 0.125),  # decode-like rows
        (160, 1e-30, 1.0),  # near-uniform
        (160, 1e3, 1.0),  # far apart: most weights underflow to 0, exactly
        (160, 1e30, 0.125),  # huge logits: one-hot rows
        (4096, 4.0, 0.125),  # long rows
        (4096, 30.0, 1.0),  # long rows across float32's exponent range
    ],
)
@pytest.mark.usefixtures("any_size")
def test_attention_weights_match_float64_over_a_wide_range(S, spread, scale):
    rng = np.random.default_rng(S + int(math.log10(spread) * 10) + 300)
    logits = wide_logits(rng, (2, 2, 8, S), spread)
    logits[0, 0, 0] = np.linspace(-200, 200, S) / scale  # every magnitude of weight in one row
    mask = rng.random((2, 1, 8, S)) > 0.2
    mask[..., 0] = True
    for m in (None, mask, np.where(mask, 0.0, -np.inf).astype(np.float32)):
        expected = softmax_reference(logits, scale, m)
        ours = softmax_weights(logits, scale, m)
        error = max_relative_error(ours, expected)
        theirs = max_relative_error(softmax_weights(logits, scale, m, fast=False), expected)
        # Measured: ours 1.3e-7 (rows of 160) to 4.1e-6 (4096: the float32 row sum), MLX's
        # 3.4e-6 to 7.4e-6 (its exp).
        assert error < 5e-6 and error <= max(theirs, 1e-6), (error, theirs, type(m))
        if m is not None:
            assert (ours[np.broadcast_to(~mask, ours.shape)] == 0).all()  # masked: exactly 0


@pytest.mark.usefixtures("any_size")
def test_fully_masked_rows_average_as_mlx_and_additive_inf_rows_are_nan_as_mlx():
    rng = np.random.default_rng(4)
    logits = wide_logits(rng, (2, 3, 5, 12), 5.0)
    mask = rng.random((2, 1, 5, 12)) > 0.5
    mask[0, 0, 2] = False  # the row of a left-padded position: no key visible
    ours = softmax_weights(logits, 0.5, mask)
    theirs = softmax_weights(logits, 0.5, mask, fast=False)
    assert not np.isnan(ours).any()
    assert np.allclose(ours[0, :, 2], 1 / 12) and np.allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    additive = np.where(mask, 0.0, -np.inf).astype(np.float32)
    ours = softmax_weights(logits, 0.5, additive)
    theirs = softmax_weights(logits, 0.5, additive, fast=False)
    assert np.array_equal(np.isnan(ours), np.isnan(theirs)) and np.isnan(ours[0, :, 2]).all()


def left_padded_mask(lengths: list[int], L: int, S: int) -> mx.array:
    """What mlx-lm's BatchKVCache gives a batch of rows left-padded to S keys."""
    return base.create_causal_mask(L, S - L, left_padding=mx.array([S - n for n in lengths]))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
@pytest.mark.parametrize(("H", "n_kv"), [(4, 4), (4, 2), (9, 3), (8, 1)])
@pytest.mark.usefixtures("any_size")
def test_attention_matches_mlx_for_every_kind_of_mask(dtype, H, n_kv):
    rng = np.random.default_rng(H * 10 + n_kv)
    B, L, S, D = 3, 6, 20, 16
    q, k, v = (
        mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
        for shape in ((B, H, L, D), (B, n_kv, S, D), (B, n_kv, S, D))
    )
    padded = left_padded_mask([20, 9, 4], L, S)  # the last row's first 2 queries see no key
    masks = {
        "none": None,
        "causal": "causal",
        "left-padded bool": padded,
        "additive -inf": mx.where(padded, 0.0, -mx.inf).astype(dtype),
        "additive finite": mx.array(rng.standard_normal((B, 1, L, S)) * 3).astype(dtype),
        "per head": mx.array(rng.random((B, H, L, S)) > 0.3),
        "2-D": mx.array(rng.random((L, S)) > 0.3),
        "one key column": mx.array(rng.random((B, 1, 1, S)) > 0.3),
    }
    for name, mask in masks.items():
        ours = kernels.scaled_dot_product_attention(q, k, v, None, 0.25, mask)
        theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=mask)
        assert ours.dtype == dtype and ours.shape == theirs.shape, name
        ours, theirs = np.array(ours.astype(mx.float32)), np.array(theirs.astype(mx.float32))
        if name == "additive -inf":  # the fully masked rows: NaN in both
            assert np.array_equal(np.isnan(ours), np.isnan(theirs)), name
            ours, theirs = np.nan_to_num(ours), np.nan_to_num(theirs)
        tolerance = 2e-6 if dtype == mx.float32 else 2**-6  # a few half-precision ulps
        assert np.abs(ours - theirs).max() <= tolerance * np.abs(theirs).max(), name
        assert not np.isnan(ours).any(), name


@pytest.mark.usefixtures("any_size")
def test_a_one_query_causal_step_sees_every_key():
    q, k = mx.random.normal((2, 4, 1, 8)), mx.random.normal((2, 2, 9, 8))
    ours = kernels.scaled_dot_product_attention(q, k, k, None, 0.3, "causal")
    assert mx.allclose(ours, kernels.scaled_dot_product_attention(q, k, k, None, 0.3, None))
    assert mx.allclose(ours, mx.fast.scaled_dot_product_attention(q, k, k, scale=0.3), atol=1e-6)


@pytest.mark.usefixtures("any_size")
def test_what_attention_does_not_handle_goes_to_mlx_lm(monkeypatch):
    calls = []

    def theirs(*args, **kwargs):
        calls.append(kwargs)
        return "mlx-lm's"

    monkeypatch.setattr(base, "scaled_dot_product_attention", theirs)
    q, k = mx.random.normal((1, 4, 3, 8)), mx.random.normal((1, 2, 5, 8))

    def ours(q=q, k=k, v=k, cache=None, scale=0.5, mask=None, **kwargs):
        return kernels.scaled_dot_product_attention(q, k, v, cache, scale, mask, **kwargs)

    unhandled = {
        "sinks": ours(sinks=mx.zeros((4,))),
        "quantized cache": ours(cache=QuantizedKVCache()),
        "mixed dtypes": ours(k=k.astype(mx.bfloat16)),
        "half queries, float32 mask": ours(
            q=q.astype(mx.float16),
            k=k.astype(mx.float16),
            v=k.astype(mx.float16),
            mask=mx.zeros((3, 5)),
        ),
        "integer mask": ours(mask=mx.zeros((3, 5), dtype=mx.int32)),
        "5-D mask": ours(mask=mx.ones((1, 1, 1, 3, 5), dtype=mx.bool_)),
        "mask of another shape": ours(mask=mx.ones((1, 1, 3, 4), dtype=mx.bool_)),
        "other mask string": ours(mask="sliding"),
        "array scale": ours(scale=mx.array(0.5)),
        "3-D queries": ours(q=q[0]),
        "heads not a multiple": ours(q=mx.random.normal((1, 3, 3, 8))),
    }
    assert all(result == "mlx-lm's" for result in unhandled.values())
    assert len(calls) == len(unhandled)
    assert isinstance(ours(mask=mx.ones((3, 5), dtype=mx.bool_)), mx.array)  # handled
    with mx.stream(mx.cpu):
        assert isinstance(ours(), mx.array)


def test_calls_too_small_to_gain_go_to_mlx_lm(monkeypatch):
    monkeypatch.setattr(attention, "FUSED", False)  # the fused kernel takes every size
    calls = []
    monkeypatch.setattr(base, "scaled_dot_product_attention", lambda *a, **k: calls.append(a))
    small_q, large_q = mx.random.normal((1, 9, 1, 64)), mx.random.normal((1, 9, 2, 64))
    k = mx.random.normal((1, 3, attention.MIN_SCORES // 18 + 1, 64))
    kernels.scaled_dot_product_attention(small_q, k, k, None, 0.125, None)
    assert len(calls) == 1  # 9 heads x 1 query x 114 keys: below MIN_SCORES
    kernels.scaled_dot_product_attention(large_q, k, k, None, 0.125, "causal")
    assert len(calls) == 1


@pytest.mark.usefixtures("any_size")
def test_a_mask_passed_to_every_layer_is_converted_once_and_not_kept():
    q, k = mx.random.normal((2, 4, 3, 8)), mx.random.normal((2, 2, 7, 8))
    mask = left_padded_mask([7, 5], 3, 7)
    first = kernels.scaled_dot_product_attention(q, k, k, None, 0.5, mask)
    converted = attention._last_mask[2]
    second = kernels.scaled_dot_product_attention(q * 2, k, k, None, 0.5, mask)
    assert attention._last_mask[2] is converted
    theirs = mx.fast.scaled_dot_product_attention(q * 2, k, k, scale=0.5, mask=mask)
    assert mx.allclose(second, theirs, atol=1e-6) and not mx.allclose(first, second)
    kernels.scaled_dot_product_attention(q, k, k, None, 0.25, mask)  # another scale
    assert attention._last_mask[2] is not converted
    del mask  # the forward is over
    assert attention._last_mask[2] is None
