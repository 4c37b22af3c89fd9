"""A batch's attention cache in length cohorts: memory that follows each row's own length.

mlx-lm's batch cache (BatchKVCache, and Orchard's quantized form) left-pads every row to the
longest: one 2,000-token conversation beside fifteen of 200 costs sixteen of 2,000. Here each
attention layer of the decode batch is a `CohortKVCache`: a few mlx-lm batch caches, the
cohorts, each holding rows whose lengths are within `pad_limit` tokens of one another, so a
row's keys and values cost its own length plus at most `pad_limit` tokens of padding (and the
cohort's growth step). The model's forward stays one batched forward; only attention reads
each cohort apart (engine/kernels/grouped.py), fed `Grouped` keys, values and masks.

The batch's rows keep the runner's order (engine/core/runner.py never reorders; recurrent
layers and sampling are indexed by it): `where[r]` says which cohort, and which row in it,
batch row r is. Cohort decisions are pure functions of the layer's bookkeeping (each row's left
padding, mirrored in Python so deciding never waits for the device), the same in every layer,
so every layer of a batch keeps the same cohorts:
- rows joining (`extend`) go, as a group of about the same length, into the cohort that takes
  them with the least added padding within `pad_limit`, or become a new cohort;
- after rows leave (`filter`, which also trims padding no row needs any more), cohorts that
  now fit together within `pad_limit` merge;
- rolls that move rejected drafts into the padding (`prepare` / `finalize`) split a cohort
  whose padding grew past `pad_limit`.
The scheduler's memory budget counts a batch the same way (engine/cache/budget.py).

With one cohort every call is the mlx-lm cache's own: no extra work at all.
"""

from __future__ import annotations

import copy
from typing import Any

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache

from engine.cache.budget import CACHE_STEP_TOKENS, length_groups
from engine.kernels.grouped import Grouped

# Tokens of padding a row may carry in its cohort (the batch cache's growth step: the same
# order of waste as the step's rounding).
PAD_LIMIT = CACHE_STEP_TOKENS


def _padding(cache: Any) -> list[int]:
    return [int(p) for p in cache.left_padding.tolist()]


def _subset(cache: Any, rows: list[int]) -> Any:
    """A new batch cache of `rows` of `cache` (which is left as it is)."""
    part = copy.copy(cache)
    part.filter(rows)
    return part


