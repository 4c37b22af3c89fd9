"""Multimodal rotary positions (M-RoPE: Qwen2-VL, Qwen2.5-VL) in the continuous batch.

M-RoPE splits a rotary embedding's frequencies into sections that rotate by a token's time,
height and width. A text token has the same position in all three, so for text M-RoPE is the
plain rotary embedding at that position: the served mlx-lm model's own (and the fast kernels')
rope. An image's placeholder tokens take positions along its grid, and the text after the image
continues from the image's largest position plus one, so every later token of that prompt sits
`delta` (<= 0) positions before its index.

The served model keeps mlx-lm's attention; each layer's rope becomes an `MRoPE`, reading the
model's shared `Positions` (set by the runner around a forward, engine/core/runner.py):
- a prompt's chunk with images (a forward of one row): its three position rows, from mlx-vlm's
  `get_rope_index`, rotated by mlx-vlm's own M-RoPE;
- a batch of rows (decode steps, drafts' checks): each row's `delta`, added to its offset in the
  cache; rows of text-only requests add 0;
- otherwise (text-only forwards): the plain rope.
A prefix-cache entry stores keys already rotated; a prompt that hits it has the same images (the
cache keys images by content), so the same positions.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn

# mlx-vlm's model types whose language model rotates by M-RoPE ("chunked" halves, as Qwen's).
MROPE_MODELS = ("qwen2_vl", "qwen2_5_vl")


class Positions:
    """What the next forward's rotary embeddings read (None, None: plain positions)."""

    def __init__(self) -> None:
        self.table: mx.array | None = None  # (3, T): one row's positions, time/height/width
        self.shifts: mx.array | None = None  # (B,): added to each row's offset

    @contextmanager
    def prompt(self, table: mx.array | None) -> Iterator[None]:
        """Within: a forward of one row over `table`'s positions (None: plain)."""
        self.table = table
        try:
            yield
        finally:
            self.table = None

    @contextmanager
    def rows(self, deltas: Sequence[int]) -> Iterator[None]:
        """Within: a forward of rows, row r at its offset plus `deltas[r]`."""
        self.shifts = mx.array(list(deltas), dtype=mx.int32) if any(deltas) else None
        try:
            yield
        finally:
            self.shifts = None


class MRoPE(nn.Module):
    """A layer's rope: the model's own (`rope`, plain positions, offsets shifted per row) or,
    over a prompt's explicit positions, mlx-vlm's M-RoPE (`rotary`, `apply`)."""

    def __init__(self, rope: nn.Module, rotary: nn.Module, apply: Any, positions: Positions):
        super().__init__()
        self.rope = rope  # a child: the fast kernels replace it like any rope
        object.__setattr__(self, "_rotary", rotary)  # not a child: no parameters, no swaps
        object.__setattr__(self, "_apply", apply)
        object.__setattr__(self, "_positions", positions)

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        positions = self._positions
        if positions.table is not None:
            cos, sin = self._rotary(x, positions.table[:, None, :])
            # (mlx-vlm rotates queries and keys together; the unused second result is never
            # computed: MLX evaluates only what the model's output needs.)
            rotated, _ = self._apply(x, x, cos, sin, unqueeze_dim=1)
            return rotated.astype(x.dtype)
        if positions.shifts is not None:
            offset = offset + positions.shifts
        return self.rope(x, offset=offset)


def install(model: nn.Module, vlm: nn.Module) -> Positions:
    """Give every attention layer of the served `model` an `MRoPE` reading one `Positions`,
    with mlx-vlm's rotary embedding of the same layer; returns the `Positions` (also the
    model's `_orchard_positions`)."""
    positions = Positions()
    language = importlib.import_module(type(vlm.language_model).__module__)
    theirs = vlm.language_model.model.layers
    for layer, their in zip(model.layers, theirs, strict=True):
        attention = layer.self_attn
        attention.rope = MRoPE(
            attention.rope,
            their.self_attn.rotary_emb,
            language.apply_multimodal_rotary_pos_emb,
            positions,
        )
    object.__setattr__(model, "_orchard_positions", positions)
    return positions


def rows(model: nn.Module, seqs: Sequence[Any]):
    """A context for a forward of `seqs`' rows (engine/core/request.py Sequence), each at its
    request's `rope_delta` (nothing to do on other models, or when every delta is 0)."""
    positions = getattr(model, "_orchard_positions", None)
    if positions is None:
        return nullcontext()
    deltas = [seq.request.rope_delta for seq in seqs]
    return positions.rows(deltas) if any(deltas) else nullcontext()


def prompt(model: nn.Module, table: mx.array | None):
    """A context for a forward of one row over `table`'s positions (None: plain)."""
    positions = getattr(model, "_orchard_positions", None)
    return nullcontext() if positions is None or table is None else positions.prompt(table)
