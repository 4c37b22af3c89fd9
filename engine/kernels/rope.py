"""Rotary position embedding (`nn.RoPE`) on MLX's CPU backend from a table of cos and sin.

`mx.fast.rope` has no CPU kernel: its fallback builds the angles of the call's positions, their
cos and sin (scalar, an element at a time) and the rotation from about ten separate ops, on
every call, twice a layer (queries and keys). At MLX's CPU cost per op that is most of the
time: 3.9 ms of a batch-16 decode step of the default model and 17.6 ms of a 128-token prefill
chunk went to it, against 1.9 and 9.4 ms here (bench/kernels.py; bench/RESULTS.md, "Fast CPU
kernels").

Here the cos and sin of every position the model may see are computed once per RoPE setting
(dims, traditional, base, scale), by the same float32 operations as MLX's fallback, so they are
the same bits; a call gathers its positions' rows and rotates, one compiled kernel per shape
(fastexp.PerShape). The outputs are identical to `mx.fast.rope`'s (tests/engine/
test_rope_kernel.py checks it bit for bit).

Positions: the table covers the model's context (`install(model, positions=...)`, from the
loader), which every request is checked against (engine/protocol/checks.py), and DRAFT_ROOM more. An
integer offset past the table goes to `mx.fast.rope`; an array offset (a batch's rows, each at
its own position) cannot be read without waiting for the device, so its positions are clamped
into the table: only a batch's padding (negative positions, masked) and a speculative step's
padded positions (discarded) can be clamped. A table over `MAX_TABLE_BYTES` is not built (the
model keeps MLX's rope).
"""

from __future__ import annotations

import math
import threading

import mlx.core as mx
import mlx.nn as nn

from engine.kernels.fastexp import PerShape

MAX_TABLE_BYTES = 64 * 1024 * 1024
# Positions past a sequence's end a step may compute: in a speculative step, rows with a
# shorter draft are padded to the longest (their extra positions are discarded).
DRAFT_ROOM = 64
_DTYPES = (mx.float32,)


class RopeTable:
    """cos and sin, float32, of positions [0, `positions`) for one RoPE setting."""

    def __init__(self, dims: int, traditional: bool, base: float, scale: float, positions: int):
        # `traditional` changes the rotation (the kernel), not the angles.
        self.positions = positions
        half = dims // 2
        # MLX's fallback: inverse frequencies exp(-i · ln(base) / half), angles (p · scale) · f.
        inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(base) / half))
        angles = (mx.arange(positions, dtype=mx.float32) * scale)[:, None] * inv_freqs
        self.cos, self.sin = mx.cos(angles), mx.sin(angles)
        mx.eval(self.cos, self.sin)

    @staticmethod
    def nbytes(dims: int, positions: int) -> int:
        return 2 * positions * (dims // 2) * 4


def _rotate(x, cos, sin, start, *, dims: int, traditional: bool, batch_rows: bool, last: int):
    """x (..., T, D) rotated in its first `dims` features at positions start + [0, T): `start`
    a scalar, or with `batch_rows` one per row of x's first axis; clamped into [0, last]."""
    steps = mx.arange(x.shape[-2], dtype=mx.int32)
    index = mx.clip((start[:, None] if batch_rows else start) + steps, 0, last)
    cos, sin = cos[index], sin[index]  # (T, half) or (B, T, half)
    if batch_rows:
        shape = (cos.shape[0],) + (1,) * (x.ndim - 3) + cos.shape[1:]
        cos, sin = cos.reshape(shape), sin.reshape(shape)
    rotated = x[..., :dims] if dims < x.shape[-1] else x
    if traditional:
        pairs = rotated.reshape(*rotated.shape[:-1], dims // 2, 2)
        even, odd = pairs[..., 0], pairs[..., 1]
        out = mx.stack([even * cos - odd * sin, even * sin + odd * cos], axis=-1)
        out = out.reshape(rotated.shape)
    else:
        half = dims // 2
        first, second = rotated[..., :half], rotated[..., half:]
        out = mx.concatenate([first * cos - second * sin, first * sin + second * cos], axis=-1)
    if dims < x.shape[-1]:
        out = mx.concatenate([out, x[..., dims:]], axis=-1)
    return out


def _build(key: tuple) -> tuple:
    _, _, dims, traditional, batch_rows, last = key
    return (
        lambda x, cos, sin, start: _rotate(
            x, cos, sin, start, dims=dims, traditional=traditional, batch_rows=batch_rows, last=last
        ),
    )


KERNELS = PerShape(_build)


class FastRoPE(nn.RoPE):
    """`nn.RoPE` with the table above on the CPU; anything it does not cover goes to MLX's."""

    _table: RopeTable  # shared by the model's layers of one setting; not a parameter
    _orchard_fast = True

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        table = self._table
        if (
            x.dtype not in _DTYPES
            or x.ndim < 3
            or self.dims > x.shape[-1]
            or mx.default_device() != mx.cpu
        ):
            return super().__call__(x, offset)
        length = x.shape[-2]
        if isinstance(offset, int):
            if offset < 0 or offset + length > table.positions:
                return super().__call__(x, offset)
            start, batch_rows = mx.array(offset, dtype=mx.int32), False
        elif isinstance(offset, mx.array) and offset.ndim <= 1:
            if offset.ndim == 1 and offset.shape[0] != x.shape[0]:
                return super().__call__(x, offset)
            start, batch_rows = offset.astype(mx.int32), offset.ndim == 1
        else:
            return super().__call__(x, offset)
        key = (x.shape, start.shape, self.dims, self.traditional, batch_rows, table.positions - 1)
        (kernel,) = KERNELS[key]
        return kernel(x, table.cos, table.sin, start)


_TABLES: dict[tuple, RopeTable] = {}
_TABLES_LOCK = threading.Lock()


def table_for(rope: nn.RoPE, positions: int) -> RopeTable | None:
    """The shared table of `rope`'s setting covering `positions` (built or grown now), or None
    when it would be over MAX_TABLE_BYTES."""
    positions += DRAFT_ROOM
    if RopeTable.nbytes(rope.dims, positions) > MAX_TABLE_BYTES:
        return None
    key = (rope.dims, bool(rope.traditional), float(rope.base), float(rope.scale))
    with _TABLES_LOCK:
        table = _TABLES.get(key)
        if table is None or table.positions < positions:
            table = _TABLES[key] = RopeTable(*key, positions)
        return table


def fast_rope(rope: nn.RoPE, positions: int) -> nn.RoPE:
    """A FastRoPE copy of `rope` (a plain `nn.RoPE`, not a subclass), or `rope` itself when no
    table can be had."""
    if type(rope) is not nn.RoPE or rope.dims % 2:
        return rope
    table = table_for(rope, positions)
    if table is None:
        return rope
    copy = FastRoPE(rope.dims, traditional=rope.traditional, base=rope.base, scale=rope.scale)
    object.__setattr__(copy, "_table", table)
    return copy
