"""Budget alerts by email, through Django's mail backend (SMTP with DJANGO_EMAIL_HOST, else the
server's log). Who gets them: ORCHARD_BUDGET_ALERT_EMAILS, any of "owners" (the team's owners),
"member" (a key budget's key holder, a member budget's member) and email addresses."""

from __future__ import annotations

from decimal import Decimal

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.mail import send_mail

from accounts.models import Budget, BudgetAlert, Membership
from common.money import format_money, to_nanos

NO_RECIPIENTS = "no recipient: see ORCHARD_BUDGET_ALERT_EMAILS and the users' email addresses"


def alert_recipients(alert: BudgetAlert) -> list[str]:
    wanted = settings.ORCHARD_BUDGET_ALERT_EMAILS
    found = [entry for entry in wanted if "@" in entry]
    if "owners" in wanted:
        owners = Membership.objects.filter(
            team_id=alert.team_id, role=Membership.Role.OWNER, user__is_active=True
        ).values_list("user__email", flat=True)
        found += list(owners)
    if "member" in wanted and alert.scope != Budget.Scope.TEAM:
        holder = alert.api_key.user_id if alert.scope == Budget.Scope.KEY else alert.user_id
        user = get_user_model().objects.filter(pk=holder, is_active=True).first()
        found += [user.email] if user is not None else []
    return sorted({address for address in found if address})


def amount_text(alert: BudgetAlert, value: Decimal) -> str:
    if alert.unit == Budget.Unit.TOKENS:
        return f"{int(value):,} tokens"
    return format_money(to_nanos(value))


def alert_subject(alert: BudgetAlert) -> str:
    return f"[Orchard] {alert.threshold}% of a budget used: {alert.description}"


def alert_text(alert: BudgetAlert) -> str:
    scope, _, what = alert.description.partition(": ")
    return (
        f"The {scope} has used {alert.threshold}% of its {what}: "
        f"{amount_text(alert, alert.used)} of {amount_text(alert, alert.limit)}, "
        f"from {alert.period_start} to {alert.period_end} (UTC).\n\n"
        f"Requests that would take it past {amount_text(alert, alert.limit)} are refused "
        "(429, insufficient_quota) until the period ends or an administrator raises the "
        "budget.\n"
    )


def alert_email(alert: BudgetAlert) -> None:
    """Send the alert's email, and note on it to whom (or why not)."""
    recipients = alert_recipients(alert)
    if not recipients:
        alert.email_error = NO_RECIPIENTS
    else:
        try:
            send_mail(alert_subject(alert), alert_text(alert), None, recipients)
            alert.emailed_to = ", ".join(recipients)
        except Exception as exc:
            alert.email_error = f"{type(exc).__name__}: {exc}"[:1000]
    alert.save(update_fields=["emailed_to", "email_error"])
