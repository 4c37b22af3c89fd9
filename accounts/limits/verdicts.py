"""A key's limits as the backends check them, and a backend's verdict on one admission."""

from dataclasses import dataclass
from enum import IntEnum

from accounts.limits.budgets import BudgetLimit, tightest
from accounts.models import ApiKey


class Status(IntEnum):
    ADMITTED = 0
    REJECTED = 1
    NEED_SEED = 2


@dataclass(frozen=True)
class Limits:
    ident: str
    api_key_id: int
    team_id: int
    rpm: int | None
    tpm: int | None
    max_parallel: int | None
    budgets: tuple[BudgetLimit, ...] = ()  # every budget the request spends

    @classmethod
    def of(cls, api_key: ApiKey, budgets: tuple[BudgetLimit, ...] = ()) -> "Limits":
        """The key's limits; a playground key's are those of the key it was made from, the
        same counters (authentication loads that key with it)."""
        if api_key.parent_id is not None:
            api_key = api_key.parent
        return cls(
            ident=api_key.prefix,
            api_key_id=api_key.pk,
            team_id=api_key.team_id,
            rpm=api_key.rpm,
            tpm=api_key.tpm,
            max_parallel=api_key.max_parallel,
            budgets=budgets,
        )

    @property
    def counters(self) -> tuple[BudgetLimit, ...]:
        """The budgets the backends check: one per counter, the tightest."""
        return tightest(self.budgets)

    @property
    def unlimited(self) -> bool:
        limits = (self.rpm, self.tpm, self.max_parallel)
        return all(v is None for v in limits) and not self.budgets


@dataclass
class Verdict:
    status: Status
    reason: str = ""  # "requests" | "tokens" | "too_large" | "parallel" | "budget"
    requests: int = 0  # in the rpm window (after this admission when admitted)
    tokens: int = 0  # in the tpm window
    requests_reset_ms: int = 0  # until the rpm window is empty
    tokens_reset_ms: int = 0
    retry_ms: int = -1  # until the refused limit has room; -1 unknown
    budget_used: int = 0  # the refusing budget's finished + in flight, before this request
    budget_index: int = -1  # which of `Limits.counters` refused
    need_seeds: tuple[int, ...] = ()  # which of `Limits.counters` need their seed (NEED_SEED)
    granted: int = 0  # tokens reserved when admitted
    inflight: int = 0  # requests holding a parallel slot (counted for keys with max_parallel)
