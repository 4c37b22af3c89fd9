"""What the disk tier holds, in memory: every entry's key, parent, tokens and size, per scope, in
least-recently-used order (no I/O, no MLX; thread-safe: the engine thread looks entries up, the
writer thread adds and evicts them).

The bytes are bounded and shared fairly between scopes: when over the budget, the scope holding
the most bytes gives up an entry first, so one team's flood of prompts evicts its own entries
before it can push another team's out; within a scope, the least recently used entry that no
other entry continues (a leaf: evicting a block in the middle would strand those after it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(eq=False)
class DiskEntry:
    scope: str
    key: str
    parent: str
    kind: str  # "block" | "end"
    start: int
    tokens: tuple[int, ...]
    nbytes: int
    path: Path
    has_state: bool = False

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


class DiskIndex:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._scopes: dict[str, OrderedDict[str, DiskEntry]] = {}
        self._children: dict[tuple[str, str], dict[str, DiskEntry]] = {}
        self._scope_bytes: dict[str, int] = {}
        self.nbytes = 0
        self.num_entries = 0

    def get(self, scope: str, key: str) -> DiskEntry | None:
        with self._lock:
            entries = self._scopes.get(scope)
            return entries.get(key) if entries is not None else None

    def children(self, scope: str, parent: str) -> list[DiskEntry]:
        with self._lock:
            return list(self._children.get((scope, parent), {}).values())

    def add(self, entry: DiskEntry) -> list[DiskEntry]:
        """Index `entry` (replacing one of its key) as the most recently used of its scope;
        returns the entries evicted to stay within the budget (their files to delete)."""
        with self._lock:
            old = self._scopes.get(entry.scope, {}).get(entry.key)
            if old is not None:
                self._drop(old)
            self._scopes.setdefault(entry.scope, OrderedDict())[entry.key] = entry
            self._children.setdefault((entry.scope, entry.parent), {})[entry.key] = entry
            self._scope_bytes[entry.scope] = self._scope_bytes.get(entry.scope, 0) + entry.nbytes
            self.nbytes += entry.nbytes
            self.num_entries += 1
            victims = []
            while self.nbytes > self.max_bytes and self._scope_bytes:
                largest = max(self._scope_bytes, key=self._scope_bytes.__getitem__)
                entries = self._scopes[largest].values()
                victim = next(e for e in entries if (e.scope, e.key) not in self._children)
                self._drop(victim)
                victims.append(victim)
            return victims

    def touch(self, entries: Iterable[DiskEntry]) -> None:
        """Mark `entries` used, in order: the last one becomes the most recently used."""
        with self._lock:
            for entry in entries:
                scope = self._scopes.get(entry.scope)
                if scope is not None and scope.get(entry.key) is entry:
                    scope.move_to_end(entry.key)

    def remove(self, entry: DiskEntry) -> bool:
        with self._lock:
            scope = self._scopes.get(entry.scope)
            if scope is None or scope.get(entry.key) is not entry:
                return False
            self._drop(entry)
            return True

    def clear(self) -> list[DiskEntry]:
        with self._lock:
            entries = [e for scope in self._scopes.values() for e in scope.values()]
            for entry in entries:
                self._drop(entry)
            return entries

    def _drop(self, entry: DiskEntry) -> None:
        scope = self._scopes[entry.scope]
        del scope[entry.key]
        siblings = self._children[(entry.scope, entry.parent)]
        del siblings[entry.key]
        if not siblings:
            del self._children[(entry.scope, entry.parent)]
        self._scope_bytes[entry.scope] -= entry.nbytes
        if not scope:
            del self._scopes[entry.scope]
            del self._scope_bytes[entry.scope]
        self.nbytes -= entry.nbytes
        self.num_entries -= 1
