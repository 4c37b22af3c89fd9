"""One memory budget for every model a worker serves (no MLX: plain bookkeeping).

Each engine holds a reservation while it lives: its weights (estimated from the model's files
before the load, measured after it) and its caches' budget (the running sequences' KV and the
prefix cache; an embedding model's forward workspace), fixed when the load starts. A load goes
ahead only if its reservation fits beside the others; the worker makes room by unloading idle,
unpinned models, least recently used first (`HostMemory.victims`), and refuses the load when
even that is not enough, so the models never together ask for more than the budget.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from engine.protocol import ModelSpec

# What a model's caches get by default: at most this share of the budget (the rest is left for
# other models), and never less than MIN_CACHE_BYTES (below that a model is not worth loading).
DEFAULT_CACHE_SHARE = 0.5
MIN_CACHE_BYTES = 256 << 20
# An embedding model has no caches; its forwards' activations (EMBED_BATCH_TOKENS tokens a
# forward) need room of this order.
EMBEDDING_WORKSPACE_BYTES = 256 << 20
WEIGHT_SUFFIXES = (".safetensors", ".npz", ".gguf", ".bin")


def files_bytes(path: str | None) -> int:
    """The bytes of a model folder's weight files (what loading it puts in memory)."""
    if not path:
        return 0
    folder = Path(path)
    if folder.is_file():
        return folder.stat().st_size
    try:
        files = list(folder.iterdir())
    except OSError:
        return 0
    sizes = [f.stat().st_size for f in files if f.suffix in WEIGHT_SUFFIXES and f.is_file()]
    # A folder with safetensors loads those only; .bin beside them are a transformers copy.
    safetensors = [f.stat().st_size for f in files if f.suffix == ".safetensors" and f.is_file()]
    return sum(safetensors) if safetensors else sum(sizes)


def weights_estimate(spec: ModelSpec) -> int:
    return files_bytes(spec.path) + files_bytes(spec.draft_path)


@dataclass
class Reservation:
    name: str
    weights_bytes: int
    cache_bytes: int | None  # None: no host budget, the engine sizes its caches itself

    @property
    def total(self) -> int:
        return self.weights_bytes + (self.cache_bytes or 0)


class HostMemory:
    """The reservations of a worker's engines against `max_bytes` (None: no budget, every
    load goes ahead and each model sizes its own caches as a share of the device)."""

    def __init__(self, max_bytes: int | None = None, *, cache_share: float = DEFAULT_CACHE_SHARE):
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError("the memory budget must be positive")
        if not 0 < cache_share <= 1:
            raise ValueError("the cache share must be in (0, 1]")
        self.max_bytes = max_bytes
        self.cache_share = cache_share
        self._held: dict[int, Reservation] = {}  # id(engine) -> its reservation
        self._lock = threading.Lock()

    @property
    def limited(self) -> bool:
        return self.max_bytes is not None

    def used(self) -> int:
        with self._lock:
            return sum(r.total for r in self._held.values())

    def by_name(self) -> dict[str, int]:
        """Bytes held per model name (an old and a new engine of one name add up)."""
        with self._lock:
            held: dict[str, int] = {}
            for reservation in self._held.values():
                held[reservation.name] = held.get(reservation.name, 0) + reservation.total
            return held

    def held(self, engine: object) -> Reservation | None:
        with self._lock:
            return self._held.get(id(engine))

    def wanted(self, spec: ModelSpec) -> tuple[int, int]:
        """(weights, caches) a load of `spec` would like to hold (caches: its own setting, or
        the default share of the budget)."""
        weights = weights_estimate(spec)
        if spec.kind == "embedding":
            return weights, EMBEDDING_WORKSPACE_BYTES
        if spec.memory_budget_bytes is not None:
            return weights, spec.memory_budget_bytes
        assert self.max_bytes is not None
        return weights, max(MIN_CACHE_BYTES, int(self.max_bytes * self.cache_share))

    def least(self, spec: ModelSpec) -> int:
        """The fewest bytes a load of `spec` can go ahead with."""
        weights, cache = self.wanted(spec)
        flexible = spec.kind != "embedding" and spec.memory_budget_bytes is None
        return weights + (MIN_CACHE_BYTES if flexible else cache)

    def reserve(
        self, engine: object, spec: ModelSpec, *, replacing: object | None = None
    ) -> Reservation | None:
        """Hold room for `engine` (loading `spec`): what it wants, or what is left if that is
        less and still enough; None (nothing held) if it does not fit. A new version of a
        loaded model (`replacing` its engine) takes over that engine's caches' budget: the old
        one keeps only its weights while it drains."""
        with self._lock:
            old = self._held.get(id(replacing)) if replacing is not None else None
            transferred = (old.cache_bytes or 0) if old is not None else 0
            if self.max_bytes is None:
                reservation = Reservation(spec.name, weights_estimate(spec), None)
                if spec.kind == "chat" and spec.memory_budget_bytes is not None:
                    reservation.cache_bytes = spec.memory_budget_bytes
                self._held[id(engine)] = reservation
                return reservation
            free = self.max_bytes - sum(r.total for r in self._held.values()) + transferred
            weights, cache = self.wanted(spec)
            if weights + cache > free:
                if self.least(spec) > free:
                    return None
                cache = free - weights  # a flexible cache takes what is left
            if old is not None:
                old.cache_bytes = 0
            reservation = Reservation(spec.name, weights, cache)
            self._held[id(engine)] = reservation
            return reservation

    def measured(self, engine: object, weights_bytes: int) -> None:
        """The engine's weights as loaded (the files were an estimate)."""
        with self._lock:
            reservation = self._held.get(id(engine))
            if reservation is not None and weights_bytes > 0:
                reservation.weights_bytes = weights_bytes

    def release(self, engine: object) -> None:
        with self._lock:
            self._held.pop(id(engine), None)

    def shortfall(self, spec: ModelSpec) -> int:
        """Bytes to free before `spec` can load as it wants (0: it fits now)."""
        if self.max_bytes is None:
            return 0
        weights, cache = self.wanted(spec)
        return max(0, weights + cache - (self.max_bytes - self.used()))

    def victims(self, spec: ModelSpec, candidates: list[tuple[object, float]]) -> list[object]:
        """The engines to unload, from `candidates` ((engine, last used) of idle, unpinned
        models), least recently used first, so that `spec` loads as it wants (or, failing
        that, at least with its least); [] if it fits already or cannot fit even with all."""
        if self.max_bytes is None:
            return []
        with self._lock:
            free = self.max_bytes - sum(r.total for r in self._held.values())
            held = dict(self._held)
        weights, cache = self.wanted(spec)
        if weights + cache <= free:
            return []
        chosen: list[object] = []
        for engine, _ in sorted(candidates, key=lambda c: c[1]):
            if weights + cache <= free:
                break
            reservation = held.get(id(engine))
            if reservation is None:
                continue
            chosen.append(engine)
            free += reservation.total
        return chosen if self.least(spec) <= free else []
