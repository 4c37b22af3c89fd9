"""Putting each worker's messages back in the order it sent them, and prefix affinity: the
two pieces of state a web process keeps about what its workers sent and ran."""

from __future__ import annotations

from dataclasses import dataclass, field

# A missing message is given up this long after a later one arrived.
GAP_TIMEOUT_S = 1.0
# Prefix affinity: prompts are matched on their first k tokens for these k (the longest first),
# remembered for this many prefixes.
AFFINITY_LENGTHS = (4096, 2048, 1024, 512, 256, 128, 64)
AFFINITY_ENTRIES = 20_000


@dataclass
class EventOrder:
    """One worker run's messages, numbered by `seq` from 0: `arrive` returns those that are
    now in order, `skip_gap` gives up a missing one (the channel layer dropped it)."""

    next: int = 0
    waiting: dict[int, dict] = field(default_factory=dict)
    gap_since: float | None = None

    def arrive(self, message: dict, now: float) -> list[dict] | None:
        """The messages ready in order (possibly none); None for one that came after it was
        given up."""
        if message["seq"] < self.next:
            return None
        self.waiting[message["seq"]] = message
        return self._ready(now)

    def skip_gap(self, now: float) -> list[dict]:
        if self.gap_since is None or now - self.gap_since <= GAP_TIMEOUT_S:
            return []
        self.next = min(self.waiting)
        self.gap_since = None
        return self._ready(now)

    def _ready(self, now: float) -> list[dict]:
        ready = []
        while self.next in self.waiting:
            ready.append(self.waiting.pop(self.next))
            self.next += 1
        self.gap_since = (self.gap_since or now) if self.waiting else None
        return ready


class PrefixAffinity:
    """Which worker last ran a prompt with each prefix (per model and cache scope), least recent
    forgotten first: a continued conversation goes back to the worker whose prefix cache holds
    it. A prompt of another scope could not reuse that cache, so it is not drawn there."""

    def __init__(self, entries: int = AFFINITY_ENTRIES):
        self.entries = entries
        self._workers: dict[tuple[str, str, int], str] = {}

    def lookup(self, model: str, prompt: tuple[int, ...], scope: str = "") -> str | None:
        """The worker of the longest remembered prefix of `prompt` in `scope`."""
        for key in _prefix_keys(model, prompt, scope):
            if key in self._workers:
                return self._workers[key]
        return None

    def remember(
        self, model: str, prompt: tuple[int, ...], worker_id: str, scope: str = ""
    ) -> None:
        for key in _prefix_keys(model, prompt, scope):
            self._workers.pop(key, None)
            self._workers[key] = worker_id
        while len(self._workers) > self.entries:
            self._workers.pop(next(iter(self._workers)))


def _prefix_keys(model: str, prompt: tuple[int, ...], scope: str) -> list[tuple[str, str, int]]:
    """Keys of the prompt's prefixes at AFFINITY_LENGTHS (whole prefixes only), longest first;
    the last token is left out, as a continuation's prompt has it where the reply began."""
    body = prompt[:-1]
    return [(model, scope, hash(body[:k])) for k in AFFINITY_LENGTHS if len(body) >= k]
