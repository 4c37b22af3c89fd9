"""The API keys' admin: the key form (models, tiers, a token that makes a resubmitted form
refused rather than a second key), the status and expiry filters, the key list with its revoke
and rotate actions, and the monthly usage per key. A key created or rotated here is shown once
(common.show_once_response); keys are revoked, never deleted.
"""

import uuid
from datetime import timedelta

from django import forms
from django.contrib import admin, messages
from django.utils import timezone
from django.utils.html import format_html_join
from django.utils.safestring import mark_safe

from accounts import keys
from accounts.admin.common import (
    KeySearchMixin,
    ModelPickerField,
    ReadOnlyAdmin,
    VisibleTeamFilter,
    owns_team,
    show_once_response,
)
from accounts.limits import key_use
from accounts.models import (
    DEFAULT_SERVICE_TIERS,
    ApiKey,
    ApiKeyMonthlyUsage,
    Membership,
    default_service_tiers,
)
from accounts.selectors import api_keys_managed_by, api_keys_visible_to, teams_owned_by
from accounts.services import api_key_create, api_key_revoke, api_key_rotate, service_tiers_ordered

ERROR_NOT_A_MEMBER = "The key's user must be a member of the team."
ERROR_PRIORITY_BY_SUPERUSER = (
    "Only a superuser grants the priority tier: its requests go before every other team's."
)
SERVICE_TIER_CHOICES = [
    ("priority", "priority: served first, ahead of the other tiers"),
    ("default", "default"),
    ("flex", "flex: served after the other tiers"),
]
ERROR_ALREADY_CREATED = (
    "This form was already submitted: it created key {prefix}…, whose secret was shown once. "
    "Rotate that key if the secret was lost; open a new form to create another key."
)


def _new_creation_token() -> str:
    return uuid.uuid4().hex


class ApiKeyForm(forms.ModelForm):
    allowed_models = ModelPickerField(
        required=False, help_text="The models the key may use when 'all models' is off."
    )
    service_tiers = forms.MultipleChoiceField(
        choices=SERVICE_TIER_CHOICES,
        widget=forms.CheckboxSelectMultiple,
        initial=default_service_tiers,
        help_text="Tiers the key's requests may ask for (service_tier); a request that asks "
        "for none gets default, else flex, else priority.",
    )
    # Set per request by the admin (get_form): whether this user may add the priority tier.
    may_grant_priority = False
    # Not the model field's name: the admin would then treat it as a (non-editable) model field.
    submission_token = forms.CharField(
        widget=forms.HiddenInput, required=False, initial=_new_creation_token
    )

    class Meta:
        model = ApiKey
        fields = [
            "name",
            "team",
            "user",
            "all_models",
            "allowed_models",
            "rpm",
            "tpm",
            "max_parallel",
            "budget_tokens",
            "max_output_tokens",
            "expires_at",
            "reads_usage",
            "service_tiers",
        ]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["allowed_models"].offer(self.instance.allowed_models or ())
        expiry = self.fields.get("expires_at")
        if expiry is not None and isinstance(expiry.widget, forms.MultiWidget):
            # The admin's date and time boxes are labelled by plain text: name them.
            for widget, part in zip(expiry.widget.widgets, ("date", "time"), strict=False):
                widget.attrs["aria-label"] = f"Expires at ({part})"

    def clean_service_tiers(self) -> list[str]:
        tiers = service_tiers_ordered(self.cleaned_data["service_tiers"])
        had = not self.instance._state.adding and "priority" in self.instance.service_tiers
        if "priority" in tiers and not had and not self.may_grant_priority:
            raise forms.ValidationError(ERROR_PRIORITY_BY_SUPERUSER)
        return tiers

    def clean(self):
        cleaned = super().clean()
        token = cleaned.get("submission_token")
        if self.instance._state.adding and token:
            existing = ApiKey.objects.filter(creation_token=token).first()
            if existing is not None:
                raise forms.ValidationError(ERROR_ALREADY_CREATED.format(prefix=existing.prefix))
        team, user = cleaned.get("team"), cleaned.get("user")
        if team and user and not Membership.objects.filter(team=team, user=user).exists():
            raise forms.ValidationError(ERROR_NOT_A_MEMBER)
        if not cleaned.get("all_models") and not cleaned.get("allowed_models"):
            self.add_error("allowed_models", "Name at least one model, or allow all models.")
        return cleaned


