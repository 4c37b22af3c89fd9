"""The budgets a request spends, as the limiter counts them.

A request spends every budget that covers it today: its key's own monthly token budget
(`ApiKey.budget_tokens`), and the `Budget` rows of its key, its member (the key's user in the
key's team) and its team whose period holds today (UTC). Each is a `BudgetLimit`: a limit in
tokens or in nano-units of money (common/money.py) over a period of whole days.

What a budget counts is its *counter* (the scope, the unit and the period, not the limit): two
budgets of one team in one unit and period share a counter, which the limiter holds once and
checks against the tighter limit. A counter starts from the usage already finished in its
period (its *seed*): the key's monthly tokens from `ApiKeyMonthlyUsage` (kept beside the usage
rows), every other from the daily roll-ups, which only inference can read: it registers the
reader (`budget_usage_source`) when it starts.
"""

from __future__ import annotations

import calendar
import datetime
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from django.conf import settings
from django.db.models import Q

from accounts.models import ApiKey, Budget, Team
from accounts.selectors import api_key_month_tokens
from common.money import format_money, to_nanos
from common.precompiled import Precompiled

TOKENS, MONEY = Budget.Unit.TOKENS.value, Budget.Unit.MONEY.value
KEY, MEMBER, TEAM = Budget.Scope.KEY.value, Budget.Scope.MEMBER.value, Budget.Scope.TEAM.value


@dataclass(frozen=True)
class BudgetLimit:
    """One budget as the limiter and the alerts see it: `limit` tokens or nano-units over the
    days `start` to `end` (inclusive)."""

    scope: str  # KEY, MEMBER or TEAM
    unit: str  # TOKENS or MONEY
    limit: int
    start: datetime.date
    end: datetime.date
    monthly: bool
    team_id: int
    team_ident: str  # the team, unique across databases sharing a Redis (`team_ident`)
    name: str  # whose: "key sk-orch-ab12cd34", "member alice in team-a", "team team-a"
    user_id: int | None = None
    api_key_id: int | None = None
    budget_id: int | None = None  # the Budget row; None: the key's own monthly token budget
    thresholds: tuple[int, ...] = ()

    @property
    def counter(self) -> str:
        """What it counts, whatever its limit: scope, unit and period."""
        who = {
            KEY: f"k{self.team_ident}.{self.api_key_id}",
            MEMBER: f"m{self.team_ident}.{self.user_id}",
            TEAM: f"t{self.team_ident}",
        }[self.scope]
        return f"{who}:{self.unit}:{self.start:%Y%m%d}-{self.end:%Y%m%d}"

    def rate(self, token_cost: int | None) -> int:
        """What one token takes from this budget: a token budget 1; a money budget the most
        one token of the request's model may cost (nano-units), or 1 while the model is not
        known yet (a request entering: only an exhausted budget refuses it)."""
        if self.unit == TOKENS:
            return 1
        return 1 if token_cost is None else max(0, int(token_cost))

    def what(self) -> str:
        """ "monthly token budget", "money budget for 2026-12-01 to 2026-12-15"."""
        unit = "token" if self.unit == TOKENS else "money"
        if self.monthly:
            return f"monthly {unit} budget"
        return f"{unit} budget for {self.start} to {self.end}"

    def describe(self) -> str:
        """ "key's monthly token budget", "team's money budget for 2026-12-01 to 2026-12-15"."""
        return f"{self.scope}'s {self.what()}"

    def amount(self, value: int) -> str:
        """`value` in the budget's unit, for messages: "1200" tokens, "12.50 USD"."""
        return str(value) if self.unit == TOKENS else format_money(value)


def team_ident(team: Team) -> str:
    """The team's id and creation time: ids repeat between databases (a test run's, another
    installation's) that may share one Redis, so counters are named by both."""
    return f"{team.pk}.{int(team.created_at.timestamp() * 1_000_000)}"


def month_bounds(day: datetime.date) -> tuple[datetime.date, datetime.date]:
    last = calendar.monthrange(day.year, day.month)[1]
    return day.replace(day=1), day.replace(day=last)


def default_thresholds() -> tuple[int, ...]:
    return tuple(settings.ORCHARD_BUDGET_ALERT_THRESHOLDS)


def _owner(api_key: ApiKey) -> ApiKey:
    """The key whose limits a key spends: a playground key spends the key it was made from."""
    return api_key.parent if api_key.parent_id is not None else api_key


def budget_rows_for(api_key: ApiKey, day: datetime.date) -> list[Budget]:
    """The Budget rows that cover a request of `api_key` on `day` (one query, compiled once:
    every request reads them)."""
    owner = _owner(api_key)
    return _budget_rows(owner.team_id, owner.user_id, owner.pk, day)


def _budget_rows_query(team_id: int, user_id: int, key_id: int, day: datetime.date):
    return (
        Budget.objects.filter(team_id=team_id)
        .filter(Q(scope=TEAM) | Q(scope=MEMBER, user_id=user_id) | Q(scope=KEY, api_key_id=key_id))
        .filter(
            Q(period=Budget.Period.MONTHLY)
            | Q(period=Budget.Period.CUSTOM, starts_on__lte=day, ends_on__gte=day)
        )
        .select_related("team", "user", "api_key")
        .order_by("pk")
    )


