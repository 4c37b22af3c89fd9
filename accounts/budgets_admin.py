"""Admin for budgets, their alerts, the alert webhooks and the webhooks' delivery log.

Superusers set every budget; a team's owner (staff) sets the budgets of its members and keys, and
sees the team's own budgets read-only (a team's budget is set by whoever pays for it, as its
weight is). Webhooks are superusers' (the server POSTs to the URL one names); a team's owner sees
the team's. Alerts and deliveries are records the server writes: read-only, but a delivery can
be retried at once.
"""

from django import forms
from django.contrib import admin, messages
from django.utils import timezone
from django.utils.html import format_html_join

from accounts.alerts import alert_worker
from accounts.limits import budget_used
from accounts.limits.budgets import TOKENS, budget_limit
from accounts.models import AlertWebhook, Budget, BudgetAlert, WebhookDelivery
from accounts.selectors import teams_owned_by
from common.money import format_money, to_nanos

ERROR_TEAM_BUDGET_BY_SUPERUSER = "Only a superuser sets a team's own budget."


class OwnedTeamFilter(admin.RelatedFieldListFilter):
    """The team filter, listing only the teams the user owns (superusers: all)."""

    def field_choices(self, field, request, model_admin):
        return [(team.pk, str(team)) for team in teams_owned_by(user=request.user)]


class OwnedTeamsAdmin(admin.ModelAdmin):
    """Rows of the teams the user owns (superusers: every row); a team picked in a form must
    be one of them."""

    def get_queryset(self, request):
        rows = super().get_queryset(request)
        if request.user.is_superuser:
            return rows
        return rows.filter(team__in=teams_owned_by(user=request.user))

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        if db_field.name == "team":
            kwargs["queryset"] = teams_owned_by(user=request.user)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)


class BudgetForm(forms.ModelForm):
    by_superuser = False  # set per request (BudgetAdmin.get_form)

    class Meta:
        model = Budget
        fields = [
            "team",
            "scope",
            "user",
            "api_key",
            "unit",
            "amount",
            "period",
            "starts_on",
            "ends_on",
            "alert_thresholds",
        ]

    def clean_scope(self):
        scope = self.cleaned_data["scope"]
        if scope == Budget.Scope.TEAM and not self.by_superuser:
            raise forms.ValidationError(ERROR_TEAM_BUDGET_BY_SUPERUSER)
        return scope


def budget_use_text(budget: Budget) -> str:
    """ "1,200 of 50,000 tokens (48,800 left)" for the budget's current (or only) period."""
    today = timezone.now().date()
    if budget.period == Budget.Period.CUSTOM and not (budget.starts_on <= today <= budget.ends_on):
        when = "not started" if today < budget.starts_on else "ended"
        return f"- ({when})"
    limit = budget_limit(budget, today)
    used = budget_used(limit)
    left = max(0, limit.limit - used)
    if limit.unit == TOKENS:
        return f"{used:,} of {limit.limit:,} tokens ({left:,} left)"
    return f"{format_money(used)} of {format_money(limit.limit)} ({format_money(left)} left)"


@admin.register(Budget)
class BudgetAdmin(OwnedTeamsAdmin):
    form = BudgetForm
    list_display = ["subject", "team", "scope", "unit", "limit", "period_text", "used_now"]
    list_filter = ["scope", "unit", "period", ("team", OwnedTeamFilter)]
    list_select_related = ["team", "user", "api_key"]
    search_fields = ["team__name", "user__username", "api_key__prefix"]
    raw_id_fields = ["user", "api_key"]

    def get_form(self, request, obj=None, **kwargs):
        form = super().get_form(request, obj, **kwargs)
        form.by_superuser = request.user.is_superuser
        return form

    def _may_change(self, request, obj) -> bool:
        return request.user.is_superuser or obj is None or obj.scope != Budget.Scope.TEAM

    def has_change_permission(self, request, obj=None):
        return super().has_change_permission(request, obj) and self._may_change(request, obj)

    def has_delete_permission(self, request, obj=None):
        return super().has_delete_permission(request, obj) and self._may_change(request, obj)

    @admin.display(description="budget of", ordering="team__name")
    def subject(self, obj: Budget) -> str:
        return obj.subject

    @admin.display(description="limit", ordering="amount")
    def limit(self, obj: Budget) -> str:
        if obj.unit == Budget.Unit.TOKENS:
            return f"{int(obj.amount):,} tokens"
        return format_money(to_nanos(obj.amount))

    @admin.display(description="period", ordering="period")
    def period_text(self, obj: Budget) -> str:
        if obj.period == Budget.Period.MONTHLY:
            return "monthly"
        return f"{obj.starts_on} to {obj.ends_on}"

    @admin.display(description="used (finished requests)")
    def used_now(self, obj: Budget) -> str:
        return budget_use_text(obj)


