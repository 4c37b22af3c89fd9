from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.utils import timezone

from engine import SERVICE_TIERS

# The tiers a new key may use; "priority" (served first, preempting the others) is granted by a
# superuser in the admin.
DEFAULT_SERVICE_TIERS = ("default", "flex")
MAX_TEAM_WEIGHT = 1000


def default_service_tiers() -> list[str]:
    return list(DEFAULT_SERVICE_TIERS)


def validate_service_tiers(value: object) -> None:
    if not isinstance(value, list) or not value:
        raise ValidationError("Allow at least one service tier.")
    unknown = [tier for tier in value if tier not in SERVICE_TIERS]
    if unknown:
        raise ValidationError(
            f"Unknown service tier(s): {', '.join(map(str, unknown))}; "
            f"the tiers are {', '.join(SERVICE_TIERS)}."
        )


class Team(models.Model):
    name = models.CharField(max_length=100, unique=True)
    # What members may do with keys of their own on the web pages, and the limits such keys get
    # (owners and staff set any limits, in the admin).
    members_manage_keys = models.BooleanField(
        default=False,
        help_text="Members may create (up to 10 active) and revoke their own keys on the web "
        "pages; those keys get the limits below.",
    )
    member_key_models = models.JSONField(
        default=list,
        blank=True,
        help_text='Models keys members create may use, e.g. ["smollm2-135m-instruct"]; empty: all.',
    )
    member_key_rpm = models.PositiveIntegerField(
        "rpm of keys members create", null=True, blank=True
    )
    member_key_tpm = models.PositiveIntegerField(
        "tpm of keys members create", null=True, blank=True
    )
    member_key_budget_tokens = models.PositiveBigIntegerField(
        "monthly token budget of keys members create", null=True, blank=True
    )
    response_storage_bytes = models.PositiveBigIntegerField(
        "stored responses quota (bytes)",
        null=True,
        blank=True,
        help_text="Bytes of stored /v1/responses responses the team may keep. Empty: "
        "ORCHARD_RESPONSE_STORAGE_BYTES_PER_TEAM.",
    )
    # The engine's fair share (engine.ServiceClass.weight): only superusers set it, since it
    # takes from every other team.
    weight = models.PositiveSmallIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_TEAM_WEIGHT)],
        help_text="Share of the engine while teams compete: a team of weight 2 gets twice the "
        "generation of a team of weight 1 when both have requests waiting (1 to 1000).",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    class Role(models.TextChoices):
        OWNER = "owner", "Owner"
        MEMBER = "member", "Member"

    team = models.ForeignKey(Team, on_delete=models.CASCADE, related_name="memberships")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    role = models.CharField(max_length=10, choices=Role.choices, default=Role.MEMBER)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["team", "user"], name="unique_membership")]

    def __str__(self) -> str:
        return f"{self.user} in {self.team} ({self.role})"


class ApiKeyQuerySet(models.QuerySet):
    def active(self) -> "ApiKeyQuerySet":
        now = timezone.now()
        return self.filter(revoked_at__isnull=True).filter(
            models.Q(expires_at__isnull=True) | models.Q(expires_at__gt=now)
        )


