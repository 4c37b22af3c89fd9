"""The RoPE table (engine/kernels/rope.py): the same bits as `mx.fast.rope` for every setting,
offset kind and shape it takes; what it leaves to MLX; installed by the loader for the model's
context, one table per setting shared by the layers."""

import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.kernels import fast as kernels
from engine.kernels import rope as rope_kernel
from engine.models.loader import load_model
from tests.fixtures.tiny_models import build_tiny_model

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu or shutil.which("g++") is None,
    reason="the fast kernels are for MLX's CPU backend, whose compiler runs g++",
)

SETTINGS = [  # dims, head_dim, traditional, base, scale
    (64, 64, False, 100000.0, 1.0),  # the default model's
    (64, 64, True, 10000.0, 1.0),
    (32, 64, False, 10000.0, 1.0),  # partial rotary: the rest passes through
    (32, 64, True, 500000.0, 0.25),  # linear scaling
    (128, 128, False, 1e6, 1.0),
]


def queries(batch: int, heads: int, length: int, head_dim: int) -> mx.array:
    # mlx-lm's layout: projected (B, T, H, D), then transposed (a strided view)
    return mx.random.normal((batch, length, heads, head_dim)).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("dims, head_dim, traditional, base, scale", SETTINGS)
def test_bit_for_bit_the_same_as_mlx(dims, head_dim, traditional, base, scale):
    mlx_rope = nn.RoPE(dims, traditional=traditional, base=base, scale=scale)
    fast = rope_kernel.fast_rope(mlx_rope, 8192)
    assert isinstance(fast, rope_kernel.FastRoPE)
    for batch, heads, length in [(16, 9, 1), (1, 3, 128), (4, 2, 7)]:
        x = queries(batch, heads, length, head_dim)
        offsets = [0, 5, 8000, mx.array(17), mx.array([3 + 7 * i for i in range(batch)])]
        for offset in offsets:
            expected, got = mlx_rope(x, offset=offset), fast(x, offset=offset)
            assert got.shape == expected.shape and got.dtype == expected.dtype
            assert mx.array_equal(got, expected).item(), (batch, heads, length, offset)


def test_what_it_does_not_cover_goes_to_mlx(monkeypatch):
    mlx_rope = nn.RoPE(64, base=10000.0)
    fast = rope_kernel.fast_rope(mlx_rope, 100)
    table = fast._table
    assert table.positions >= 100
    x = queries(2, 3, 4, 64)
    calls = []
    original = mx.fast.rope

    def counted(*args, **kwargs):
        calls.append(kwargs.get("offset"))
        return original(*args, **kwargs)

    monkeypatch.setattr(mx.fast, "rope", counted)
    beyond = table.positions - 2  # an int offset running past the table
    assert mx.array_equal(
        fast(x, offset=beyond),
        original(x, 64, traditional=False, base=10000.0, scale=1.0, offset=beyond),
    ).item()
    fast(x.astype(mx.bfloat16), offset=3)  # another dtype
    with pytest.raises(ValueError):  # offsets for more rows than x has: MLX's own error
        fast(x, offset=mx.array([1, 2, 3]))
    assert len(calls) == 3  # the three above went to MLX's rope
    calls.clear()
    fast(x, offset=3)
    fast(x, offset=mx.array([1, 2]))
    assert calls == []


def test_array_offsets_past_the_table_are_clamped_not_read_out_of_bounds():
    # A batch's left padding has negative positions (masked); nothing reads outside the table.
    fast = rope_kernel.fast_rope(nn.RoPE(64, base=10000.0), 16)
    last = fast._table.positions - 1
    x = queries(2, 1, 3, 64)
    got = fast(x, offset=mx.array([-5, last]))
    at_zero = fast(x[:1], offset=0)
    at_last = fast(x[1:, :, :1], offset=last)
    assert mx.array_equal(got[:1, :, :1], at_zero[:, :, :1]).item()  # -5 read as 0
    assert mx.array_equal(got[1:, :, :1], at_last).item()
    second_at_last = fast(x[1:, :, 1:2], offset=last)
    assert mx.array_equal(got[1:, :, 1:2], second_at_last).item()  # last + 1 read as last


def test_tables_are_shared_per_setting_and_grow(monkeypatch):
    monkeypatch.setattr(rope_kernel, "_TABLES", {})
    small = rope_kernel.fast_rope(nn.RoPE(64, base=1234.0), 100)
    again = rope_kernel.fast_rope(nn.RoPE(64, base=1234.0), 50)
    other = rope_kernel.fast_rope(nn.RoPE(64, base=4321.0), 100)
    assert small._table is again._table and other._table is not small._table
    bigger = rope_kernel.fast_rope(nn.RoPE(64, base=1234.0), 1000)
    assert bigger._table.positions >= 1000 + rope_kernel.DRAFT_ROOM
    assert small._table.positions < bigger._table.positions  # the first model keeps its own
    # a table too big to be worth its memory is not built: the model keeps MLX's rope
    huge = nn.RoPE(128, base=1234.0)
    assert rope_kernel.fast_rope(huge, 10**8) is huge


def test_the_loader_installs_it_for_the_models_context(monkeypatch):
    monkeypatch.delenv(kernels.ENV_SWITCH, raising=False)
    path = build_tiny_model()
    loaded = load_model(path, context_length=3000)
    ropes = [layer.self_attn.rope for layer in loaded.model.model.layers]
    assert all(isinstance(r, rope_kernel.FastRoPE) for r in ropes)
    assert all(r._table is ropes[0]._table for r in ropes)
    assert ropes[0]._table.positions >= 3000
    kernels.install(loaded.model)  # installing again wraps nothing twice
    again = [layer.self_attn.rope for layer in loaded.model.model.layers]
    assert all(new is old for new, old in zip(again, ropes, strict=True))
    assert all(type(r) is rope_kernel.FastRoPE for r in ropes)

    monkeypatch.setenv(kernels.ENV_SWITCH, "0")
    plain = load_model(path).model
    assert type(plain.model.layers[0].self_attn.rope) is nn.RoPE
