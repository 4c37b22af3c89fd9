"""Orchard's fused decode attention: engine/kernels/native/attention.c as an MLX primitive
(engine/kernels/native/mlx_extension.py), the path engine/kernels/attention.py takes for float32
decode steps and other short query blocks on the CPU."""

import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base

from engine.kernels import attention
from engine.kernels.native import mlx_extension
from engine.protocol import SamplingParams
from tests.engine.conftest import make_request, run_batched


@pytest.fixture(scope="module")
def fused():
    module = attention.fused_kernel()
    assert module is not None, "the fused kernel did not build or load on this machine"
    return module


def reference(q, k, v, scale, mask=None, causal=False) -> np.ndarray:
    """softmax(scale * q k^T over the visible keys) v in float64; a row that sees no key
    averages all values (as MLX does for bool masks)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    (H, L), (KH, S) = q.shape[1:3], k.shape[1:3]
    k, v = np.repeat(k, H // KH, axis=1), np.repeat(v, H // KH, axis=1)
    z = scale * q @ k.swapaxes(-1, -2)
    visible = np.ones(z.shape, bool)
    if mask is not None:
        mask = np.asarray(mask)
        visible &= np.broadcast_to(mask.reshape((1,) * (4 - mask.ndim) + mask.shape), z.shape)
    if causal:
        visible &= np.arange(S)[None] <= (S - L + np.arange(L))[:, None]
    z = np.where(visible, z, -np.inf)
    z = np.where(visible.any(-1, keepdims=True), z, 0.0)
    e = np.exp(z - z.max(-1, keepdims=True))
    return (e / e.sum(-1, keepdims=True)) @ v


def arrays(rng, B, H, KH, L, S, D, DV, spread=1.0):
    return (
        mx.array((rng.standard_normal(shape) * s).astype(np.float32))
        for shape, s in (((B, H, L, D), spread), ((B, KH, S, D), 1.0), ((B, KH, S, DV), 1.0))
    )


@pytest.mark.parametrize(
    ("B", "H", "KH", "L", "S", "D", "DV"),
    [
        (16, 9, 3, 1, 160, 64, 64),  # the default model's batch-16 decode step
        (2, 32, 8, 1, 300, 128, 128),  # Llama-style GQA
        (3, 4, 4, 5, 65, 8, 16),  # one key past a block; DV != D
        (1, 8, 1, 3, 7, 256, 256),  # the largest dimensions, fewer keys than a vector
        (2, 6, 2, 8, 4096, 64, 40),  # long rows, a speculative step's 8 queries
    ],
)
@pytest.mark.parametrize("spread", [1e-3, 1.0, 8.0])  # near-uniform to near one-hot rows
def test_it_matches_float64_as_closely_as_mlx(fused, B, H, KH, L, S, D, DV, spread):
    rng = np.random.default_rng(B * 1000 + S)
    q, k, v = arrays(rng, B, H, KH, L, S, D, DV, spread)
    mask = rng.random((B, 1, L, S)) > 0.25
    for m, causal in ((None, False), (mask, False), (None, L > 1)):
        expected = reference(q, k, v, 0.125, m, causal)
        m = None if m is None else mx.array(m)
        ours = np.array(fused.decode_attention(q, k, v, m, 0.125, causal))
        mlx_mask = "causal" if causal else m
        theirs = np.array(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mlx_mask))
        error, mlx_error = np.abs(ours - expected).max(), np.abs(theirs - expected).max()
        # Measured (values of scale 1): at most 1.7x MLX's own error, the largest 4.3e-6
        # against MLX's 4.4e-6 (near one-hot rows).
        assert error < 1e-5 and error <= 2 * mlx_error + 1e-7, (error, mlx_error)


def left_padded_mask(lengths: list[int], L: int, S: int) -> mx.array:
    """What mlx-lm's BatchKVCache gives a batch of rows left-padded to S keys."""
    return base.create_causal_mask(L, S - L, left_padding=mx.array([S - n for n in lengths]))


