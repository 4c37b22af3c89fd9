"""DiskStore: one model's folder of entries, its index and the writer thread (no MLX).

The engine thread queues entries to write (`enqueue`: at most `max_pending_bytes` waiting, the
rest dropped unless the caller gives a deadline to wait until) and reads files itself; the
writer thread writes, indexes and evicts (deleting files), clears and touches. Written pieces go
back to the engine thread (`release_spent`), so that the views of MLX arrays are let go there.
A failed write (a full disk, an unwritable folder) stops spilling with a warning.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.cache.disk import files, keys
from engine.cache.disk.arrays import check_arrays
from engine.cache.disk.files import BadEntry, Header
from engine.cache.disk.index import DiskEntry, DiskIndex

logger = logging.getLogger(__name__)

# A temporary file older than this is a write a stopped process left; younger, one under way.
STALE_TEMP_SECONDS = 600
COUNTS = (
    "lookups",
    "hits",
    "hit_tokens",
    "spills",
    "spill_bytes",
    "spills_dropped",
    "evictions",
    "read_errors",
    "write_errors",
)


@dataclass
class Out:
    """One entry to write: its header, and per array its pieces (raw views, in token order)."""

    header: Header
    pieces: list[list[np.ndarray]]

    @property
    def nbytes(self) -> int:
        return self.header.payload_bytes


class DiskStore:
    def __init__(
        self,
        home: Path,
        model: str,
        layout,
        *,
        block_tokens: int,
        max_bytes: int,
        max_pending_bytes: int,
    ):
        self.home = home  # the model name's folder
        self.folder = home / model[:32]  # this model key's
        self.model = model
        self.layout = layout
        self.block_tokens = block_tokens
        self.max_pending_bytes = min(max_pending_bytes, max_bytes)
        self.index = DiskIndex(max_bytes)
        self.spilling = True
        self.closed = False
        self.generation = 0  # a clear makes what was queued before it moot
        self._counts = dict.fromkeys(COUNTS, 0)
        self._room = threading.Condition()  # guards the counts and what is pending
        self._pending: set[tuple[str, str]] = set()
        self._pending_bytes = 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._spent: deque = deque()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._scan()
        except OSError as exc:
            self._disable(exc)
        self._writer = threading.Thread(target=self._run, name="orchard-prefix-disk", daemon=True)
        self._writer.start()

    def counts(self) -> dict[str, int]:
        with self._room:
            return dict(self._counts)

    def count(self, name: str, amount: int = 1) -> None:
        with self._room:
            self._counts[name] += amount

    def known(self, scope: str, key: str) -> bool:
        """Whether the entry is on disk or on its way there."""
        with self._room:
            if (scope, key) in self._pending:
                return True
        return self.index.get(scope, key) is not None

    def enqueue(self, outs: list[Out], deadline: float | None = None) -> None:
        nbytes = sum(out.nbytes for out in outs)
        with self._room:
            while self._pending_bytes and self._pending_bytes + nbytes > self.max_pending_bytes:
                left = None if deadline is None else deadline - time.monotonic()
                if left is None or left <= 0:
                    self._counts["spills_dropped"] += len(outs)
                    return
                self._room.wait(left)
            self._pending_bytes += nbytes
            self._pending.update((out.header.scope, out.header.key) for out in outs)
        self._queue.put(("spill", (outs, self.generation)))

    def touch(self, entries: list[DiskEntry]) -> None:
        """Mark entries used, the last one most recently (also on disk, for a restart)."""
        self.index.touch(entries)
        self._queue.put(("touch", [entry.path for entry in entries]))

    def bad(self, path: Path, exc: Exception, entry: DiskEntry | None = None) -> None:
        """A file that failed its checks: counted, forgotten and deleted."""
        logger.warning("prefix cache: dropping %s: %s", path, exc)
        self.count("read_errors")
        if entry is not None:
            self.index.remove(entry)
        _unlink(path)

    def clear(self) -> int:
        self.generation += 1
        freed = sum(entry.nbytes for entry in self.index.clear())
        self._queue.put(("clear", None))
        return freed

    def flush(self, timeout: float | None = None) -> bool:
        done = threading.Event()
        self._queue.put(("flush", done))
        written = done.wait(timeout)
        self.release_spent()
        return written

    def close(self, deadline: float | None = None) -> None:
        self.closed = True
        self._queue.put(None)
        self._writer.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self.release_spent()

    def release_spent(self) -> None:
        while self._spent:
            self._spent.popleft()

    def _disable(self, exc: OSError) -> None:
        self.count("write_errors")
        if self.spilling:
            self.spilling = False
            logger.warning(
                "prefix cache: spilling to %s stopped (%s); what is on disk is still read",
                self.folder,
                exc,
            )

    # -- at start: the index from the files -----------------------------------------------------

    def _scan(self) -> None:
        """Rebuild the index from the files (oldest first, so the budget keeps the newest)."""
        for other in self.home.iterdir():
            if other.is_dir() and other != self.folder:  # the model's earlier weights
                shutil.rmtree(other, ignore_errors=True)
        found = []
        for folder in self.folder.iterdir():
            for path in folder.iterdir() if folder.is_dir() else ():
                if path.name.endswith(files.TEMP_SUFFIX):
                    _unlink(path, older_than=STALE_TEMP_SECONDS)
                    continue
                try:
                    header, size = files.read_header(path)
                    entry = self._entry(header, path, size, folder.name)
                    found.append((path.stat().st_mtime_ns, entry))
                except (OSError, BadEntry) as exc:
                    self.bad(path, exc)
        for _, entry in sorted(found, key=lambda item: item[0]):
            self._evicted(self.index.add(entry))

    def _entry(self, header: Header, path: Path, size: int, folder: str) -> DiskEntry:
        """The index entry of a file's header, checked against this model, the scope folder
        it sits in, its own key and the block size."""
        if header.kind == "block":
            length_ok = len(header.tokens) == self.block_tokens
        else:
            length_ok = header.kind == "end" and len(header.tokens) < self.block_tokens
        if (
            header.model != self.model
            or keys.scope_folder(header.scope) != folder
            or path.name != files.file_name(header.key)
            or header.start % self.block_tokens
            or not length_ok
            or (header.start == 0 and header.parent != keys.root_key(self.model, header.scope))
            or entry_key(header.parent, header.kind, header.tokens) != header.key
        ):
            raise BadEntry("not an entry of this model and scope")
        with_state = header.kind == "end" and self.layout.hybrid
        check_arrays(header, self.layout, with_state=with_state)
        return _index_entry(header, path, size)

    # -- the writer thread ---------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            kind, payload = job
            try:
                if kind == "spill":
                    self._write(*payload)
                elif kind == "clear":
                    self.index.clear()
                    shutil.rmtree(self.folder, ignore_errors=True)
                elif kind == "touch":
                    _touch(payload)
                else:
                    payload.set()
            except Exception:
                logger.exception("prefix cache: the disk writer failed at %s", kind)
            del job, payload

    def _write(self, outs: list[Out], generation: int) -> None:
        for out in outs:
            try:
                if self.spilling and generation == self.generation:
                    self._write_one(out, generation)
                else:
                    self.count("spills_dropped")
            finally:
                with self._room:
                    self._pending.discard((out.header.scope, out.header.key))
                    self._pending_bytes -= out.nbytes
                    self._room.notify_all()
                self._spent.append(out.pieces)
                out.pieces = []

    def _write_one(self, out: Out, generation: int) -> None:
        header = out.header
        folder = self.folder / keys.scope_folder(header.scope)
        payload = [
            np.ascontiguousarray(np.concatenate(views, axis=2) if len(views) > 1 else views[0])
            if views
            else b""
            for views in out.pieces
        ]
        try:
            folder.mkdir(parents=True, exist_ok=True)
            size = files.write_entry(folder, header, payload)
        except OSError as exc:
            self._disable(exc)
            return
        path = folder / files.file_name(header.key)
        if generation != self.generation:  # cleared while it was written
            _unlink(path)
            return
        self.count("spills")
        self.count("spill_bytes", size)
        self._evicted(self.index.add(_index_entry(header, path, size)))

    def _evicted(self, victims: list[DiskEntry]) -> None:
        for victim in victims:
            _unlink(victim.path)
        if victims:
            self.count("evictions", len(victims))


def entry_key(parent: str, kind: str, tokens) -> str:
    return keys.child_key(parent, keys.BLOCK if kind == "block" else keys.END, tokens)


def _index_entry(header: Header, path: Path, size: int) -> DiskEntry:
    has_state = any(a.part == "state" for a in header.arrays)
    return DiskEntry(
        header.scope,
        header.key,
        header.parent,
        header.kind,
        header.start,
        header.tokens,
        size,
        path,
        has_state,
    )


def _unlink(path: Path, *, older_than: float | None = None) -> None:
    """Delete a file if it is there (and, with `older_than`, that many seconds old); a file
    that cannot be deleted is left (it is not indexed, so never read)."""
    try:
        if older_than is None or time.time() - path.stat().st_mtime > older_than:
            path.unlink(missing_ok=True)
    except OSError as exc:
        logger.warning("prefix cache: could not delete %s: %s", path, exc)


def _touch(paths: Iterable[Path]) -> None:
    for path in paths:
        try:
            os.utime(path)
        except FileNotFoundError:
            pass  # evicted since
