"""The fast CPU SiLU / SwiGLU (engine/kernels.py): accuracy over float32's range, the special
values, half-precision inputs, and its installation into mlx-lm models by the loader."""

import math
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import activations, switch_layers

from engine import kernels
from engine.loader import load_model
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
    cache = kernels._PerShape(max_entries=2)
    for n in (3, 4, 5, 4):
        x = mx.linspace(-5, 5, n)
        assert np.allclose(np.array(cache(x, None, mx.float32)), np.array(nn.silu(x)), rtol=1e-5)
    assert len(cache) == 2
    assert [key[0] for key in cache._entries] == [(5,), (4,)]  # 3 dropped, 4 used last


def fast_modules(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if getattr(m, "_orchard_fast", False)]


def test_the_engine_tests_models_have_it_unless_switched_off(tiny_llama, tiny_qwen3_next):
    # The identity tests compare Orchard's paths on these models: all of them run the same kernels.
    enabled = kernels.fast_kernels_enabled()
    assert bool(fast_modules(tiny_llama.model)) == enabled
    assert bool(fast_modules(tiny_qwen3_next.model)) == enabled


def test_loader_installs_it_and_outputs_stay_within_rounding(monkeypatch):
    path = build_tiny_model(model_type="llama", tokenizer="qwen3")
    monkeypatch.delenv(kernels.ENV_SWITCH, raising=False)
    assert kernels.fast_kernels_enabled()
    fast = load_model(path)
    assert sorted(fast_modules(fast.model)) == ["model.layers.0.mlp", "model.layers.1.mlp"]
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