@pytest.mark.parametrize("L", [1, 4])
def test_masks_of_every_shape_match_mlx_through_the_models_entry(fused, L):
    rng = np.random.default_rng(L)
    B, H, KH, S, D = 3, 9, 3, 90, 64
    q, k, v = arrays(rng, B, H, KH, L, S, D, D)
    masks = {
        "none": None,
        "causal": "causal",
        "left-padded bool": left_padded_mask([90, 70, 3], L, S),  # the last: rows see no key
        "per head": mx.array(rng.random((B, H, L, S)) > 0.3),
        "2-D": mx.array(rng.random((L, S)) > 0.3),
        "one key column": mx.array(rng.random((B, 1, 1, S)) > 0.3),
    }
    calls = []
    original = fused.decode_attention

    class Spy:
        MAX_ROWS, MAX_DIM = fused.MAX_ROWS, fused.MAX_DIM

        def decode_attention(self, *args):
            calls.append(args)
            return original(*args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(attention, "fused_kernel", Spy)
        for name, mask in masks.items():
            ours = attention.scaled_dot_product_attention(q, k, v, None, 0.125, mask)
            theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
            assert np.abs(np.array(ours) - np.array(theirs)).max() < 2e-6, name
    assert len(calls) == len(masks)  # every one of them took the fused kernel


def test_hidden_keys_and_values_never_reach_the_output(fused):
    rng = np.random.default_rng(7)
    q, k, v = (np.array(x) for x in arrays(rng, 2, 4, 2, 1, 100, 32, 32))
    mask = rng.random((2, 1, 1, 100)) > 0.4
    clean = np.array(fused.decode_attention(*map(mx.array, (q, k, v, mask)), 0.3, False))
    for b in range(2):  # padding holding anything at all
        hidden = ~mask[b, 0, 0]
        k[b][:, hidden], v[b][:, hidden] = np.nan, np.inf
    dirty = np.array(fused.decode_attention(*map(mx.array, (q, k, v, mask)), 0.3, False))
    assert np.isfinite(dirty).all() and np.array_equal(clean, dirty)


def test_a_row_is_the_same_bits_alone_as_left_padded_in_a_batch(fused):
    """Blocks start at the first visible key, so padding does not move the sums' order."""
    rng = np.random.default_rng(11)
    alone = [np.array(x) for x in arrays(rng, 1, 6, 2, 1, 100, 64, 64)]  # 100 keys: 2 blocks
    S = 170
    batch = [np.array(x) for x in arrays(rng, 3, 6, 2, 1, S, 64, 64)]
    batch[0][1] = alone[0][0]
    batch[1][1, :, S - 100 :], batch[2][1, :, S - 100 :] = alone[1][0], alone[2][0]
    mask = np.array(left_padded_mask([170, 100, 120], 1, S))
    theirs = fused.decode_attention(*map(mx.array, batch), mx.array(mask), 0.125, False)
    ours = fused.decode_attention(*map(mx.array, alone), None, 0.125, False)
    assert np.array_equal(np.array(theirs)[1], np.array(ours)[0])


def test_operands_without_a_contiguous_last_axis_are_read_right(fused):
    """Views whose strides MLX knows only once evaluated: transposed, reversed, broadcast."""
    rng = np.random.default_rng(13)
    q, k, v = arrays(rng, 2, 4, 2, 1, 40, 16, 16)
    base_k = mx.array(rng.standard_normal((2, 2, 16, 40)).astype(np.float32))
    cases = {
        "transposed keys": (q, base_k.swapaxes(-1, -2), v),
        "reversed last axis": (q[..., ::-1], k, v[..., ::-1]),
        "broadcast along the last axis": (q, k, mx.broadcast_to(v[..., :1], v.shape)),
    }
    for name, (qq, kk, vv) in cases.items():
        ours = fused.decode_attention(qq, kk, vv, None, 0.25, False)
        theirs = mx.fast.scaled_dot_product_attention(qq, kk, vv, scale=0.25)
        assert mx.allclose(ours, theirs, atol=2e-6).item(), name


def test_a_nan_score_gives_nan_as_mlx(fused):
    rng = np.random.default_rng(17)
    q, k, v = (np.array(x) for x in arrays(rng, 2, 2, 1, 1, 30, 8, 8))
    q[1, 0, 0, 0] = np.nan
    ours = np.array(fused.decode_attention(*map(mx.array, (q, k, v)), None, 0.5, False))
    assert (
        np.isnan(ours[1, 0]).all() and np.isfinite(ours[0]).all() and np.isfinite(ours[1, 1]).all()
    )


def test_a_row_that_sees_no_key_averages_the_values_as_mlx(fused):
    rng = np.random.default_rng(3)
    q, k, v = arrays(rng, 2, 2, 1, 1, 12, 8, 8)
    mask = mx.array(np.array([[[[True] * 12]], [[[False] * 12]]]))
    ours = fused.decode_attention(q, k, v, mask, 0.5, False)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask)
    assert mx.allclose(ours[1], mx.mean(v[1], axis=1, keepdims=True), atol=1e-6).item()
    assert mx.allclose(ours, theirs, atol=1e-6).item()