class ApiKey(models.Model):
    """An API key. Only `prefix` (for lookup and display) and a SHA-256 `digest` are stored; the
    raw key is shown once at creation. Limits left empty mean unlimited."""

    prefix = models.CharField(max_length=24, unique=True, editable=False)
    digest = models.CharField(max_length=64, editable=False)
    name = models.CharField("label", max_length=100, blank=True)
    team = models.ForeignKey(Team, on_delete=models.PROTECT, related_name="api_keys")
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="api_keys"
    )
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        on_delete=models.SET_NULL,
        null=True,
        blank=True,
        related_name="+",
    )
    # Model names, not foreign keys: accounts does not depend on inference (docs/architecture.md).
    all_models = models.BooleanField(default=True)
    # May read its team's usage through GET /v1/organization/usage/completions (for billing
    # scripts); set by owners and staff in the admin.
    reads_usage = models.BooleanField(
        default=False, help_text="May read the team's usage through the usage API."
    )
    allowed_models = models.JSONField(default=list, blank=True)
    # Names from engine.SERVICE_TIERS, kept in that order (highest first).
    service_tiers = models.JSONField(
        "service tiers",
        default=default_service_tiers,
        validators=[validate_service_tiers],
        help_text="Tiers the key's requests may ask for (service_tier). Priority is served "
        "before the other tiers, ahead of other teams' requests.",
    )
    rpm = models.PositiveIntegerField("requests per minute", null=True, blank=True)
    tpm = models.PositiveIntegerField("tokens per minute", null=True, blank=True)
    max_parallel = models.PositiveIntegerField("max parallel requests", null=True, blank=True)
    budget_tokens = models.PositiveBigIntegerField("monthly token budget", null=True, blank=True)
    max_output_tokens = models.PositiveIntegerField(
        "output token ceiling",
        null=True,
        blank=True,
        validators=[MinValueValidator(1)],
        help_text="The most one request may generate (max_tokens); more is a 400. Under the "
        "model's own ceiling and default, which it lowers for this key.",
    )
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # The admin form's one-time token: a resubmitted form (a reload of the show-once page)
    # finds its key instead of creating a second one that nobody has seen.
    creation_token = models.CharField(
        max_length=32, null=True, blank=True, unique=True, editable=False
    )
    # A playground key (the members' playground page) is made from a key the member holds: it
    # spends that key's limits and budget, and ends with it (accounts/limits, authentication).
    parent = models.ForeignKey(
        "self",
        on_delete=models.CASCADE,
        null=True,
        blank=True,
        editable=False,
        related_name="playground_keys",
        verbose_name="playground key of",
    )

    objects = ApiKeyQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]
        verbose_name = "API key"

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.name or self.user})"

    @property
    def is_revoked(self) -> bool:
        return self.revoked_at is not None

    @property
    def is_expired(self) -> bool:
        return self.expires_at is not None and self.expires_at <= timezone.now()

    @property
    def is_active(self) -> bool:
        return not self.is_revoked and not self.is_expired

    def allows_model(self, model_name: str) -> bool:
        return self.all_models or model_name in self.allowed_models


class ApiKeyMonthlyUsage(models.Model):
    """Tokens (prompt + completion) a key used in a calendar month (UTC). Written by the usage
    roll-up in the same transaction as the usage row, so the budget limiter can seed itself from
    accounts' own data (accounts does not import inference)."""

    api_key = models.ForeignKey(ApiKey, on_delete=models.CASCADE, related_name="monthly_usage")
    month = models.DateField(help_text="First day of the month.")
    tokens = models.PositiveBigIntegerField(default=0)

    class Meta:
        ordering = ["-month"]
        verbose_name_plural = "API key monthly usage"
        constraints = [
            models.UniqueConstraint(fields=["api_key", "month"], name="unique_key_month")
        ]

    def __str__(self) -> str:
        return f"{self.api_key_id} {self.month:%Y-%m}: {self.tokens}"


class SigninAttempts(models.Model):
    """Sign-in attempts counted against one account or one client address within a window: the
    sign-in throttle's counters where there is no Redis (accounts/signin.py). `key` names the
    counter, never a password or a raw username."""

    key = models.CharField(max_length=100, unique=True)
    count = models.PositiveIntegerField(default=0)
    expires_at = models.DateTimeField(db_index=True)

    class Meta:
        verbose_name_plural = "sign-in attempts"

    def __str__(self) -> str:
        return f"{self.key}: {self.count}"


# What teams may spend and the alerts about it, in a module of their own (accounts/spend.py);
# imported here so that they are the app's models.
from accounts.spend import (  # noqa: E402, F401
    DEFAULT_ALERT_THRESHOLDS,
    AlertWebhook,
    Budget,
    BudgetAlert,
    WebhookDelivery,
    validate_alert_thresholds,
)
