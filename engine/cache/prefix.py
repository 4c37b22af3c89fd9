"""The prefix cache: computed prompt state, reused by any later sequence that starts the same way.

A radix tree over token ids (SGLang's radix cache): each node holds the tokens of its edge and,
for every attention layer, the keys and values of those tokens; a hybrid model's recurrent
(ArraysCache) layers hold fixed-size state instead, which cannot be cut per token, so a node may
also carry a snapshot of that state *at its end*. A match walks the tree: on a dense model any
prefix is usable (a partial edge is sliced); on a hybrid model only a node end with a snapshot
is, so a prefix without one is a shorter hit or a miss, never a wrong one.

Scopes: every request names one (GenerationRequest.cache_scope) and each scope has a tree of its
own, so a request never reuses, nor times, state that another scope's requests computed: the
server gives callers that must not learn each other's prompts different scopes (tenants). The
trees share one byte budget and one least-recently-used order.

Memory: every byte is counted; the cache never holds more than its budget, evicting the least
recently used leaves that no running request holds (`lock`). Entries are copies, so a request
seeded from the cache shares nothing with it and eviction can never change a running request.

Disk: with a disk tier (engine/cache/disk/), what is evicted is spilled to files rather than
lost, a lookup that memory cannot serve in full reads the rest back from them, and `close`
spills what memory holds, so the next engine over the same folder (a restart, a reload) starts
with it. `clear` empties both tiers.

Pure bookkeeping over arrays handed in: it never runs a model, so it is tested without one.
Only the engine thread of one model uses an instance.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx

logger = logging.getLogger(__name__)
# How long `close` may spill what memory holds (the process may be shutting down).
CLOSE_SECONDS = 5.0

# Per layer, for a span of tokens: its arrays with tokens on axis 2 for an attention layer
# ((keys, values), or six with a quantized cache: engine/cache/mlx_caches.py), None for a
# recurrent one.
LayerKV = list[tuple[mx.array, ...] | None]
# Per layer: the recurrent state arrays for a recurrent layer, None for an attention layer.
LayerState = list[tuple[mx.array, ...] | None]
# Copies (start, end) of a sequence's keys and values out of the cache that computed them.
KVSource = Callable[[int, int], LayerKV]


def _nbytes(arrays) -> int:
    return sum(a.nbytes for layer in arrays if layer is not None for a in layer)


def _own(array: mx.array) -> mx.array:
    # A copy, never a view: a view would keep a running batch's whole buffer alive.
    return mx.contiguous(array)


def _settle(*groups) -> None:
    # Compute stored copies now: a lazy copy would keep its whole source alive until used.
    mx.async_eval([a for group in groups if group for layer in group if layer for a in layer])


def _slice(kv: LayerKV, start: int, end: int) -> LayerKV:
    return [
        None if layer is None else tuple(_own(a[..., start:end, :]) for a in layer) for layer in kv
    ]


@dataclass(eq=False)
class _Node:
    tokens: tuple[int, ...]
    kv: LayerKV
    parent: _Node | None = None
    children: dict[int, _Node] = field(default_factory=dict)
    state: LayerState | None = None  # recurrent state at this node's end (hybrid models)
    depth: int = 0  # tokens from the root to this node's end
    locks: int = 0
    last_used: int = 0
    removed: bool = False
    scope: str | None = None  # set on a scope's root (which holds no tokens)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.kv) + (_nbytes(self.state) if self.state else 0)


@dataclass(frozen=True)
class PrefixHit:
    """What a match found: the first `length` tokens' keys and values per attention layer and,
    on a hybrid model, the recurrent state after them. The arrays are taken at match time
    (lazily: nothing is computed until the request's cache is seeded), so later inserts and
    splits cannot change them; `node` is where the hit ends, for `lock`/`unlock`."""

    length: int
    kv: LayerKV = field(default_factory=list)
    state: LayerState | None = None
    node: _Node | None = None


MISS = PrefixHit(0)


def _gather(path: list[tuple[_Node, int]]) -> LayerKV:
    layers: LayerKV = []
    for index, first in enumerate(path[0][0].kv):
        if first is None:
            layers.append(None)
            continue
        parts = [(node.kv[index], take) for node, take in path]
        layers.append(
            tuple(
                mx.concatenate([kv[slot][..., :take, :] for kv, take in parts], axis=2)
                for slot in range(len(first))
            )
        )
    return layers


class DiskTierAPI(Protocol):
    """What the cache asks of its disk tier (engine/cache/disk/tier.py implements it)."""

    def spill(self, scope, tokens, spans, state, *, start, deadline=None) -> None: ...
    def extend(self, hit: PrefixHit, tokens, limit: int, scope: str) -> PrefixHit: ...
    def clear(self) -> int: ...
    def close(self, deadline: float | None = None) -> None: ...
    def stats(self) -> dict[str, int]: ...


@dataclass(frozen=True)
class PrefixCacheStats:
    """Both tiers: `hits` and `hit_tokens` count every hit (memory's, and those the disk tier
    extended: `disk_hits`, which added `disk_hit_tokens`); `disk_lookups` counts the lookups
    memory could not serve in full. All disk fields are 0 without a disk tier."""

    lookups: int = 0
    hits: int = 0
    hit_tokens: int = 0  # prompt tokens not recomputed thanks to the cache
    inserted_tokens: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    nodes: int = 0
    bytes: int = 0
    max_bytes: int = 0
    disk_entries: int = 0
    disk_bytes: int = 0
    disk_max_bytes: int = 0
    disk_lookups: int = 0
    disk_hits: int = 0
    disk_hit_tokens: int = 0
    disk_spills: int = 0  # files written
    disk_spill_bytes: int = 0
    disk_spills_dropped: int = 0  # entries not written: the writer's queue was full, or it stopped
    disk_evictions: int = 0
    disk_read_errors: int = 0  # files refused (corrupt, truncated, foreign) and deleted
    disk_write_errors: int = 0
    disk_spilling: int = 0  # 1 while spilling goes on (a write error stops it)

    def to_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class PrefixCache:
    """match / lock / unlock / insert / evict / clear, with byte accounting (module docstring).

    `hybrid`: the model has recurrent layers, so only node ends with a state snapshot can be
    resumed from."""

    def __init__(self, *, max_bytes: int, hybrid: bool = False, disk: DiskTierAPI | None = None):
        self.max_bytes = max_bytes
        self.hybrid = hybrid
        self.disk = disk
        self._roots: dict[str, _Node] = {}  # by scope; a scope's root goes with its last entry
        self._clock = itertools.count(1)
        # Eviction candidates, least recently used first: (last_used, tie, node) pushed when a
        # node may have become an unlocked leaf; stale entries are skipped when popped.
        self._leaves: list[tuple[int, int, _Node]] = []
        self._ties = itertools.count()
        self._bytes = 0
        self._nodes = 0
        self._counts = dict.fromkeys(
            ("lookups", "hits", "hit_tokens", "inserted_tokens", "evictions", "evicted_bytes"), 0
        )

    @property
    def nbytes(self) -> int:
        return self._bytes

    def stats(self) -> PrefixCacheStats:
        disk = self.disk.stats() if self.disk is not None else {}
        return PrefixCacheStats(
            **self._counts, nodes=self._nodes, bytes=self._bytes, max_bytes=self.max_bytes, **disk
        )

    def match(self, tokens: Sequence[int], *, limit: int, scope: str = "") -> PrefixHit:
        """The longest prefix of `tokens` cached in `scope` usable to resume from, at most
        `limit` tokens (a prompt resumes at most one token before its end: that token gives the
        first output): from memory, extended from disk where the disk tier holds more."""
        self._counts["lookups"] += 1
        limit = min(limit, len(tokens))
        hit = self._match(tokens, limit, scope)
        if self.disk is not None and hit.length < limit:
            hit = self.disk.extend(hit, tokens, limit, scope)
        if hit.length:
            self._counts["hits"] += 1
            self._counts["hit_tokens"] += hit.length
        return hit

    def _match(self, tokens: Sequence[int], limit: int, scope: str) -> PrefixHit:
        node = self._roots.get(scope)
        if node is None:
            return MISS
        position, path = 0, []
        resumable = (0, 0)  # (length, path entries) of the deepest usable point
        while position < limit:
            child = node.children.get(tokens[position])
            if child is None:
                break
            common = common_length(child.tokens, tokens, position, limit)
            if common < len(child.tokens):
                if not self.hybrid:
                    path.append((child, common))
                    resumable = (position + common, len(path))
                break
            path.append((child, common))
            position += common
            node = child
            if not self.hybrid or child.state is not None:
                resumable = (position, len(path))
        length, depth = resumable
        if not length:
            return MISS
        path = path[:depth]
        now = next(self._clock)
        for entry, _ in path:
            self._touch(entry, now)
        end = path[-1][0]
        return PrefixHit(length, _gather(path), end.state if self.hybrid else None, end)

    def lock(self, hit: PrefixHit) -> None:
        """Keep the hit's entries from eviction until `unlock` (while a request holds it)."""
        for node in _ancestors(hit.node):
            node.locks += 1

    def unlock(self, hit: PrefixHit) -> None:
        # Along the current ancestors: a split since `lock` put its upper half (which took
        # over the locks) on the path.
        for node in _ancestors(hit.node):
            node.locks -= 1
            if not node.locks:
                self._candidate(node)

    def insert(
        self,
        tokens: Sequence[int],
        source: KVSource,
        state: LayerState | None = None,
        *,
        scope: str = "",
    ) -> None:
        """Store the computed state of `tokens` in `scope`: `source(start, end)` copies the keys
        and values of the tokens the scope's tree does not hold yet; `state` is the recurrent
        state after the last token (hybrid models: required for the entry to be resumable)."""
        tokens = tuple(tokens)
        if not tokens or (self.hybrid and state is None):
            return
        node = self._roots.get(scope)
        if node is None:
            node = self._roots[scope] = _Node((), [], scope=scope)
        position = 0
        now = next(self._clock)
        while position < len(tokens):
            child = node.children.get(tokens[position])
            if child is None:
                break
            common = common_length(child.tokens, tokens, position, len(tokens))
            if common < len(child.tokens):
                if position + common < len(tokens) or state is not None:
                    child = self._split(child, common)
                else:
                    self._touch(child, now)
                    return  # already inside an edge: nothing new to keep
            self._touch(child, now)
            position += len(child.tokens)
            node = child
        if position < len(tokens):
            new = _Node(tokens[position:], source(position, len(tokens)), parent=node)
            _settle(new.kv)
            new.depth = len(tokens)
            self._touch(new, now)
            node.children[tokens[position]] = new
            self._add(new.nbytes, nodes=1)
            self._counts["inserted_tokens"] += len(new.tokens)
            node = new
        if state is not None:
            self._add(-_nbytes(node.state) if node.state else 0)
            node.state = [None if s is None else tuple(_own(a) for a in s) for s in state]
            _settle(node.state)
            self._add(_nbytes(node.state))
        self._fit(self.max_bytes)

    def evict(self, num_bytes: int) -> int:
        """Free at least `num_bytes` if unlocked entries allow; returns the bytes freed."""
        before = self._bytes
        self._fit(max(0, self._bytes - num_bytes))
        return before - self._bytes

    def clear(self) -> int:
        """Drop every entry no request holds, and the disk tier's entries; returns the bytes
        freed (memory's and disk's)."""
        disk, self.disk = self.disk, None  # nothing cleared is spilled
        try:
            freed = self.evict(self._bytes)
        finally:
            self.disk = disk
        return freed + (disk.clear() if disk is not None else 0)

    def close(self, seconds: float = CLOSE_SECONDS) -> None:
        """The engine ends: spill what memory holds to the disk tier (the most recently used
        first, for at most `seconds`) and stop its writer."""
        if self.disk is None:
            return
        deadline = time.monotonic() + seconds
        try:
            for node in sorted(self._walk(), key=lambda n: (-n.last_used, n.depth)):
                if time.monotonic() >= deadline:
                    break
                self._spill(node, deadline)
        except Exception:
            logger.exception("prefix cache: spilling at close failed")
        self.disk.close(deadline)

    def _spill(self, node: _Node, deadline: float | None = None) -> None:
        path = list(_ancestors(node))[::-1]
        tokens = tuple(itertools.chain.from_iterable(n.tokens for n in path))
        spans = [(n.depth - len(n.tokens), n.depth, n.kv) for n in path]
        start = node.depth - len(node.tokens)
        state = node.state if self.hybrid else None
        self.disk.spill(path[0].parent.scope, tokens, spans, state, start=start, deadline=deadline)

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut `node`'s edge after `at` tokens; return the new upper half."""
        parent = node.parent
        upper = _Node(node.tokens[:at], _slice(node.kv, 0, at), parent=parent)
        upper.depth = node.depth - len(node.tokens) + at
        upper.last_used, upper.locks = node.last_used, node.locks
        lower_kv = _slice(node.kv, at, len(node.tokens))
        _settle(upper.kv, lower_kv)
        self._add(upper.nbytes + _nbytes(lower_kv) - _nbytes(node.kv), nodes=1)
        node.tokens, node.kv, node.parent = node.tokens[at:], lower_kv, upper
        upper.children[node.tokens[0]] = node
        parent.children[upper.tokens[0]] = upper
        return upper

    def _fit(self, max_bytes: int) -> None:
        while self._bytes > max_bytes:
            victim = self._lru_leaf()
            if victim is None:
                return  # everything left is held by running requests
            self._remove(victim)

    def _touch(self, node: _Node, now: int) -> None:
        node.last_used = now
        self._candidate(node)

    def _candidate(self, node: _Node) -> None:
        if node.children or node.locks:
            return
        heapq.heappush(self._leaves, (node.last_used, next(self._ties), node))
        if len(self._leaves) > 4 * self._nodes + 64:  # mostly stale: start afresh
            self._leaves = [
                (n.last_used, next(self._ties), n)
                for n in self._walk()
                if not n.children and not n.locks
            ]
            heapq.heapify(self._leaves)

    def _lru_leaf(self) -> _Node | None:
        while self._leaves:
            last_used, _, node = self._leaves[0]
            if node.removed or node.children or node.locks or node.last_used != last_used:
                heapq.heappop(self._leaves)  # stale: touched, grown, held or gone since
                continue
            return node
        return None

    def _walk(self):
        stack = [node for root in self._roots.values() for node in root.children.values()]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            yield node

    def _remove(self, node: _Node) -> None:
        if self.disk is not None:
            try:
                self._spill(node)
            except Exception:  # the entry is lost to the disk tier, not to memory's accounting
                logger.exception("prefix cache: could not spill an evicted entry")
        freed = node.nbytes
        node.removed = True
        node.kv, node.state = [], None  # stale heap entries may still point at the node
        del node.parent.children[node.tokens[0]]
        self._add(-freed, nodes=-1)
        self._counts["evictions"] += 1
        self._counts["evicted_bytes"] += freed
        parent = node.parent
        if parent.scope is not None:  # a root
            if not parent.children:
                del self._roots[parent.scope]
            return
        # On a hybrid model, an internal node left without children or a snapshot can never be
        # resumed from: it goes too.
        if parent.children:
            return
        if self.hybrid and not parent.state and not parent.locks:
            self._remove(parent)
        else:
            self._candidate(parent)  # a leaf now

    def _add(self, num_bytes: int, *, nodes: int = 0) -> None:
        self._bytes += num_bytes
        self._nodes += nodes


def common_length(edge: tuple[int, ...], tokens: Sequence[int], start: int, end: int) -> int:
    """How many of `edge`'s tokens equal tokens[start:end] from the start."""
    limit = min(len(edge), end - start)
    count = 0
    while count < limit and edge[count] == tokens[start + count]:
        count += 1
    return count


def _ancestors(node: _Node | None):
    while node is not None and node.parent is not None:
        yield node
        node = node.parent