def test_what_it_does_not_take_stays_on_mlx_ops(fused, monkeypatch):
    taken = []

    class Spy:
        MAX_ROWS, MAX_DIM = fused.MAX_ROWS, fused.MAX_DIM

        def decode_attention(self, *args):
            taken.append(1)
            return fused.decode_attention(*args)

    monkeypatch.setattr(attention, "fused_kernel", Spy)
    monkeypatch.setattr(attention, "MIN_SCORES", 0)
    rng = np.random.default_rng(5)

    def call(B=2, H=4, KH=2, L=1, S=20, D=16, DV=16, dtype=mx.float32, mask=None):
        q, k, v = (x.astype(dtype) for x in arrays(rng, B, H, KH, L, S, D, DV))
        return attention.scaled_dot_product_attention(q, k, v, None, 0.5, mask)

    not_taken = {
        "float16": call(dtype=mx.float16),
        "bfloat16": call(dtype=mx.bfloat16),
        "additive mask": call(mask=mx.zeros((2, 1, 1, 20))),
        "too many rows per KV head": call(H=16, KH=1, L=2),  # 32 > 24
        "dimension not a multiple of 8": call(D=12, DV=12),
        "dimension over 256": call(D=264, DV=264),
    }
    assert not taken and all(isinstance(r, mx.array) for r in not_taken.values())
    monkeypatch.setattr(attention, "FUSED", False)
    call()
    assert not taken
    monkeypatch.setattr(attention, "FUSED", True)
    call()
    assert taken == [1]


def test_the_extension_refuses_what_the_kernel_does_not_take(fused):
    q, k = mx.zeros((1, 4, 1, 12)), mx.zeros((1, 2, 5, 12))
    with pytest.raises(ValueError, match="shapes"):
        fused.decode_attention(q, k, k, None, 1.0, False)
    with pytest.raises(ValueError, match="float32"):
        fused.decode_attention(q.astype(mx.float16), k, k, None, 1.0, False)
    q, k = mx.zeros((1, 4, 1, 16)), mx.zeros((1, 2, 5, 16))
    with pytest.raises(ValueError, match="broadcast"):
        fused.decode_attention(q, k, k, mx.ones((1, 1, 1, 4), dtype=mx.bool_), 1.0, False)


def test_concurrent_callers_each_get_their_own_result(fused):
    """Two threads on two streams: one takes the sgemm pool, the other computes alone."""
    rng = np.random.default_rng(9)
    cases = [tuple(arrays(rng, 8, 9, 3, 1, 200, 64, 64)) for _ in range(2)]
    expected = [np.array(fused.decode_attention(*c, None, 0.125, False)) for c in cases]
    results, errors = {}, []

    def run(i):
        try:
            with mx.stream(mx.new_stream(mx.cpu)):
                for _ in range(20):
                    results[i] = np.array(fused.decode_attention(*cases[i], None, 0.125, False))
                    assert np.array_equal(results[i], expected[i])
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors and all(np.array_equal(results[i], expected[i]) for i in range(2))


def test_the_engine_decodes_with_it_and_greedy_tokens_match_mlx_ops(tiny_llama, monkeypatch):
    calls = []
    module = attention.fused_kernel()

    class Spy:
        MAX_ROWS, MAX_DIM = module.MAX_ROWS, module.MAX_DIM

        def decode_attention(self, q, *args):
            calls.append(q.shape[2])
            return module.decode_attention(q, *args)

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [[1000 + 7 * i + j for j in range(n)] for i, n in enumerate((3, 40, 90, 130))]
    requests = [make_request(f"f{i}", p, params) for i, p in enumerate(prompts)]
    monkeypatch.setattr(attention, "fused_kernel", Spy)
    ours = run_batched(tiny_llama, requests, join_at=[0, 0, 2, 4])
    # Decode steps and the short prefill blocks (4 query heads over 2 KV heads: up to 12
    # queries); the long ones stay on MLX ops.
    assert 1 in calls and max(calls) <= 12
    monkeypatch.setattr(attention, "FUSED", False)
    theirs = run_batched(tiny_llama, requests, join_at=[0, 0, 2, 4])
    for request in requests:
        assert ours.tokens(request.request_id) == theirs.tokens(request.request_id)


def test_without_cmake_it_is_not_built_and_attention_stays_on_mlx_ops(monkeypatch, tmp_path):
    monkeypatch.setenv("ORCHARD_NATIVE_CACHE", str(tmp_path))
    monkeypatch.setattr(mlx_extension, "find_cmake", lambda: None)
    mlx_extension.load_extension.cache_clear()
    attention.fused_kernel.cache_clear()
    try:
        assert mlx_extension.build_extension() is None
        assert attention.fused_kernel() is None
        q, k = mx.random.normal((1, 4, 1, 64)), mx.random.normal((1, 2, 300, 64))
        ours = attention.scaled_dot_product_attention(q, k, k, None, 0.125, None)
        assert mx.allclose(ours, mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125))
    finally:
        mlx_extension.load_extension.cache_clear()
        attention.fused_kernel.cache_clear()
    assert list(tmp_path.iterdir()) == []