def key_arguments(data: dict) -> dict:
    """api_key_create's arguments from a valid ApiKeyForm's data, but the user, the team and
    the creator."""
    return {
        "name": data["name"],
        "models": None if data["all_models"] else data["allowed_models"],
        "rpm": data["rpm"],
        "tpm": data["tpm"],
        "max_parallel": data["max_parallel"],
        "budget_tokens": data["budget_tokens"],
        "max_output_tokens": data["max_output_tokens"],
        "expires_at": data["expires_at"],
        "reads_usage": data.get("reads_usage", False),
        "service_tiers": data["service_tiers"],
        "creation_token": data.get("submission_token") or None,
    }


class StatusFilter(admin.SimpleListFilter):
    title = "status"
    parameter_name = "status"

    def lookups(self, request, model_admin):
        return [("active", "Active"), ("revoked", "Revoked"), ("expired", "Expired")]

    def queryset(self, request, queryset):
        now = timezone.now()
        if self.value() == "active":
            return queryset.active()
        if self.value() == "revoked":
            return queryset.filter(revoked_at__isnull=False)
        if self.value() == "expired":
            return queryset.filter(revoked_at__isnull=True, expires_at__lte=now)
        return queryset


class ExpiryFilter(admin.SimpleListFilter):
    title = "expiry"
    parameter_name = "expiry"

    def lookups(self, request, model_admin):
        return [("never", "Never expires"), ("7d", "Within 7 days"), ("past", "Already expired")]

    def queryset(self, request, queryset):
        now = timezone.now()
        if self.value() == "never":
            return queryset.filter(expires_at__isnull=True)
        if self.value() == "7d":
            return queryset.filter(expires_at__gt=now, expires_at__lte=now + timedelta(days=7))
        if self.value() == "past":
            return queryset.filter(expires_at__lte=now)
        return queryset


