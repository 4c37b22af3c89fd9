"""Budget, BudgetAlert, AlertWebhook, WebhookDelivery: what a key, a member or a team may spend,
and the alerts about it (imported by accounts/models.py, so they are the app's models).
accounts/limits/budgets.py enforces budgets; accounts/alerts/ writes and sends the alerts."""

import secrets

from django.apps import apps
from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models

DEFAULT_ALERT_THRESHOLDS = (50, 80, 100)


def validate_alert_thresholds(value: object) -> None:
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) and 1 <= t <= 100 for t in value
    ):
        raise ValidationError("Percentages from 1 to 100, e.g. [50, 80, 100].")


class Budget(models.Model):
    """A cap on what a key, a member (a user within a team) or a whole team spends, in tokens
    (prompt + completion) or in money (ORCHARD_CURRENCY, priced per model), per calendar month
    (UTC) or from `starts_on` to `ends_on` (inclusive). Enforced at admission with the key's own
    limits (accounts/limits); its alerts go out once per threshold and period
    (accounts/alerts)."""

    class Scope(models.TextChoices):
        KEY = "key", "Key"
        MEMBER = "member", "Member"
        TEAM = "team", "Team"

    class Unit(models.TextChoices):
        TOKENS = "tokens", "Tokens"
        MONEY = "money", "Money"

    class Period(models.TextChoices):
        MONTHLY = "monthly", "Each calendar month (UTC)"
        CUSTOM = "custom", "From the start date to the end date"

    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="budgets")
    scope = models.CharField(max_length=10, choices=Scope.choices, default=Scope.TEAM)
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="+",
        help_text="The member, for a member budget (their keys in this team together).",
    )
    api_key = models.ForeignKey(
        "accounts.ApiKey",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="budgets",
        help_text="The key, for a key budget (its playground keys included).",
    )
    unit = models.CharField(max_length=10, choices=Unit.choices, default=Unit.MONEY)
    amount = models.DecimalField(
        max_digits=20,
        decimal_places=4,
        validators=[MinValueValidator(0)],
        help_text="Tokens, or money in the server's currency (ORCHARD_CURRENCY).",
    )
    period = models.CharField(max_length=10, choices=Period.choices, default=Period.MONTHLY)
    starts_on = models.DateField(null=True, blank=True, help_text="A custom period's first day.")
    ends_on = models.DateField(null=True, blank=True, help_text="A custom period's last day.")
    alert_thresholds = models.JSONField(
        default=list,
        blank=True,
        validators=[validate_alert_thresholds],
        help_text="Percentages of the budget at which alerts go out, once each per period, "
        "e.g. [50, 80, 100]. Empty: ORCHARD_BUDGET_ALERT_THRESHOLDS.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["team__name", "scope", "-created_at"]
        indexes = [models.Index(fields=["team", "scope"])]

    def __str__(self) -> str:
        return f"{self.get_scope_display()} budget of {self.subject}"

    @property
    def subject(self) -> str:
        if self.scope == self.Scope.KEY and self.api_key_id is not None:
            return f"{self.api_key.prefix}…"
        if self.scope == self.Scope.MEMBER and self.user_id is not None:
            return f"{self.user} in {self.team}"
        return str(self.team) if self.team_id is not None else "?"

    def clean(self) -> None:
        memberships = apps.get_model("accounts", "Membership").objects
        errors: dict[str, str] = {}
        if self.scope == self.Scope.MEMBER:
            if self.user_id is None:
                errors["user"] = "Name the member."
            elif not memberships.filter(team_id=self.team_id, user_id=self.user_id).exists():
                errors["user"] = "The user must be a member of the team."
        elif self.user_id is not None:
            errors["user"] = "Only a member budget names a user."
        if self.scope == self.Scope.KEY:
            if self.api_key_id is None:
                errors["api_key"] = "Name the key."
            elif self.api_key.team_id != self.team_id or self.api_key.parent_id is not None:
                errors["api_key"] = "The key must be one of the team's own keys."
        elif self.api_key_id is not None:
            errors["api_key"] = "Only a key budget names a key."
        if self.amount is not None and self.unit == self.Unit.TOKENS and self.amount % 1:
            errors["amount"] = "A token budget is a whole number of tokens."
        if self.amount is not None and self.unit == self.Unit.MONEY and self.amount > 9_000_000:
            errors["amount"] = "A money budget is at most 9,000,000."
        if self.period == self.Period.CUSTOM:
            if self.starts_on is None or self.ends_on is None:
                errors["starts_on"] = "A custom period needs its first and last day."
            elif self.ends_on < self.starts_on:
                errors["ends_on"] = "The last day comes after the first."
        elif self.starts_on is not None or self.ends_on is not None:
            errors["starts_on"] = "Only a custom period has dates; a monthly budget has none."
        if errors:
            raise ValidationError(errors)

    def thresholds(self) -> tuple[int, ...]:
        return tuple(sorted(set(self.alert_thresholds or ())))


class BudgetAlert(models.Model):
    """A budget's threshold crossed in a period: written once (its `dedupe_key` is unique, so
    of several processes noticing at once one sends), then emailed and handed to the webhooks."""

    dedupe_key = models.CharField(max_length=200, unique=True, editable=False)
    team = models.ForeignKey("accounts.Team", on_delete=models.CASCADE, related_name="+")
    budget = models.ForeignKey(
        "accounts.Budget",
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="alerts",
        help_text="Empty: the key's own monthly token budget (or a budget since deleted).",
    )
    api_key = models.ForeignKey(
        "accounts.ApiKey", on_delete=models.CASCADE, null=True, blank=True, related_name="+"
    )
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, null=True, blank=True, related_name="+"
    )
    scope = models.CharField(max_length=10, choices=Budget.Scope.choices)
    unit = models.CharField(max_length=10, choices=Budget.Unit.choices)
    description = models.CharField(max_length=300)
    period_start = models.DateField()
    period_end = models.DateField()
    threshold = models.PositiveSmallIntegerField(help_text="Percent of the budget.")
    limit = models.DecimalField(max_digits=30, decimal_places=9)
    used = models.DecimalField(max_digits=30, decimal_places=9)
    currency = models.CharField(max_length=3, blank=True)
    emailed_to = models.TextField(blank=True)
    email_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.description}: {self.threshold}%"