@admin.register(BudgetAlert)
class BudgetAlertAdmin(OwnedTeamsAdmin):
    list_display = ["created_at", "description", "threshold_text", "used_text", "emailed"]
    list_filter = ["scope", "unit", ("team", OwnedTeamFilter)]
    list_select_related = ["team"]
    readonly_fields = [f.name for f in BudgetAlert._meta.fields]

    @admin.display(description="threshold", ordering="threshold")
    def threshold_text(self, obj: BudgetAlert) -> str:
        return f"{obj.threshold}%"

    @admin.display(description="used of the budget")
    def used_text(self, obj: BudgetAlert) -> str:
        if obj.unit == Budget.Unit.TOKENS:
            return f"{int(obj.used):,} of {int(obj.limit):,} tokens"
        return f"{obj.used.normalize():f} of {obj.limit.normalize():f} {obj.currency}"

    @admin.display(description="emailed to")
    def emailed(self, obj: BudgetAlert) -> str:
        return obj.emailed_to or f"not sent: {obj.email_error}"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class DeliveryInline(admin.TabularInline):
    model = WebhookDelivery
    fields = ["created_at", "alert", "status", "attempts", "last_status_code", "last_error"]
    readonly_fields = fields
    extra = 0
    max_num = 0
    can_delete = False
    ordering = ["-created_at"]
    verbose_name_plural = "deliveries (the full log: Webhook deliveries)"

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("alert")


@admin.register(AlertWebhook)
class AlertWebhookAdmin(OwnedTeamsAdmin):
    """Superusers add and change webhooks (the server POSTs to whatever URL one names); a team's
    staff owner sees the team's, with its secret and its deliveries."""

    list_display = ["url", "team", "enabled", "created_at"]
    list_filter = ["enabled", ("team", OwnedTeamFilter)]
    fields = ["team", "url", "secret", "enabled"]
    inlines = [DeliveryInline]

    def get_queryset(self, request):
        return super().get_queryset(request).select_related("team")

    def has_add_permission(self, request):
        return request.user.is_superuser

    def has_change_permission(self, request, obj=None):
        return request.user.is_superuser

    def has_delete_permission(self, request, obj=None):
        return request.user.is_superuser


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(admin.ModelAdmin):
    list_display = [
        "created_at",
        "webhook",
        "alert",
        "status",
        "attempts",
        "last_status_code",
        "short_error",
        "next_attempt_at",
    ]
    list_filter = ["status"]
    list_select_related = ["webhook", "webhook__team", "alert"]
    readonly_fields = ["webhook", "alert", "status", "attempts", "attempt_log", "body"]
    fields = readonly_fields
    actions = ["retry_now"]

    def get_queryset(self, request):
        rows = super().get_queryset(request)
        if request.user.is_superuser:
            return rows
        return rows.filter(webhook__team__in=teams_owned_by(user=request.user))

    @admin.display(description="last error")
    def short_error(self, obj: WebhookDelivery) -> str:
        return obj.last_error[:80] + ("…" if len(obj.last_error) > 80 else "")

    @admin.display(description="attempts (time, status code, error, milliseconds)")
    def attempt_log(self, obj: WebhookDelivery):
        rows = [
            (entry["at"], entry["status_code"] or "-", entry["error"] or "ok", entry["ms"])
            for entry in obj.log
        ]
        return format_html_join("\n", "<div>{} · {} · {} · {} ms</div>", rows) or "-"

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_retry_permission(self, request):
        return self.has_view_permission(request)

    @admin.action(
        description="Retry selected deliveries now (one more attempt)", permissions=["retry"]
    )
    def retry_now(self, request, queryset):
        count = queryset.exclude(status=WebhookDelivery.Status.DELIVERED).update(
            status=WebhookDelivery.Status.PENDING,
            next_attempt_at=timezone.now(),
            claimed_until=None,
        )
        alert_worker.submit(deliveries=True)
        self.message_user(request, f"Retrying {count} deliveries.", messages.SUCCESS)