_budget_rows = Precompiled(_budget_rows_query, -7001, -7002, -7003, datetime.date(1901, 2, 3))


def budget_limit(budget: Budget, day: datetime.date) -> BudgetLimit:
    """`budget` as the limiter counts it for a request on `day`."""
    if budget.period == Budget.Period.MONTHLY:
        start, end = month_bounds(day)
    else:
        start, end = budget.starts_on, budget.ends_on
    limit = int(budget.amount) if budget.unit == TOKENS else to_nanos(budget.amount)
    name = {
        KEY: lambda: f"key {budget.api_key.prefix}",
        MEMBER: lambda: f"member {budget.user} in {budget.team}",
        TEAM: lambda: f"team {budget.team}",
    }[budget.scope]()
    return BudgetLimit(
        scope=budget.scope,
        unit=budget.unit,
        limit=limit,
        start=start,
        end=end,
        monthly=budget.period == Budget.Period.MONTHLY,
        team_id=budget.team_id,
        team_ident=team_ident(budget.team),
        name=name,
        user_id=budget.user_id if budget.scope == MEMBER else None,
        api_key_id=budget.api_key_id if budget.scope == KEY else None,
        budget_id=budget.pk,
        thresholds=budget.thresholds() or default_thresholds(),
    )


def budget_limits_for(
    api_key: ApiKey, day: datetime.date, rows: Iterable[Budget] | None = None
) -> tuple[BudgetLimit, ...]:
    """Every budget a request of `api_key` spends on `day`: the key's own monthly token budget,
    then its Budget rows (`rows`, when already read: `budget_rows_for`). Reads `api_key.team`
    (a playground key's team is its key's)."""
    owner = _owner(api_key)
    found = []
    if owner.budget_tokens is not None:
        start, end = month_bounds(day)
        found.append(
            BudgetLimit(
                scope=KEY,
                unit=TOKENS,
                limit=owner.budget_tokens,
                start=start,
                end=end,
                monthly=True,
                team_id=owner.team_id,
                team_ident=team_ident(api_key.team) if api_key.team_id else "-",
                name=f"key {owner.prefix}",
                api_key_id=owner.pk,
                thresholds=default_thresholds(),
            )
        )
    rows = budget_rows_for(api_key, day) if rows is None else rows
    found += [budget_limit(row, day) for row in rows]
    return tuple(found)


def tightest(budgets: Iterable[BudgetLimit]) -> tuple[BudgetLimit, ...]:
    """One budget per counter, the one with the lowest limit: what the limiter checks."""
    kept: dict[str, BudgetLimit] = {}
    for budget in budgets:
        held = kept.get(budget.counter)
        if held is None or budget.limit < held.limit:
            kept[budget.counter] = budget
    return tuple(kept.values())


# Reads what a budget's counter has used in its period from the usage roll-ups (inference's,
# which accounts cannot import: inference registers it when it starts).
_usage_source: Callable[[BudgetLimit], int] | None = None


def budget_usage_source(source: Callable[[BudgetLimit], int]) -> None:
    """Where budgets other than a key's monthly tokens read their period's finished usage."""
    global _usage_source
    _usage_source = source


def budget_used(budget: BudgetLimit) -> int:
    """The tokens or nano-units `budget`'s counter has finished in its period (no request in
    flight): the limiter's seed, the alerts' and the pages' figure."""
    if budget.scope == KEY and budget.unit == TOKENS and budget.monthly:
        return api_key_month_tokens(api_key_id=budget.api_key_id, month=budget.start)
    if _usage_source is None:
        raise RuntimeError("No usage source for budgets: the inference app registers one.")
    return _usage_source(budget)


@dataclass(frozen=True)
class BudgetUse:
    """A budget and what its finished requests have used, for the pages."""

    budget: BudgetLimit
    used: int

    @property
    def remaining(self) -> int:
        return max(0, self.budget.limit - self.used)

    def phrase(self) -> str:
        """ "1,200 of 50,000 tokens this month (48,800 left)", "3.20 of 10.00 USD from
        2026-12-01 to 2026-12-15 (6.80 left)"."""
        budget = self.budget
        when = "this month" if budget.monthly else f"from {budget.start} to {budget.end}"
        if budget.unit == TOKENS:
            return f"{self.used:,} of {budget.limit:,} tokens {when} ({self.remaining:,} left)"
        used, left = (format_money(v, with_currency=False) for v in (self.used, self.remaining))
        return f"{used} of {format_money(budget.limit)} {when} ({left} left)"


def key_budget_uses(api_key: ApiKey, day: datetime.date) -> list[BudgetUse]:
    """The key's own `Budget` rows in force on `day` and what each has used (its monthly token
    budget, `ApiKey.budget_tokens`, is among its limits: `accounts.limits.key_use`)."""
    rows = [row for row in budget_rows_for(api_key, day) if row.scope == KEY]
    return [BudgetUse(b, budget_used(b)) for b in (budget_limit(row, day) for row in rows)]
