"""How much of the machine a model's engine may use for its caches, and the prefix cache in it.

The budget covers the running sequences' caches and the prefix cache together; the model's
weights are outside it. By default it is a share of the device's memory (Metal's recommended
working set, or the machine's RAM on CPU) less the weights; a model's registry entry can set it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine.cache import mlx_caches as caches
from engine.cache.budget import MemoryBudget
from engine.cache.cohorts import PAD_LIMIT
from engine.cache.disk import PrefixDiskConfig, open_disk_tier
from engine.cache.host import HostMemory
from engine.cache.mlx_caches import CacheLayout, KVQuant
from engine.cache.prefix import PrefixCache
from engine.protocol import ModelSpec, describe

DEVICE_SHARE = 0.6  # of the device's memory, for weights and caches together
MIN_BUDGET_BYTES = 256 << 20
PREFIX_CACHE_SHARE = 0.25  # of the budget, by default


def device_memory_bytes() -> int:
    info = mx.device_info()
    for key in ("max_recommended_working_set_size", "memory_size"):
        if info.get(key):
            return int(info[key])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def host_memory(
    *, share: float | None = None, max_bytes: int | None = None, cache_share: float = 0.5
) -> HostMemory:
    """The worker's memory budget: `max_bytes`, or `share` of the device's memory."""
    if max_bytes is None and share is not None:
        max_bytes = int(device_memory_bytes() * share)
    return HostMemory(max_bytes, cache_share=cache_share)


def weights_bytes(model: nn.Module | None) -> int:
    if model is None:  # a stand-in without weights (tests' fake engines)
        return 0
    return sum(array.nbytes for _, array in tree_flatten(model.parameters()))


def plan_memory(
    spec: ModelSpec,
    model: nn.Module,
    layout: CacheLayout | None,
    *,
    budget_bytes: int | None = None,
    pad_tokens: int | None = None,
) -> tuple[MemoryBudget | None, PrefixCache | None]:
    """The budget and prefix cache for a model (none without a cache layout Orchard can
    measure and slice): `budget_bytes` as the worker's memory budget granted it (engine/cache/
    host.py), else the spec's own, else a share of the device less the weights; `pad_tokens`:
    the batch's length cohorts' padding limit (None: one batch at its longest row)."""
    if layout is None:
        return None, None
    total = budget_bytes if budget_bytes is not None else spec.memory_budget_bytes
    if total is None:
        total = int(device_memory_bytes() * DEVICE_SHARE) - weights_bytes(model)
        total = max(total, MIN_BUDGET_BYTES)
    budget = MemoryBudget(
        total, layout.kv_bytes_per_token, layout.state_bytes_per_sequence, pad_tokens
    )
    cache_bytes = spec.prefix_cache_bytes
    if cache_bytes is None:
        cache_bytes = int(total * PREFIX_CACHE_SHARE)
    cache = PrefixCache(max_bytes=cache_bytes, hybrid=layout.hybrid) if cache_bytes else None
    return budget, cache


logger = logging.getLogger(__name__)

# Turns the batch's length cohorts off for every model (engine/cache/cohorts.py).
COMPACT_SWITCH = "ORCHARD_COMPACT_KV"


def cohort_padding(spec: ModelSpec, model: nn.Module, quant: KVQuant | None) -> int | None:
    """The padding limit of a batch's length cohorts (engine/cache/cohorts.py), where the model's
    attention reads them (a probe) and neither the spec nor ORCHARD_COMPACT_KV=0 turns them off;
    else None."""
    if not spec.compact_kv:
        return None
    if os.environ.get(COMPACT_SWITCH, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    try:
        caches.check_cohorts(model, quant)
    except ValueError as exc:
        logger.warning("%s keeps every batch row at its longest row's length: %s", spec.name, exc)
        return None
    return PAD_LIMIT


@dataclass
class CachePlan:
    """What a chat engine's caches are, decided once its model has loaded."""

    kv_quant: KVQuant | None
    layout: CacheLayout | None  # None: the cache cannot be probed, so no reuse
    weights_bytes: int
    cohort_pad: int | None
    memory: MemoryBudget | None
    prefix_cache: PrefixCache | None


def plan_caches(
    spec: ModelSpec,
    model: nn.Module,
    *,
    cache_bytes: int | None,
    prefix_disk: PrefixDiskConfig | None,
    cohorts: bool,
) -> CachePlan:
    """The model's cache layout, memory budget and prefix cache (with its disk tier)."""
    kv_quant = KVQuant(spec.kv_cache_bits, spec.kv_cache_group_size) if spec.kv_cache_bits else None
    if kv_quant is not None:
        caches.check_quant(model, kv_quant)  # else the load fails: why
    try:
        layout = caches.layout(model, kv_quant)
    except Exception as exc:  # a model whose cache cannot be probed serves without reuse
        logger.warning("no prefix cache for %s: %s", spec.name, describe(exc))
        layout = None
    cohort_pad = cohort_padding(spec, model, kv_quant) if cohorts and layout is not None else None
    memory, prefix_cache = plan_memory(
        spec, model, layout, budget_bytes=cache_bytes, pad_tokens=cohort_pad
    )
    if prefix_cache is not None:
        prefix_cache.disk = open_disk_tier(prefix_disk, spec, layout)
    return CachePlan(kv_quant, layout, weights_bytes(model), cohort_pad, memory, prefix_cache)
