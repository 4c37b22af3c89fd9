"""The in-process backend (REDIS_URL unset): counters behind one `threading.Lock`, because the web
process may run several event-loop threads; nothing is awaited while it is held."""

import threading
import time
from collections import deque
from dataclasses import dataclass, field

from accounts.limits.base import (
    BUDGET_IDLE_SECONDS,
    PARALLEL_LEASE_SECONDS,
    WINDOW_SECONDS,
    Limiter,
    Status,
    Verdict,
)
from accounts.limits.budgets import TOKENS


@dataclass
class _KeyState:
    # Oldest first: admission times; id -> [time, tokens]; id -> (lease end, reserved tokens).
    requests: deque[float] = field(default_factory=deque)
    tokens: dict[str, list] = field(default_factory=dict)
    inflight: dict[str, tuple[float, int]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        return not (self.requests or self.tokens or self.inflight)


@dataclass
class _Budget:
    # The period's finished usage, seeded from the database and advanced by releases; None once
    # idle past `expires_at` (then re-seeded, as the Redis backend's key TTL does).
    finished: int | None = None
    expires_at: float = 0.0
    held: dict[str, tuple[float, int]] = field(default_factory=dict)  # id -> (lease end, amount)

    def purge(self, now: float) -> None:
        for admission_id in [i for i, (end, _) in self.held.items() if end <= now]:
            del self.held[admission_id]
        if self.finished is not None and self.expires_at <= now:
            self.finished = None


class InProcessLimiter(Limiter):
    def __init__(
        self,
        *,
        window_seconds: float = WINDOW_SECONDS,
        lease_seconds: float = PARALLEL_LEASE_SECONDS,
        budget_idle_seconds: float = BUDGET_IDLE_SECONDS,
    ):
        self._window_ms = window_seconds * 1000
        self._lease_ms = lease_seconds * 1000
        self._budget_idle_ms = budget_idle_seconds * 1000
        self._lock = threading.Lock()
        self._keys: dict[str, _KeyState] = {}
        self._budgets: dict[str, _Budget] = {}  # by counter (accounts/limits/budgets.py)
        self._next_sweep_at = 0.0

    def _purge(self, state: _KeyState, now: float) -> None:
        horizon = now - self._window_ms
        while state.requests and state.requests[0] <= horizon:
            state.requests.popleft()
        while state.tokens:
            first = next(iter(state.tokens))
            if state.tokens[first][0] > horizon:
                break
            del state.tokens[first]
        while state.inflight:
            first = next(iter(state.inflight))
            if state.inflight[first][0] > now:
                break
            del state.inflight[first]

    def _sweep(self, now: float) -> None:
        # Without this, every key ever seen (and every month of it) would stay in memory. A pass
        # over all of them costs O(keys), so it runs at most once a window, not per request.
        if now < self._next_sweep_at:
            return
        self._next_sweep_at = now + self._window_ms
        for ident, state in list(self._keys.items()):
            self._purge(state, now)
            if state.empty:
                del self._keys[ident]
        for counter, budget in list(self._budgets.items()):
            budget.purge(now)
            if budget.finished is None and not budget.held:
                del self._budgets[counter]

    def _counts(self, state: _KeyState, now: float) -> Verdict:
        verdict = Verdict(status=Status.ADMITTED)
        verdict.requests = len(state.requests)
        if state.requests:
            verdict.requests_reset_ms = int(state.requests[-1] + self._window_ms - now)
        verdict.tokens = sum(tokens for _, tokens in state.tokens.values())
        verdict.inflight = len(state.inflight)
        if state.tokens:
            newest = state.tokens[next(reversed(state.tokens))][0]
            verdict.tokens_reset_ms = int(newest + self._window_ms - now)
        return verdict

    def _tokens_retry_ms(self, state: _KeyState, excess: int, now: float) -> int:
        freed = 0
        for at, tokens in state.tokens.values():
            freed += tokens
            if freed >= excess:
                return int(at + self._window_ms - now)
        return -1

    async def _check(self, limits, admission_id, reserved, least, rates, seeds, mode) -> Verdict:
        enters, reserves = mode in ("admit", "enter"), mode in ("admit", "reserve")
        with self._lock:
            now = time.monotonic() * 1000
            self._sweep(now)
            state = self._keys.setdefault(limits.ident, _KeyState())
            self._purge(state, now)
            verdict = self._counts(state, now)
            grant = reserved
            budgets = [self._budgets.setdefault(b.counter, _Budget()) for b in limits.counters]
            missing = []
            for index, budget in enumerate(budgets):
                budget.purge(now)
                if budget.finished is None:
                    if seeds[index] is None:
                        missing.append(index)
                        continue
                    budget.finished = seeds[index]
                    budget.expires_at = now + self._budget_idle_ms
            if missing:
                return Verdict(status=Status.NEED_SEED, need_seeds=tuple(missing))
            for index, (budget, limit) in enumerate(zip(budgets, limits.counters, strict=True)):
                used = budget.finished + sum(amount for _, amount in budget.held.values())
                if used + least * rates[index] > limit.limit:
                    verdict.status, verdict.reason = Status.REJECTED, "budget"
                    verdict.budget_used, verdict.budget_index = used, index
                    return verdict
                if rates[index] > 0:
                    grant = min(grant, (limit.limit - used) // rates[index])
            if limits.tpm is not None and least > limits.tpm:
                verdict.status, verdict.reason = Status.REJECTED, "too_large"
                return verdict
            if enters and limits.rpm is not None and verdict.requests + 1 > limits.rpm:
                verdict.status, verdict.reason = Status.REJECTED, "requests"
                verdict.retry_ms = int(state.requests[0] + self._window_ms - now)
                return verdict
            if limits.tpm is not None:
                if verdict.tokens + least > limits.tpm:
                    verdict.status, verdict.reason = Status.REJECTED, "tokens"
                    excess = verdict.tokens + least - limits.tpm
                    verdict.retry_ms = self._tokens_retry_ms(state, excess, now)
                    return verdict
                grant = min(grant, limits.tpm - verdict.tokens)
            if (
                enters
                and limits.max_parallel is not None
                and len(state.inflight) >= limits.max_parallel
            ):
                verdict.status, verdict.reason = Status.REJECTED, "parallel"
                return verdict
            grant = grant if reserves else 0
            verdict.granted = grant
            if enters and limits.rpm is not None:
                state.requests.append(now)
                verdict.requests += 1
                verdict.requests_reset_ms = int(self._window_ms)
            if reserves and limits.tpm is not None:
                state.tokens[admission_id] = [now, grant]
                verdict.tokens += grant
                verdict.tokens_reset_ms = int(self._window_ms)
            if enters and limits.max_parallel is not None:
                state.inflight[admission_id] = (now + self._lease_ms, grant)
            for index, budget in enumerate(budgets):
                if enters:
                    budget.held[admission_id] = (now + self._lease_ms, grant * rates[index])
                elif admission_id in budget.held:
                    lease_end = budget.held[admission_id][0]
                    budget.held[admission_id] = (lease_end, grant * rates[index])
                budget.expires_at = now + self._budget_idle_ms
            return verdict

    async def _peek(self, limits) -> Verdict:
        with self._lock:
            now = time.monotonic() * 1000
            self._sweep(now)
            # Not stored: a key that is only looked at must not occupy memory.
            state = self._keys.get(limits.ident) or _KeyState()
            self._purge(state, now)
            return self._counts(state, now)

    async def _release(self, limits, admission_id, used, cost) -> None:
        with self._lock:
            state = self._keys.get(limits.ident)
            if state is not None:
                if admission_id in state.tokens:
                    state.tokens[admission_id][1] = used
                state.inflight.pop(admission_id, None)
            for limit in limits.counters:
                budget = self._budgets.get(limit.counter)
                # Only the release that ended the reservation counts: a retried one changes
                # nothing (as in Redis).
                if budget is None or budget.held.pop(admission_id, None) is None:
                    continue
                if budget.finished is not None:
                    budget.finished += used if limit.unit == TOKENS else cost
