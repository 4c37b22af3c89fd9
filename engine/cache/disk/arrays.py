"""Between MLX arrays and an entry's bytes, on the engine thread: raw views of cached arrays to
write (no copy: the writer thread reads them while the views keep the arrays alive), arrays made
from a file's payload, and the check that a header's arrays are the model's layout."""

from __future__ import annotations

from collections.abc import Sequence

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import numpy as np

from engine.cache.disk.files import ITEM_BYTES, ArraySpec, BadEntry, Header
from engine.cache.prefix import LayerKV, LayerState

_TRANSPORT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
# Per cached node: (first position, end position, per-layer keys and values).
Spans = Sequence[tuple[int, int, LayerKV]]


def entry_arrays(
    layout,
    spans: Spans,
    first: int,
    count: int,
    state: LayerState | None = None,
) -> tuple[list[ArraySpec], list[list[np.ndarray]]]:
    """The arrays of the entry of `count` tokens from position `first`: every attention layer's
    keys and values, cut from the spans that hold them (a list of pieces per array, in token
    order), then `state`'s arrays."""
    last = first + count
    specs, pieces = [], []
    for layer, kind in enumerate(layout.kinds):
        if kind != "kv":
            continue
        for slot in range(layout.kv_slots):
            views = []
            for begin, end, kv in spans:
                array = kv[layer][slot]
                if begin < last and end > first:
                    raw = _raw(array)
                    views.append(raw[:, :, max(first, begin) - begin : min(last, end) - begin])
            batch, heads, _, dim = array.shape
            specs.append(ArraySpec(layer, "kv", slot, _dtype(array), (batch, heads, count, dim)))
            pieces.append(views)
    for layer, arrays in enumerate(state or ()):
        for slot, array in enumerate(arrays or ()):
            specs.append(ArraySpec(layer, "state", slot, _dtype(array), tuple(array.shape)))
            pieces.append([_raw(array)])
    return specs, pieces


def read_arrays(header: Header, payload: memoryview, num_layers: int) -> tuple[LayerKV, LayerState]:
    """A checked entry's keys and values per layer, and its recurrent state per layer."""
    arrays: dict[tuple[str, int], dict[int, mx.array]] = {}
    offset = 0
    for spec in header.arrays:
        size = ITEM_BYTES[spec.dtype]
        count = spec.nbytes // size
        raw = np.frombuffer(payload, dtype=_TRANSPORT[size], count=count, offset=offset)
        array = mx.array(raw.reshape(spec.shape)).view(getattr(mx, spec.dtype))
        arrays.setdefault((spec.part, spec.layer), {})[spec.slot] = array
        offset += spec.nbytes

    def layers(part: str) -> list:
        found = [arrays.get((part, layer)) for layer in range(num_layers)]
        return [None if f is None else tuple(f[slot] for slot in sorted(f)) for f in found]

    return layers("kv"), layers("state")


def check_arrays(header: Header, layout, *, with_state: bool) -> None:
    """That `header`'s arrays are `layout`'s for its tokens: every attention layer's keys and
    values at the model's bytes per token, and, `with_state`, the recurrent layers' state at
    the model's bytes per sequence (without, none). BadEntry if not."""
    count = len(header.tokens)
    kinds = layout.kinds
    kv = [a for a in header.arrays if a.part == "kv"]
    state = [a for a in header.arrays if a.part == "state"]
    slots = {(a.layer, a.part, a.slot) for a in header.arrays}
    want = {
        (i, "kv", s) for i, kind in enumerate(kinds) if kind == "kv" for s in range(layout.kv_slots)
    }
    if (
        len(slots) != len(header.arrays)
        or {(a.layer, a.part, a.slot) for a in kv} != want
        or any(len(a.shape) != 4 or a.shape[2] != count for a in kv)
        or sum(a.nbytes for a in kv) != count * layout.kv_bytes_per_token
        or len(kv) + len(state) != len(header.arrays)
        or any(a.layer >= len(kinds) or kinds[a.layer] != "state" for a in state)
    ):
        raise BadEntry("arrays that are not this model's")
    if with_state != bool(state) or (
        state and sum(a.nbytes for a in state) != layout.state_bytes_per_sequence
    ):
        raise BadEntry("recurrent state that is not this model's")


def _dtype(array: mx.array) -> str:
    return str(array.dtype).rsplit(".", 1)[-1]


def _raw(array: mx.array) -> np.ndarray:
    """The array's bytes without a copy, shaped as the array with its last axis in bytes."""
    view = memoryview(array)
    if not view.c_contiguous:
        array = mx.contiguous(array)
        view = memoryview(array)
    flat = np.frombuffer(view.cast("B"), dtype=np.uint8)
    if not array.ndim:
        return flat
    return flat.reshape(*array.shape[:-1], array.shape[-1] * array.itemsize)