@admin.register(ApiKey)
class ApiKeyAdmin(KeySearchMixin, admin.ModelAdmin):
    form = ApiKeyForm
    list_display = [
        "displayed_prefix",
        "name",
        "team",
        "user",
        "status",
        "models",
        "limits",
        "last_used_at",
    ]
    list_filter = [StatusFilter, ExpiryFilter, ("team", VisibleTeamFilter)]
    search_fields = ["prefix", "name", "user__username", "team__name"]
    list_select_related = ["team", "user"]
    actions = ["revoke_keys", "rotate_keys"]
    readonly_fields = ["displayed_prefix", "created_by", "created_at", "revoked_at", "last_used_at"]

    def get_queryset(self, request):
        return api_keys_visible_to(user=request.user).select_related("team", "user")

    def get_readonly_fields(self, request, obj=None):
        # A key's team and user are part of its identity for usage and budgets.
        if obj is None:
            return self.readonly_fields
        return [*self.readonly_fields, "team", "user", "used"]

    def get_fields(self, request, obj=None):
        # What the key used, right under its limits.
        fields = [name for name in super().get_fields(request, obj) if name != "used"]
        if obj is not None:
            fields.insert(
                fields.index("budget_tokens") + 1 if "budget_tokens" in fields else 0, "used"
            )
        return fields

    @admin.display(description="used now")
    def used(self, obj: ApiKey) -> str:
        return format_html_join(mark_safe("<br>"), "{}", ((p,) for p in key_use(obj).phrases()))

    def get_form(self, request, obj=None, **kwargs):
        form = super().get_form(request, obj, **kwargs)
        form.may_grant_priority = request.user.is_superuser  # a class made for this request
        if "team" in form.base_fields:
            owned = teams_owned_by(user=request.user)
            form.base_fields["team"].queryset = owned
            users = form.base_fields["user"].queryset
            form.base_fields["user"].queryset = users.filter(memberships__team__in=owned).distinct()
        return form

    def get_search_results(self, request, queryset, search_term):
        term = search_term.strip().rstrip("…")
        if term.startswith(keys.KEY_PREFIX):
            return queryset.filter(prefix__startswith=keys.lookup_prefix(term)), False
        return super().get_search_results(request, queryset, search_term)

    def has_change_permission(self, request, obj=None):
        # Members see their own keys, but a key's limits, models and state are the owners' call.
        return super().has_change_permission(request, obj) and owns_team(
            request.user, obj.team_id if obj else None
        )

    def has_delete_permission(self, request, obj=None):
        return False

    @admin.display(description="key", ordering="prefix")
    def displayed_prefix(self, obj: ApiKey) -> str:
        return f"{obj.prefix}…" if obj.prefix else "-"

    @admin.display(description="status")
    def status(self, obj: ApiKey) -> str:
        if obj.is_revoked:
            return "revoked"
        return "expired" if obj.is_expired else "active"

    @admin.display(description="limits")
    def limits(self, obj: ApiKey) -> str:
        parts = [
            f"{label} {value:,}"
            for label, value in (
                ("rpm", obj.rpm),
                ("tpm", obj.tpm),
                ("parallel", obj.max_parallel),
                ("budget", obj.budget_tokens),
                ("output", obj.max_output_tokens),
            )
            if value is not None
        ]
        if list(obj.service_tiers) != list(DEFAULT_SERVICE_TIERS):
            # Only where the key differs from the default tiers (the list stays narrow).
            parts.append("tiers " + ", ".join(obj.service_tiers))
        return " · ".join(parts) or "none"

    @admin.display(description="models")
    def models(self, obj: ApiKey) -> str:
        return "all" if obj.all_models else ", ".join(obj.allowed_models)

    def save_model(self, request, obj, form, change):
        if change:
            super().save_model(request, obj, form, change)
            return
        data = form.cleaned_data
        api_key, raw_key = api_key_create(
            user=data["user"], team=data["team"], created_by=request.user, **key_arguments(data)
        )
        # The admin logs and redirects with `obj`; make it the key the service created.
        for field in ApiKey._meta.concrete_fields:
            setattr(obj, field.attname, getattr(api_key, field.attname))
        obj._state.adding = False
        obj._state.db = api_key._state.db
        # Lives only on this request object, until response_add renders it.
        request.orchard_created_keys = [(obj, raw_key)]

    def response_add(self, request, obj, post_url_continue=None):
        return show_once_response(
            request, request.orchard_created_keys, title="New API key: copy it now"
        )

    @admin.action(description="Revoke selected keys", permissions=["change"])
    def revoke_keys(self, request, queryset):
        count = 0
        managed = queryset & api_keys_managed_by(user=request.user)
        for api_key in managed.filter(revoked_at__isnull=True):
            api_key_revoke(api_key=api_key)
            count += 1
        self.message_user(request, f"Revoked {count} key(s).", messages.SUCCESS)

    @admin.action(
        description="Rotate selected keys (revoke, issue a replacement)", permissions=["change"]
    )
    def rotate_keys(self, request, queryset):
        managed = queryset & api_keys_managed_by(user=request.user)
        created = [
            api_key_rotate(api_key=api_key, created_by=request.user)
            for api_key in managed.filter(revoked_at__isnull=True)
        ]
        if not created:
            self.message_user(request, "Only active keys can be rotated.", messages.WARNING)
            return None
        return show_once_response(request, created, title="Rotated API keys: copy them now")


@admin.register(ApiKeyMonthlyUsage)
class ApiKeyMonthlyUsageAdmin(KeySearchMixin, ReadOnlyAdmin):
    list_display = ["month", "api_key", "tokens"]
    list_filter = ["month"]
    search_fields = ["api_key__prefix", "api_key__name"]
    list_select_related = ["api_key", "api_key__user"]

    def get_queryset(self, request):
        keys = api_keys_visible_to(user=request.user)
        return super().get_queryset(request).filter(api_key__in=keys)
