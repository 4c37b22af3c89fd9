"""Where a prompt's images sit in a Qwen-VL language model, in the continuous batch: multimodal
rotary positions (M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL) and Qwen3-VL's deepstack.

M-RoPE splits a rotary embedding's frequencies into sections that rotate by a token's time,
height and width. A text token has the same position in all three, so for text M-RoPE is the
plain rotary embedding at that position: the served mlx-lm model's own (and the fast kernels')
rope. An image's placeholder tokens take positions along its grid, and the text after the image
continues from the image's largest position plus one, so every later token of that prompt sits
`delta` (<= 0) positions before its index. Qwen3-VL also adds features of the vision tower's
intermediate layers to the output of the language model's first layers at the images'
placeholders ("deepstack").

The served model keeps mlx-lm's attention and layers; each layer's rope becomes an `MRoPE`, and
on Qwen3-VL its first layers add the deepstack features, reading the model's shared `Positions`
(set by the runner around a forward, engine/core/runner.py):
- a prompt's chunk with images (a forward of one row): its `Layout` for those tokens (the three
  position rows from mlx-vlm's `get_rope_index`, rotated by mlx-vlm's own M-RoPE; the deepstack
  features of the placeholders in the chunk);
- a batch of rows (decode steps, drafts' checks): each row's `delta`, added to its offset in the
  cache; rows of text-only requests add 0;
- otherwise (text-only forwards): the plain rope, nothing added.
A prefix-cache entry stores keys already rotated (and computed with the deepstack features); a
prompt that hits it has the same images (the cache keys images by content), so the same entry.
"""

from __future__ import annotations

import importlib
from bisect import bisect_left
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn

# mlx-vlm's model types whose language model rotates by M-RoPE.
MROPE_MODELS = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class Layout:
    """A prompt's (or a span of it) positions (3, T): time, height, width; the indices of its
    image placeholders (sorted); and per deepstack layer, their features (placeholders, hidden)."""

    table: mx.array
    visual: tuple[int, ...] = ()
    deepstack: tuple[mx.array, ...] = ()

    def span(self, start: int, end: int) -> Layout:
        """The layout of tokens [start, end), their placeholder indices from `start`."""
        first, last = bisect_left(self.visual, start), bisect_left(self.visual, end)
        return Layout(
            self.table[:, start:end],
            tuple(i - start for i in self.visual[first:last]),
            tuple(features[first:last] for features in self.deepstack) if last > first else (),
        )

    def extended(self, end: int, delta: int) -> Layout:
        """With text up to `end` tokens after the prompt (tokens it generated, resumed after a
        preemption): each at its index plus `delta`."""
        length = self.table.shape[1]
        if end <= length:
            return self
        after = mx.arange(length, end, dtype=self.table.dtype) + delta
        table = mx.concatenate([self.table, mx.broadcast_to(after, (3, after.size))], axis=1)
        return Layout(table, self.visual, self.deepstack)


class Positions:
    """What the next forward's rotary embeddings and deepstack layers read (None, None: plain
    positions, nothing added)."""

    def __init__(self) -> None:
        self.layout: Layout | None = None  # one row's tokens
        self.shifts: mx.array | None = None  # (B,): added to each row's offset

    @contextmanager
    def prompt(self, layout: Layout) -> Iterator[None]:
        """Within: a forward of one row over `layout`'s tokens."""
        self.layout = layout
        try:
            yield
        finally:
            self.layout = None

    @contextmanager
    def rows(self, deltas: Sequence[int]) -> Iterator[None]:
        """Within: a forward of rows, row r at its offset plus `deltas[r]`."""
        self.shifts = mx.array(list(deltas), dtype=mx.int32)
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
        if positions.layout is not None:
            cos, sin = self._rotary(x, positions.layout.table[:, None, :])
            # (mlx-vlm rotates queries and keys together; the unused second result is never
            # computed: MLX evaluates only what the model's output needs.)
            rotated, _ = self._apply(x, x, cos, sin, unqueeze_dim=1)
            return rotated.astype(x.dtype)
        if positions.shifts is not None:
            offset = offset + positions.shifts
        return self.rope(x, offset=offset)


def install(model: nn.Module, vlm: nn.Module) -> Positions:
    """Give every attention layer of the served `model` an `MRoPE` reading one `Positions`,
    with mlx-vlm's rotary embedding of the same layer, and the first layers Qwen3-VL's
    deepstack additions (as many as the vision tower hands features to); returns the
    `Positions` (also the model's `_orchard_positions`)."""
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
    stacked = getattr(vlm.config.vision_config, "deepstack_visual_indexes", None) or ()
    layers = model.model.layers
    for index in range(len(stacked)):
        layers[index] = _deepstacked(layers[index], index, positions)
    object.__setattr__(model, "_orchard_positions", positions)
    return positions


def _deepstacked(layer: nn.Module, index: int, positions: Positions) -> nn.Module:
    """`layer` (parameters shared) adding deepstack layer `index`'s features to its output at the
    placeholders of the prompt the forward runs over."""
    base = type(layer)

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = base.__call__(self, x, *args, **kwargs)
        layout = positions.layout
        if layout is None or not layout.visual:
            return out
        where = mx.array(layout.visual)
        return out.at[:, where].add(layout.deepstack[index].astype(out.dtype))

    cls = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})
    copy = cls.__new__(cls)
    dict.update(copy, layer)
    copy.__dict__.update(layer.__dict__)
    return copy


def rows(model: nn.Module, seqs: Sequence[Any]):
    """A context for a forward of `seqs`' rows (engine/core/request.py Sequence), each at its
    request's `rope_delta` (nothing to do on other models, or when every delta is 0)."""
    positions = getattr(model, "_orchard_positions", None)
    if positions is None:
        return nullcontext()
    deltas = [seq.request.rope_delta for seq in seqs]
    return positions.rows(deltas) if any(deltas) else nullcontext()


def prompt(model: nn.Module, layout: Layout | None):
    """A context for a forward of one row over `layout`'s tokens (None: plain)."""
    positions = getattr(model, "_orchard_positions", None)
    return nullcontext() if positions is None or layout is None else positions.prompt(layout)
