"""The memory budget a model's running sequences and its prefix cache share (no MLX: the
scheduler's admission policy reads it; engine/cache/memory.py sizes it for a loaded model)."""

from __future__ import annotations

from dataclasses import dataclass

# A batch cache grows in steps of this many tokens (mlx-lm's BatchKVCache.step).
CACHE_STEP_TOKENS = 256


def length_groups(lengths: list[int], pad_limit: int) -> list[list[int]]:
    """Indices of `lengths` in groups whose lengths are within `pad_limit` of the group's
    longest: the fewest such groups, longest first (greedy over the sorted lengths)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and lengths[groups[-1][0]] - lengths[i] <= pad_limit:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


@dataclass(frozen=True)
class MemoryBudget:
    """What the running sequences and the prefix cache may hold together, in bytes.

    A batch's rows are counted as its cache holds them: with `pad_tokens` (length cohorts,
    engine/cache/cohorts.py) in groups of rows within that many tokens of one another, each
    group's rows at its longest row's length; without, every row at the longest's."""

    max_bytes: int
    bytes_per_token: int
    bytes_per_sequence: int = 0
    pad_tokens: int | None = None

    def need(self, lengths: list[int]) -> int:
        """Bytes for rows of `lengths` tokens (each row's longest, e.g. prompt + max_tokens)."""
        if not lengths:
            return 0
        if self.pad_tokens is None:
            groups = [lengths]
        else:
            groups = [[lengths[i] for i in g] for g in length_groups(lengths, self.pad_tokens)]
        tokens = sum(len(g) * -(-max(g) // CACHE_STEP_TOKENS) * CACHE_STEP_TOKENS for g in groups)
        return tokens * self.bytes_per_token + len(lengths) * self.bytes_per_sequence

    def max_tokens(self) -> int:
        """The most tokens one sequence can ever hold."""
        room = self.max_bytes - self.bytes_per_sequence
        return max(0, room // max(1, self.bytes_per_token) - CACHE_STEP_TOKENS)
