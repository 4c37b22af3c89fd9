"""The memory budget a model's running sequences and its prefix cache share (no MLX: the
scheduler's admission policy reads it; engine/cache/memory.py sizes it for a loaded model)."""

from __future__ import annotations

from dataclasses import dataclass

# A batch cache grows in steps of this many tokens (mlx-lm's BatchKVCache.step).
CACHE_STEP_TOKENS = 256


@dataclass(frozen=True)
class MemoryBudget:
    """What the running sequences and the prefix cache may hold together, in bytes."""

    max_bytes: int
    bytes_per_token: int
    bytes_per_sequence: int = 0

    def need(self, num_rows: int, longest: int) -> int:
        length = -(-longest // CACHE_STEP_TOKENS) * CACHE_STEP_TOKENS
        return num_rows * (length * self.bytes_per_token + self.bytes_per_sequence)

    def max_tokens(self) -> int:
        """The most tokens one sequence can ever hold."""
        room = self.max_bytes - self.bytes_per_sequence
        return max(0, room // max(1, self.bytes_per_token) - CACHE_STEP_TOKENS)
