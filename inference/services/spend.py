"""What budgets have used, read from the daily roll-ups: the limiter's seeds (registered with
accounts.limits when the app starts, as accounts cannot read inference's tables), the alerts'
figures and the pages' "used / remaining"."""

from __future__ import annotations

from django.contrib.auth.models import AbstractBaseUser
from django.db.models import F, Q, Sum
from django.utils import timezone

from accounts.limits import BudgetLimit, BudgetUse, budget_used
from accounts.limits.budgets import KEY, MEMBER, TEAM, TOKENS, budget_limit
from accounts.models import Budget
from inference.models import DailyUsage


def budget_usage(budget: BudgetLimit) -> int:
    """The tokens (prompt + completion) or nano-units the budget's scope finished in its
    period: its team's, its member's keys' in the team, or its key's (playground keys
    included)."""
    rows = DailyUsage.objects.filter(
        team_id=budget.team_id, date__gte=budget.start, date__lte=budget.end
    )
    if budget.scope == MEMBER:
        rows = rows.filter(api_key__user_id=budget.user_id)
    elif budget.scope == KEY:
        key = budget.api_key_id
        rows = rows.filter(Q(api_key_id=key) | Q(api_key__parent_id=key))
    if budget.unit == TOKENS:
        total = Sum(F("prompt_tokens") + F("completion_tokens"))
    else:
        total = Sum(F("input_cost") + F("cached_input_cost") + F("output_cost"))
    return rows.aggregate(total=total)["total"] or 0


def member_budget_uses(user: AbstractBaseUser) -> list[tuple[str, BudgetUse]]:
    """The budgets of `user` as a member of each of their teams, and of those teams, in force
    today, with what each has used: ("Your budget in team-a" / "team-a's budget", use)."""
    today = timezone.now().date()
    rows = (
        Budget.objects.filter(team__memberships__user=user)
        .filter(Q(scope=TEAM) | Q(scope=MEMBER, user=user))
        .filter(
            Q(period=Budget.Period.MONTHLY)
            | Q(period=Budget.Period.CUSTOM, starts_on__lte=today, ends_on__gte=today)
        )
        .select_related("team", "user")
        .order_by("team__name", "-scope", "pk")
    )
    out = []
    for row in rows:
        budget = budget_limit(row, today)
        label = f"Your budget in {row.team}" if row.scope == MEMBER else f"{row.team}'s budget"
        out.append((label, BudgetUse(budget, budget_used(budget))))
    return out