def new_webhook_secret() -> str:
    return "whsec_" + secrets.token_urlsafe(32)


class AlertWebhook(models.Model):
    """Where budget alerts are POSTed, signed with `secret` (accounts/alerts/webhooks.py): one
    team's alerts, or every team's when `team` is empty."""

    team = models.ForeignKey(
        "accounts.Team",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        related_name="alert_webhooks",
        help_text="Empty: every team's alerts.",
    )
    url = models.URLField(max_length=500, help_text="An http(s) URL that receives the POSTs.")
    secret = models.CharField(
        max_length=100,
        default=new_webhook_secret,
        help_text="The HMAC-SHA256 key of the X-Orchard-Signature header; give it to the receiver.",
    )
    enabled = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["team__name", "url"]
        verbose_name = "alert webhook"

    def __str__(self) -> str:
        return f"{self.url} ({self.team or 'every team'})"


class WebhookDelivery(models.Model):
    """One alert sent to one webhook: its body (the exact bytes signed), each attempt with its
    status code or error, and when the next one is due (retried with exponential backoff by a
    background worker, never on a request's path)."""

    class Status(models.TextChoices):
        PENDING = "pending"
        DELIVERED = "delivered"
        FAILED = "failed"

    webhook = models.ForeignKey(
        "accounts.AlertWebhook", on_delete=models.CASCADE, related_name="deliveries"
    )
    alert = models.ForeignKey(
        "accounts.BudgetAlert", on_delete=models.CASCADE, related_name="deliveries"
    )
    body = models.TextField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveSmallIntegerField(default=0)
    last_status_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    log = models.JSONField(default=list, blank=True)
    next_attempt_at = models.DateTimeField(db_index=True)
    claimed_until = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]
        verbose_name_plural = "webhook deliveries"
        indexes = [models.Index(fields=["status", "next_attempt_at"])]

    def __str__(self) -> str:
        return f"{self.alert} → {self.webhook.url} ({self.status})"