class CohortKVCache:
    """One attention layer of the decode batch, in length cohorts (see the module's doc)."""

    def __init__(self, first: Any, pad_limit: int = PAD_LIMIT):
        self.pad_limit = pad_limit
        self.cohorts: list[Any] = []
        self.pads: list[list[int]] = []  # each cohort's rows' left padding, in its row order
        self.where: list[tuple[int, int]] = []  # batch row -> (cohort, row in the cohort)
        self._views: tuple | None = None
        self._offset: mx.array | None = None
        if hasattr(first, "bits"):  # quantized cohorts: attention reads them as such
            self.bits, self.group_size = first.bits, first.group_size
        self.extend(first)

    # What the model calls: a layer's forward.

    @property
    def offset(self) -> mx.array:
        """Each batch row's position (rotary embeddings), in the batch's row order."""
        if len(self.cohorts) == 1:
            return self.cohorts[0].offset
        if self._offset is None:
            offsets = mx.concatenate([cohort.offset for cohort in self.cohorts])
            order = self._index()[1]
            self._offset = offsets if order is None else offsets[order]
        return self._offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[Any, Any]:
        if len(self.cohorts) == 1:
            return self.cohorts[0].update_and_fetch(keys, values)
        rows, order = self._index()
        self._offset = None
        fetched = [
            cohort.update_and_fetch(keys[r], values[r])
            for cohort, r in zip(self.cohorts, rows, strict=True)
        ]
        return (
            Grouped([k for k, _ in fetched], rows, self.cohorts, order),
            Grouped([v for _, v in fetched], rows, self.cohorts, order),
        )

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        masks = [
            cohort.make_mask(N, return_array=return_array, window_size=window_size)
            for cohort in self.cohorts
        ]
        if len(masks) == 1:
            return masks[0]
        rows, order = self._index()
        return Grouped(masks, rows, self.cohorts, order)

    # What the runner calls: rows joining and leaving, drafts rejected.

    def extend(self, other: Any) -> None:
        """Rows of `other` (a batch cache) join after the batch's last row, by length group."""
        pads = _padding(other)
        width = other._idx
        groups = length_groups([width - p for p in pads], self.pad_limit)
        if len(groups) == 1:
            groups = [list(range(len(pads)))]  # the rows stay in their order
        first_row = len(self.where)
        self.where.extend([(-1, -1)] * len(pads))
        for group in groups:
            part = other if len(groups) == 1 else _subset(other, group)
            part_pads = pads if len(groups) == 1 else _padding(part)
            target = self._best_fit(part._idx, part_pads)
            if target is None:
                self.cohorts.append(part)
                self.pads.append(part_pads)
                target, start = len(self.cohorts) - 1, 0
            else:
                start = len(self.pads[target])
                self._join(target, part, part_pads)
            for j, i in enumerate(group):
                self.where[first_row + i] = (target, start + j)
        self._changed()

    def filter(self, batch_indices: list[int]) -> None:
        """Keep batch rows `batch_indices`, in that order; then merge cohorts that now fit."""
        kept: list[list[int]] = [[] for _ in self.cohorts]
        where = []
        for r in batch_indices:
            c, j = self.where[r]
            where.append((c, len(kept[c])))
            kept[c].append(j)
        renumber, cohorts, pads = {}, [], []
        for c, rows in enumerate(kept):
            if not rows:
                continue
            renumber[c] = len(cohorts)
            cohort = self.cohorts[c]
            row_pads = [self.pads[c][j] for j in rows]
            if rows != list(range(len(self.pads[c]))):
                cohort.filter(rows)
                trimmed = min(row_pads)  # the batch cache drops padding every row has
                row_pads = [p - trimmed for p in row_pads]
            cohorts.append(cohort)
            pads.append(row_pads)
        self.cohorts, self.pads = cohorts, pads
        self.where = [(renumber[c], j) for c, j in where]
        self._merge_fitting()
        self._changed()

    def trim(self, n: int) -> int:
        trimmed = [cohort.trim(n) for cohort in self.cohorts]
        self._changed()
        return min(trimmed)

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """Only rolls of the decode batch's rows (rejected drafts into the padding)."""
        if left_padding is not None or lengths is not None:
            raise ValueError("a decode batch's cohorts take right padding only")
        self._rolls = self._by_cohort(list(right_padding)) if right_padding is not None else None
        if self._rolls is not None:
            for cohort, roll in zip(self.cohorts, self._rolls, strict=True):
                cohort.prepare(right_padding=roll)

    def finalize(self) -> None:
        rolls, self._rolls = getattr(self, "_rolls", None), None
        for cohort in self.cohorts:
            cohort.finalize()
        if rolls is None:
            return
        self.pads = [
            [p + roll for p, roll in zip(pads, rolled, strict=True)]
            for pads, rolled in zip(self.pads, rolls, strict=True)
        ]
        self._split_overpadded()
        self._changed()

    # What the rest of the engine reads.

    def locate(self, row: int) -> tuple[Any, int]:
        """Batch row `row`'s cohort and its row in it."""
        c, j = self.where[row]
        return self.cohorts[c], j

    def extract(self, idx: int) -> Any:
        cohort, j = self.locate(idx)
        return cohort.extract(j)

    @property
    def state(self) -> tuple:
        return tuple(cohort.state for cohort in self.cohorts)

    @property
    def nbytes(self) -> int:
        return sum(cohort.nbytes for cohort in self.cohorts)

    @property
    def num_cohorts(self) -> int:
        return len(self.cohorts)

    def size(self) -> int:
        return max(cohort._idx for cohort in self.cohorts)

    def empty(self) -> bool:
        return all(cohort.empty() for cohort in self.cohorts)

    def is_trimmable(self) -> bool:
        return True

    # Bookkeeping.

    def _fit(self, c: int, width: int, pads: list[int]) -> int | None:
        """Padding tokens added if rows of `width` and `pads` joined cohort `c`; None when a
        row would then carry more than `pad_limit`."""
        mine = self.cohorts[c]._idx
        top = max(mine, width)
        if max(self.pads[c]) + top - mine > self.pad_limit:
            return None
        if max(pads) + top - width > self.pad_limit:
            return None
        return len(self.pads[c]) * (top - mine) + len(pads) * (top - width)

    def _best_fit(self, width: int, pads: list[int]) -> int | None:
        fits = [
            (cost, c)
            for c in range(len(self.cohorts))
            if (cost := self._fit(c, width, pads)) is not None
        ]
        return min(fits)[1] if fits else None

    def _join(self, c: int, part: Any, part_pads: list[int]) -> None:
        mine = self.cohorts[c]._idx
        top = max(mine, part._idx)
        self.cohorts[c].extend(part)
        self.pads[c] = [p + top - mine for p in self.pads[c]] + [
            p + top - part._idx for p in part_pads
        ]

    def _merge_fitting(self) -> None:
        """Merge the pair of cohorts that fits with the least added padding, while one does."""
        while len(self.cohorts) > 1:
            fits = [
                (cost, a, b)
                for a in range(len(self.cohorts))
                for b in range(a + 1, len(self.cohorts))
                if (cost := self._fit(a, self.cohorts[b]._idx, self.pads[b])) is not None
            ]
            if not fits:
                return
            _, a, b = min(fits)
            count = len(self.pads[a])
            self._join(a, self.cohorts[b], self.pads[b])
            del self.cohorts[b], self.pads[b]
            self.where = [(a, count + j) if c == b else (c - (c > b), j) for c, j in self.where]

    def _split_overpadded(self) -> None:
        """Cohorts with a row padded past `pad_limit` (drafts rejected) become cohorts that
        each keep within it."""
        c = 0
        while c < len(self.cohorts):
            pads = self.pads[c]
            if max(pads) <= self.pad_limit:
                c += 1
                continue
            cohort = self.cohorts[c]
            groups = length_groups([cohort._idx - p for p in pads], self.pad_limit)
            parts = [_subset(cohort, group) for group in groups]
            moved = {}
            for g, (group, part) in enumerate(zip(groups, parts, strict=True)):
                target = c if g == 0 else len(self.cohorts)
                if g == 0:
                    self.cohorts[c], self.pads[c] = part, _padding(part)
                else:
                    self.cohorts.append(part)
                    self.pads.append(_padding(part))
                for k, j in enumerate(group):
                    moved[j] = (target, k)
            self.where = [moved[j] if cc == c else (cc, j) for cc, j in self.where]
            c += 1

    def _by_cohort(self, values: list[int]) -> list[list[int]]:
        out = [[0] * len(pads) for pads in self.pads]
        for r, (c, j) in enumerate(self.where):
            out[c][j] = values[r]
        return out

    def _changed(self) -> None:
        self._views = None
        self._offset = None

    def _index(self) -> tuple[list[Any], mx.array | None]:
        """Per cohort, the batch rows it holds (a slice where consecutive); and where each
        batch row is among the cohorts' rows concatenated (None: already in order)."""
        if self._views is None:
            members: list[list[int]] = [[0] * len(pads) for pads in self.pads]
            starts, start = [], 0
            for pads in self.pads:
                starts.append(start)
                start += len(pads)
            for r, (c, j) in enumerate(self.where):
                members[c][j] = r
            rows = [
                slice(m[0], m[-1] + 1) if m == list(range(m[0], m[-1] + 1)) else mx.array(m)
                for m in members
            ]
            concatenated = [starts[c] + j for c, j in self.where]
            in_order = concatenated == list(range(len(concatenated)))
            self._views = (rows, None if in_order else mx.array(concatenated))
        return self._views


def wrap(cache: list[Any], pad_limit: int = PAD_LIMIT) -> list[Any]:
    """A batch cache (a model's layers) with its attention layers in length cohorts."""
    return [
        CohortKVCache(layer, pad_limit) if isinstance(layer, BatchKVCache) else layer
        for layer in cache
    ]
