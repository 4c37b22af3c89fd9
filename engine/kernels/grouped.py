"""Attention over a batch whose rows are kept in groups of their own lengths.

A batch's attention caches may hold their rows in several groups (engine/cache/cohorts.py:
cohorts of rows of about the same length, so a short row never pays for a long one's keys).
The model still computes its projections, MLP and norms for the whole batch in one forward;
only attention reads each group's keys apart. The cache hands the model `Grouped` keys, values
and masks (one part per group, with the batch rows of each), and `grouped(inner)`, which
replaces mlx-lm's `scaled_dot_product_attention` in the model's modules (engine/kernels/
fast.py `install`), runs `inner` once per group on that group's queries and puts the outputs
back in the batch's row order. Anything else passes straight to `inner`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx


class Grouped(tuple):
    """One part per group (keys, values or a mask), with what attention needs to read them:
    `rows[i]`: the batch rows of group i, in the group's own row order (a slice where they
    are consecutive); `caches[i]`: the group's cache (a quantized one carries `bits`);
    `order`: where each batch row's output is in the groups' outputs concatenated, or None
    where that is already the batch's order."""

    rows: Sequence[Any]
    caches: Sequence[Any]
    order: mx.array | None

    def __new__(
        cls,
        parts: Sequence[Any],
        rows: Sequence[Any],
        caches: Sequence[Any],
        order: mx.array | None,
    ) -> Grouped:
        grouped = super().__new__(cls, parts)
        grouped.rows, grouped.caches, grouped.order = rows, caches, order
        return grouped


def grouped(inner: Callable[..., mx.array]) -> Callable[..., mx.array]:
    """mlx-lm's attention signature, reading `Grouped` keys and values one group at a time."""

    @functools.wraps(inner)
    def attention(queries, keys, values, cache, scale, mask, sinks=None) -> mx.array:
        if not isinstance(keys, Grouped):
            return inner(queries, keys, values, cache, scale=scale, mask=mask, sinks=sinks)
        outputs = [
            inner(
                queries[rows],
                keys[i],
                values[i],
                keys.caches[i],
                scale=scale,
                mask=mask[i] if isinstance(mask, Grouped) else mask,
                sinks=sinks,
            )
            for i, rows in enumerate(keys.rows)
        ]
        output = mx.concatenate(outputs, axis=0)
        return output if keys.order is None else output[keys.order]

    attention.orchard_grouped = True
    return attention
