"""Which thresholds a budget has reached, and each one's alert, written once.

A threshold is reached when the budget's finished usage is at least that share of its limit. Its
alert is keyed by the budget, the period, the threshold and the limit (`BudgetAlert.dedupe_key`,
unique), so it is written once however many processes notice at once, and the one that wrote it
sends it. A budget whose limit an administrator changes alerts afresh against the new limit.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from decimal import Decimal

from django.db import IntegrityError, transaction

from accounts.alerts.emails import alert_email
from accounts.alerts.webhooks import deliveries_create
from accounts.limits import BudgetLimit, budget_used
from accounts.limits.budgets import TOKENS
from accounts.models import BudgetAlert
from common.money import currency, from_nanos

logger = logging.getLogger(__name__)


def alerts_check(budgets: Iterable[BudgetLimit]) -> list[BudgetAlert]:
    """Write, email and hand to the webhooks the alerts of every threshold `budgets` have reached
    and not yet alerted in their period. Returns the alerts this call wrote."""
    written = []
    for budget in set(budgets):
        if budget.limit <= 0:
            continue  # a budget of nothing is a door shut on purpose, not one to alert about
        used = budget_used(budget)
        for threshold in budget.thresholds:
            if used * 100 >= threshold * budget.limit:
                alert = _write(budget, threshold, used)
                if alert is not None:
                    written.append(alert)
    for alert in written:
        try:
            alert_email(alert)
        except Exception:
            logger.exception("budget alert %s: the email failed", alert.pk)
        deliveries_create(alert)
    return written


def _amount(budget: BudgetLimit, value: int) -> Decimal:
    return Decimal(value) if budget.unit == TOKENS else from_nanos(value)


def _write(budget: BudgetLimit, threshold: int, used: int) -> BudgetAlert | None:
    """The threshold's alert, if this call is the first to write it."""
    ref = f"b{budget.budget_id}" if budget.budget_id is not None else f"k{budget.api_key_id}"
    key = f"{ref}|{budget.start}|{budget.end}|{threshold}|{budget.limit}"
    if BudgetAlert.objects.filter(dedupe_key=key).exists():
        return None
    try:
        with transaction.atomic():
            return BudgetAlert.objects.create(
                dedupe_key=key,
                team_id=budget.team_id,
                budget_id=budget.budget_id,
                api_key_id=budget.api_key_id,
                user_id=budget.user_id,
                scope=budget.scope,
                unit=budget.unit,
                description=f"{budget.name}: {budget.what()}",
                period_start=budget.start,
                period_end=budget.end,
                threshold=threshold,
                limit=_amount(budget, budget.limit),
                used=_amount(budget, used),
                currency="" if budget.unit == TOKENS else currency(),
            )
    except IntegrityError:  # another process wrote it first (or the budget is gone)
        return None
