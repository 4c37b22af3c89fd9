"""DiskTier: the prefix cache's second tier, files under ORCHARD_HOME/prefix-cache.

What the memory tier evicts is spilled here: the engine thread hands over the evicted entry's
arrays (views of arrays already computed, no copy) and a writer thread writes them
(engine/cache/disk/store.py), so the engine thread never waits on the disk for a spill; what
does not fit in the writer's queue is dropped, not waited for. A lookup that memory cannot serve
in full reads the longest prefix the tier holds back (on the request's admission, on the engine
thread) and seeds the request as a memory hit would; memory keeps serving the part it holds.

Layout: `<root>/<model name>/<model key>/<scope hash>/<entry key>.kv`. Entries are blocks of
`block_tokens` tokens (every attention layer's keys and values), keyed by a chained hash of the
token ids from the scope's root (engine/cache/disk/keys.py), and ends: the tokens after the last
whole block where a cached sequence ended, with a hybrid model's recurrent state there. A lookup
in one scope only ever touches its own scope's index entries and files. Every file read is
checked (engine/cache/disk/files.py): a bad one is a miss, is deleted, and is counted.

At start the index is rebuilt from the files' headers (checked against the model and the scope
folder they sit in); a model's entries of earlier weights (another key) are deleted. The bytes
are bounded per model and shared fairly between scopes (engine/cache/disk/index.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx

from engine.cache.disk import files, keys
from engine.cache.disk.arrays import Spans, check_arrays, entry_arrays, read_arrays
from engine.cache.disk.files import BadEntry, Header
from engine.cache.disk.index import DiskEntry
from engine.cache.disk.store import DiskStore, Out, entry_key
from engine.cache.prefix import LayerKV, LayerState, PrefixHit, common_length

logger = logging.getLogger(__name__)

BLOCK_TOKENS = 128
# Bytes of spilled arrays waiting for the writer at most (held in memory until written).
MAX_PENDING_BYTES = 256 << 20
# Bytes one lookup reads at most: the model's running streams wait for the read (about 0.4 s at
# 1.3 GB/s), so one team's long context cannot stall the others for longer; the rest of such a
# prompt is computed, in chunks like any prefill.
MAX_READ_BYTES = 512 << 20


@dataclass(frozen=True)
class _Plan:
    length: int
    entries: list[DiskEntry]
    used: int  # tokens of the last entry used (a dense model may use a part of it)
    memory: int  # tokens taken from memory's hit


class DiskTier:
    """spill / extend / clear / flush / close / stats over one model's folder (module docstring).
    Made and used on the model's engine thread."""

    def __init__(
        self,
        folder: Path,
        model: str,
        layout,
        *,
        max_bytes: int,
        block_tokens: int = BLOCK_TOKENS,
        max_pending_bytes: int = MAX_PENDING_BYTES,
        max_read_bytes: int = MAX_READ_BYTES,
    ):
        self.model = model
        self.layout = layout
        self.hybrid = layout.hybrid
        self.block_tokens = block_tokens
        self.max_read_bytes = max_read_bytes
        self.store = DiskStore(
            folder,
            model,
            layout,
            block_tokens=block_tokens,
            max_bytes=max_bytes,
            max_pending_bytes=max_pending_bytes,
        )

    @property
    def folder(self) -> Path:
        return self.store.folder

    def stats(self) -> dict[str, int]:
        index = self.store.index
        return {
            **{f"disk_{name}": value for name, value in self.store.counts().items()},
            "disk_entries": index.num_entries,
            "disk_bytes": index.nbytes,
            "disk_max_bytes": index.max_bytes,
            "disk_spilling": int(self.store.spilling),
        }

    def spill(
        self,
        scope: str,
        tokens: Sequence[int],
        spans: Spans,
        state: LayerState | None,
        *,
        start: int,
        deadline: float | None = None,
    ) -> None:
        """Queue for writing what keeps the computed state of `tokens` (a cached node's tokens
        from the root) that the tier lacks: the whole blocks from the one holding `start` (the
        node's first token) on, and an end entry for the tokens after the last whole block (on
        a hybrid model only with `state`, the recurrent state after `tokens`). `spans`: the
        nodes from the root on. A full queue drops them unless `deadline` (monotonic) says how
        long to wait."""
        store = self.store
        store.release_spent()
        if not store.spilling or store.closed:
            return
        size = self.block_tokens
        whole = len(tokens) // size
        chain = keys.chain(self.model, scope, tokens, size, whole)
        outs = []
        for index in range(start // size, whole):
            if not store.known(scope, chain[index + 1]):
                span = tuple(tokens[index * size : (index + 1) * size])
                outs.append(self._out(scope, "block", chain[index], index * size, span, spans))
        tail = tuple(tokens[whole * size :])
        if state is not None if self.hybrid else tail:
            if not store.known(scope, keys.child_key(chain[whole], keys.END, tail)):
                outs.append(self._out(scope, "end", chain[whole], whole * size, tail, spans, state))
        if outs:
            store.enqueue(outs, deadline)

    def extend(self, hit: PrefixHit, tokens: Sequence[int], limit: int, scope: str) -> PrefixHit:
        """`hit` (memory's, for at most `limit` tokens of `tokens` in `scope`), or a longer hit
        read from disk: memory's keys and values up to a block boundary, then the files'."""
        self.store.release_spent()
        self.store.count("lookups")
        try:
            return self._extend(hit, tokens, limit, scope)
        except Exception:  # whatever went wrong, the request goes on with memory's hit
            logger.exception("prefix cache: a disk lookup failed")
            return hit

    def _extend(self, hit: PrefixHit, tokens: Sequence[int], limit: int, scope: str) -> PrefixHit:
        store = self.store
        plan = self._plan(tokens, limit, scope, hit.length)
        if plan is None:
            return hit
        parts: list[tuple[LayerKV, LayerState]] = []
        for index, entry in enumerate(plan.entries):
            try:
                parts.append(self._read(entry, scope))
            except Exception as exc:  # a file that is not what its name says is a miss
                store.bad(entry.path, exc, entry)
                # On a dense model the blocks read before it still make a (shorter) hit.
                if self.hybrid or entry.start <= hit.length:
                    return hit
                entries = plan.entries[:index]
                plan = _Plan(entry.start, entries, self.block_tokens, plan.memory)
                break
        kv: LayerKV = []
        for layer, kind in enumerate(self.layout.kinds):
            if kind != "kv":
                kv.append(None)
                continue
            pieces = [part[0][layer] for part in parts[:-1]]
            last = parts[-1][0][layer]
            pieces.append(tuple(a[..., : plan.used, :] for a in last))
            if plan.memory:
                pieces.insert(0, tuple(a[..., : plan.memory, :] for a in hit.kv[layer]))
            pieces = [piece for piece in pieces if piece[0].shape[2]]
            slots = range(len(pieces[0]))
            kv.append(tuple(mx.concatenate([p[i] for p in pieces], axis=2) for i in slots))
        store.touch(plan.entries[::-1])  # the shallower, the more recently used
        store.count("hits")
        store.count("hit_tokens", plan.length - hit.length)
        state = parts[-1][1] if self.hybrid else None
        return PrefixHit(plan.length, kv, state, hit.node)

    def clear(self) -> int:
        """Drop every entry (their files go on the writer thread); returns their bytes."""
        self.store.release_spent()
        return self.store.clear()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until what is queued now is written; False if `timeout` passed first."""
        return self.store.flush(timeout)

    def close(self, deadline: float | None = None) -> None:
        """Write what is queued (until `deadline`, monotonic) and stop the writer."""
        self.store.close(deadline)

    def _out(self, scope, kind, parent, first, tokens, spans, state=None) -> Out:
        specs, pieces = entry_arrays(self.layout, spans, first, len(tokens), state)
        key = entry_key(parent, kind, tokens)
        header = Header(self.model, scope, kind, key, parent, first, tokens, tuple(specs))
        return Out(header, pieces)

    def _plan(self, tokens: Sequence[int], limit: int, scope: str, memory: int) -> _Plan | None:
        """The longest prefix (more than memory's `memory` tokens) the index can give within
        `max_read_bytes`: whole blocks from the one memory's hit ends in, then on a dense model
        the part of any child entry that matches, on a hybrid one an end entry (with its state)
        matched in full."""
        size, index = self.block_tokens, self.store.index
        first = memory // size
        key = keys.chain(self.model, scope, tokens, size, first)[-1]
        position, entries, nbytes = first * size, [], 0
        best: _Plan | None = None
        while True:
            if self.hybrid:
                for child in index.children(scope, key):
                    count = len(child.tokens)
                    if (
                        child.kind == "end"
                        and child.has_state
                        and position + count <= limit
                        and nbytes + child.nbytes <= self.max_read_bytes
                        and common_length(child.tokens, tokens, position, limit) == count
                        and (best is None or position + count > best.length)
                    ):
                        best = _Plan(position + count, [*entries, child], count, first * size)
            if position + size > limit:
                break
            span = tokens[position : position + size]
            block = index.get(scope, keys.child_key(key, keys.BLOCK, span))
            if block is None or nbytes + block.nbytes > self.max_read_bytes:
                break
            entries.append(block)
            key, position, nbytes = block.key, position + size, nbytes + block.nbytes
        if not self.hybrid:
            if entries:
                best = _Plan(position, entries, size, first * size)
            for child in index.children(scope, key):
                common = common_length(child.tokens, tokens, position, limit)
                fits = nbytes + child.nbytes <= self.max_read_bytes
                if fits and common and position + common > (best.length if best else 0):
                    best = _Plan(position + common, [*entries, child], common, first * size)
        return best if best is not None and best.length > memory else None

    def _read(self, entry: DiskEntry, scope: str) -> tuple[LayerKV, LayerState]:
        header, payload = files.read_entry(entry.path)
        expected = (self.model, scope, entry.kind, entry.key, entry.parent, entry.start)
        found = (header.model, header.scope, header.kind, header.key, header.parent, header.start)
        if found != expected or header.tokens != entry.tokens:
            raise BadEntry("the file holds another entry")
        check_arrays(header, self.layout, with_state=entry.kind == "end" and self.hybrid)
        return read_arrays(header, payload, len(self.layout.kinds))
