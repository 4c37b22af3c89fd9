"""The prefix cache's disk tier: what memory evicts (and holds when its engine ends) is kept in
checked files under a folder, read back on a hit, and found again after a restart.

- keys.py: the names (a model's key from its weights and layout, a scope's folder, the
  chained hashes of token blocks);
- files.py: one entry's file (header, checksum, atomic writes);
- index.py: the entries in memory, per scope, least recently used first, within the budget;
- tier.py: DiskTier, the spill / read-back / clear / close the prefix cache calls.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from engine.cache.disk import keys
from engine.cache.disk.tier import BLOCK_TOKENS, DiskTier
from engine.protocol import ModelSpec

logger = logging.getLogger(__name__)

__all__ = ["DiskTier", "PrefixDiskConfig", "open_disk_tier"]


@dataclass(frozen=True)
class PrefixDiskConfig:
    """Where the disk tier keeps a worker's entries (a folder per model in `root`) and how many
    bytes per model (0: no disk tier)."""

    root: Path
    max_bytes: int
    block_tokens: int = BLOCK_TOKENS


def open_disk_tier(config: PrefixDiskConfig | None, spec: ModelSpec, layout) -> DiskTier | None:
    """The disk tier of a model's prefix cache, or None: none configured, no layout Orchard
    can slice, or no model files to fingerprint (so nothing stale could ever be told apart)."""
    if config is None or config.max_bytes <= 0 or layout is None:
        return None
    model = keys.model_key(spec.path, layout, config.block_tokens)
    if model is None:
        logger.info("prefix cache of %s: no disk tier (no model files at %s)", spec.name, spec.path)
        return None
    try:
        return DiskTier(
            Path(config.root) / keys.model_folder(spec.name),
            model,
            layout,
            max_bytes=config.max_bytes,
            block_tokens=config.block_tokens,
        )
    except Exception:  # the model serves without it rather than not at all
        logger.exception("prefix cache of %s: no disk tier", spec.name)
        return None
