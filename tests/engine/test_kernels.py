"""The fast CPU kernels (engine/kernels/): SiLU / SwiGLU and attention against float64 and MLX
over float32's range, special values, masks and half precision; what they leave to MLX; their
installation into mlx-lm models by the loader, and greedy tokens unchanged by it."""

import math
import random
import shutil
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import activations, base, switch_layers
from mlx_lm.models.cache import QuantizedKVCache
from mlx_lm.utils import load_model as mlx_load_model

from engine.kernels import attention, fastexp
from engine.kernels import fast as kernels
from engine.models.loader import load_model
from engine.protocol import SamplingParams
from tests.engine.conftest import make_request, run_batched
from tests.fixtures.tiny_models import build_tiny_model

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


# Attention. Keys and values that are identity matrices make the output the softmax weights
# themselves (q @ I and P @ I are exact), so the weights can be checked one by one.


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


def fast_modules(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if getattr(m, "_orchard_fast", False)]


def test_the_engine_tests_models_have_it_unless_switched_off(tiny_llama, tiny_qwen3_next):
    # The identity tests compare Orchard's paths on these models: all of them run the same kernels.
    enabled = kernels.fast_kernels_enabled()
    for model in (tiny_llama.model, tiny_qwen3_next.model):
        names = fast_modules(model)
        assert any(n.endswith(".mlp") for n in names) == enabled
        assert any(n.endswith(".self_attn") for n in names) == enabled


def test_loader_installs_it_and_outputs_stay_within_rounding(monkeypatch):
    path = build_tiny_model(model_type="llama", tokenizer="qwen3")
    monkeypatch.delenv(kernels.ENV_SWITCH, raising=False)
    assert kernels.fast_kernels_enabled()
    fast = load_model(path)
    assert sorted(fast_modules(fast.model)) == [
        "model.layers.0.mlp",
        "model.layers.0.self_attn",
        "model.layers.0.self_attn.rope",
        "model.layers.1.mlp",
        "model.layers.1.self_attn",
        "model.layers.1.self_attn.rope",
    ]
    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    assert not kernels.fast_kernels_enabled()
    plain = load_model(path)
    assert fast_modules(plain.model) == []

    tokens = mx.array([[3000 + 7 * i for i in range(40)]])
    ours, theirs = fast.model(tokens), plain.model(tokens)
    assert np.abs(np.array(ours - theirs)).max() < 1e-4
    assert mx.array_equal(mx.argmax(ours, axis=-1), mx.argmax(theirs, axis=-1))


def test_hybrid_model_gets_it_in_mlps_and_gated_norms(monkeypatch):
    monkeypatch.delenv(kernels.ENV_SWITCH, raising=False)
    model = load_model(build_tiny_model(model_type="qwen3_next", tokenizer="qwen3")).model
    names = fast_modules(model)
    assert "model.layers.0.mlp" in names and "model.layers.1.mlp" in names
    assert "model.layers.0.linear_attn.norm" in names  # precise_swiglu in the gated RMSNorm
    assert "model.layers.1.self_attn" in names  # the full-attention layer


def test_install_copies_shared_modules_and_keeps_parameters():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = [switch_layers.SwitchGLU(8, 16, 4) for _ in range(2)]

        def __call__(self, x, indices):
            return self.blocks[1](self.blocks[0](x, indices).sum(-2), indices)

    model = Experts()
    shared = model.blocks[0].activation
    assert shared is model.blocks[1].activation  # mlx-lm's default SwiGLU() instance
    weights = model.blocks[0].gate_proj.weight
    x, indices = mx.random.normal((2, 3, 8)), mx.array([[[0, 1]] * 3] * 2)
    before = model(x, indices)

    assert kernels.install(model) == 1
    assert type(shared) is switch_layers.SwiGLU  # other models keep theirs
    assert model.blocks[0].activation is model.blocks[1].activation is not shared
    assert model.blocks[0].gate_proj.weight is weights
    assert np.allclose(np.array(model(x, indices)), np.array(before), rtol=1e-5, atol=1e-6)
    assert kernels.install(model) == 1  # installing twice changes nothing


def greedy_tokens(model: nn.Module, prompt: list[int], count: int) -> list[int]:
    steps = generate_step(
        mx.array(prompt), model, max_tokens=count, sampler=lambda x: mx.argmax(x, axis=-1)
    )
    return [int(token) for token, _ in steps]


def test_greedy_tokens_are_the_same_with_the_fast_kernels_on_and_off(tiny_model, monkeypatch):
    if not fast_modules(tiny_model.model):
        pytest.skip("the fast kernels are switched off here")
    fast_calls, small_calls = set(), []
    converted, original = attention._additive_mask, base.scaled_dot_product_attention

    def fast(mask, scale, queries, keys):  # the fast path's calls, by mask kind
        kind = mask if mask is None or isinstance(mask, str) else str(mask.dtype)
        fast_calls.add((kind, "prefill" if queries.shape[2] > 1 else "decode"))
        return converted(mask, scale, queries, keys)

    def theirs(queries, keys, *args, **kwargs):  # the plain model has its own reference
        small_calls.append(math.prod(queries.shape[:3]) * keys.shape[2])
        return original(queries, keys, *args, **kwargs)

    fused = attention.fused_kernel()

    class FusedSpy:  # the fused kernel's calls (decode steps, short blocks), by mask kind
        MAX_ROWS, MAX_DIM = fused.MAX_ROWS, fused.MAX_DIM

        def decode_attention(self, queries, keys, values, mask, *args):
            kind = "fused " + ("none" if mask is None else str(mask.dtype))
            fast_calls.add((kind, "prefill" if queries.shape[2] > 1 else "decode"))
            return fused.decode_attention(queries, keys, values, mask, *args)

    monkeypatch.setattr(attention, "_additive_mask", fast)
    monkeypatch.setattr(attention, "fused_kernel", FusedSpy)
    monkeypatch.setattr(base, "scaled_dot_product_attention", theirs)
    model_type = "llama" if tiny_model.info.name == "tiny-llama" else "qwen3_next"
    plain_model, _ = mlx_load_model(build_tiny_model(model_type=model_type, tokenizer="qwen3"))
    assert fast_modules(plain_model) == []
    plain = replace(tiny_model, model=plain_model)
    rng = random.Random(5)
    vocab = tiny_model.info.vocab_size
    prompts = [[rng.randrange(1000, vocab - 1000) for _ in range(n)] for n in (1, 30, 90, 150)]
    # mlx-lm's loop: a KVCache, "causal" prefill masks and none at decode.
    for prompt in prompts[1:]:
        assert greedy_tokens(tiny_model.model, prompt, 12) == greedy_tokens(plain_model, prompt, 12)
    # Orchard's engine: prompts prefilled together (left-padded, bool masks), then decoded in
    # one BatchKVCache (4 rows x 4 heads x ~160 keys: the fast path), a row joining later.
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    requests = [make_request(f"g{i}", p, params) for i, p in enumerate(prompts)]
    ours = run_batched(tiny_model, requests, join_at=[0, 0, 0, 3])
    theirs = run_batched(plain, requests, join_at=[0, 0, 0, 3])
    for request in requests:
        assert ours.tokens(request.request_id) == theirs.tokens(request.request_id)
    assert {("causal", "prefill"), ("mlx.core.bool", "prefill")} <= fast_calls
    assert ("fused mlx.core.bool", "decode") in fast_calls
    assert small_calls == []  # what the ops path finds too small, the fused kernel takes
