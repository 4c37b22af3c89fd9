"""Admin for teams, memberships and API keys.

A new or rotated key's raw value is rendered once, in the response to the request that created it
(never through messages, sessions or any other store), with `Cache-Control: no-store`. Keys are
revoked, never deleted (usage rows refer to them). Staff who are not superusers manage only the
teams they own; a member sees their own keys read-only (accounts.selectors). Searches never echo a
raw key: one pasted into a search box is cut to its prefix before the page is built.
"""

import uuid
from datetime import timedelta

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.views.main import SEARCH_VAR
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers

from accounts import keys
from accounts.models import (
    DEFAULT_SERVICE_TIERS,
    ApiKey,
    ApiKeyMonthlyUsage,
    Membership,
    Team,
    default_service_tiers,
)
from accounts.selectors import (
    api_keys_managed_by,
    api_keys_visible_to,
    teams_owned_by,
    teams_visible_to,
)
from accounts.services import (
    api_key_create,
    api_key_revoke,
    api_key_rotate,
    service_tiers_ordered,
)

ERROR_NOT_A_MEMBER = "The key's user must be a member of the team."
ERROR_PRIORITY_BY_SUPERUSER = (
    "Only a superuser grants the priority tier: its requests go before every other team's."
)
SERVICE_TIER_CHOICES = [
    ("priority", "priority: served first, ahead of the other tiers"),
    ("default", "default"),
    ("flex", "flex: served after the other tiers"),
]
SHOW_ONCE_TEMPLATE = "admin/accounts/apikey/show_once.html"
ERROR_ALREADY_CREATED = (
    "This form was already submitted: it created key {prefix}…, whose secret was shown once. "
    "Rotate that key if the secret was lost; open a new form to create another key."
)
MESSAGE_SEARCH_REDACTED = (
    "Searched by the key's prefix. Search with the prefix the admin shows (sk-orch-XXXXXXXX), not "
    "the whole key: a URL holding a key ends up in logs and browser history."
)


def owns_team(user, team_id: int | None) -> bool:
    """Whether the user owns the team, or any team when `team_id` is None (the changelist asks
    before there is an object)."""
    owned = teams_owned_by(user=user)
    return (owned if team_id is None else owned.filter(pk=team_id)).exists()


class KeySearchMixin:
    """For changelists searchable by key. A search holding a raw key is redirected to the same
    search by the key's prefix, so the secret is not echoed in the search box, pagination and
    filter links, or the changelist filters that later redirects carry."""

    def changelist_view(self, request, extra_context=None):
        term = request.GET.get(SEARCH_VAR, "")
        if request.method == "GET" and keys.redact_keys(term) != term:
            query = request.GET.copy()
            query[SEARCH_VAR] = keys.redact_keys(term)
            self.message_user(request, MESSAGE_SEARCH_REDACTED, messages.WARNING)
            return HttpResponseRedirect(f"{request.path}?{query.urlencode()}")
        return super().changelist_view(request, extra_context)


def show_once_response(request, created: list[tuple[ApiKey, str]], *, title: str):
    response = TemplateResponse(
        request,
        SHOW_ONCE_TEMPLATE,
        {
            **admin.site.each_context(request),
            "title": title,
            "created": created,
            "opts": ApiKey._meta,
        },
    )
    add_never_cache_headers(response)  # includes no-store: the page must not be kept anywhere
    return response


class ReadOnlyAdmin(admin.ModelAdmin):
    """For records the application writes (usage, roll-ups, stored responses): shown, never
    added, changed or deleted by hand."""

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class VisibleTeamFilter(admin.RelatedFieldListFilter):
    """A team filter that lists only the teams the user may see."""

    def field_choices(self, field, request, model_admin):
        return [(team.pk, str(team)) for team in teams_visible_to(user=request.user)]


class MembershipInline(admin.TabularInline):
    model = Membership
    extra = 1
    autocomplete_fields = ["user"]


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    list_display = ["name", "weight", "created_at"]
    search_fields = ["name"]
    inlines = [MembershipInline]

    def get_queryset(self, request):
        return teams_owned_by(user=request.user)

    def get_readonly_fields(self, request, obj=None):
        # A team owner who is staff edits their team here, but not the storage it may use nor
        # its share of the engine (both are taken from the other teams).
        if request.user.is_superuser:
            return ()
        return ("response_storage_bytes", "weight")


@admin.register(Membership)
class MembershipAdmin(admin.ModelAdmin):
    list_display = ["user", "team", "role", "created_at"]
    list_filter = ["role", ("team", VisibleTeamFilter)]
    search_fields = ["user__username", "team__name"]
    autocomplete_fields = ["user", "team"]

    def get_queryset(self, request):
        return (
            super()
            .get_queryset(request)
            .filter(team__in=teams_owned_by(user=request.user))
            .select_related("user", "team")
        )

    def formfield_for_foreignkey(self, db_field, request, **kwargs):
        # Autocomplete only narrows the suggestions; this narrows what the form accepts, or a
        # posted team id would make its poster a member (or owner) of any team.
        if db_field.name == "team":
            kwargs["queryset"] = teams_owned_by(user=request.user)
        return super().formfield_for_foreignkey(db_field, request, **kwargs)

    def has_add_permission(self, request):
        return super().has_add_permission(request) and owns_team(request.user, None)

    def has_change_permission(self, request, obj=None):
        return super().has_change_permission(request, obj) and owns_team(
            request.user, obj.team_id if obj else None
        )

    def has_delete_permission(self, request, obj=None):
        return super().has_delete_permission(request, obj) and owns_team(
            request.user, obj.team_id if obj else None
        )


class ModelNamesField(forms.CharField):
    def prepare_value(self, value):
        return ", ".join(value) if isinstance(value, list | tuple) else value

    def to_python(self, value):
        return sorted({name.strip() for name in (value or "").split(",") if name.strip()})


def _new_creation_token() -> str:
    return uuid.uuid4().hex


class ApiKeyForm(forms.ModelForm):
    allowed_models = ModelNamesField(
        required=False,
        help_text="Comma-separated model names; used when 'all models' is off.",
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
            "expires_at",
            "reads_usage",
            "service_tiers",
        ]

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
        return [*self.readonly_fields, "team", "user"] if obj else self.readonly_fields

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
            user=data["user"],
            team=data["team"],
            name=data["name"],
            models=None if data["all_models"] else data["allowed_models"],
            rpm=data["rpm"],
            tpm=data["tpm"],
            max_parallel=data["max_parallel"],
            budget_tokens=data["budget_tokens"],
            expires_at=data["expires_at"],
            reads_usage=data.get("reads_usage", False),
            service_tiers=data["service_tiers"],
            created_by=request.user,
            creation_token=data.get("submission_token") or None,
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
