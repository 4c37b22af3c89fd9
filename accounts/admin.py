"""Admin for teams, memberships and API keys.

A new or rotated key's raw value is rendered once, in the response to the request that created it
(never through messages, sessions or any other store), with `Cache-Control: no-store`. Keys are
revoked, never deleted (usage rows refer to them). Staff who are not superusers manage only the
teams they own; a member sees their own keys read-only (accounts.selectors). Searches never echo a
raw key: one pasted into a search box is cut to its prefix before the page is built.
"""

import uuid
from collections.abc import Callable, Iterable
from datetime import timedelta

from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.contrib.admin.views.main import SEARCH_VAR
from django.contrib.admin.widgets import AdminSplitDateTime
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.contrib.auth.tokens import default_token_generator
from django.core.exceptions import PermissionDenied
from django.http import HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.cache import add_never_cache_headers
from django.utils.encoding import force_bytes
from django.utils.html import format_html_join
from django.utils.http import urlsafe_base64_encode
from django.utils.safestring import mark_safe

from accounts import budgets_admin, keys  # noqa: F401  (budgets_admin registers its admins)
from accounts.limits import key_use
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
    Invitation,
    api_key_create,
    api_key_revoke,
    api_key_rotate,
    member_invite,
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
INVITE_TEMPLATE = "admin/accounts/team/invite.html"
INVITED_TEMPLATE = "admin/accounts/team/invited.html"
ERROR_PASSWORD_OF_EXISTING = (
    "{username} already has an account: leave the password empty (it stays theirs)."
)
ERROR_ADDS_NO_USERS = (
    "There is no account {username}, and you may not create accounts: ask an administrator, "
    "or invite an existing user."
)
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


# What the model pickers offer: accounts holds model names but cannot read the registry
# (docs/architecture.md), so inference's admin hands it a reader (inference/admin/pickers.py).
_model_names: Callable[[], Iterable[str]] = tuple


def model_names_source(source: Callable[[], Iterable[str]]) -> None:
    """Where the model pickers take the registered models' names from."""
    global _model_names
    _model_names = source


class ModelPickerField(forms.MultipleChoiceField):
    """Model names as checkboxes of the registered models: a name that is not one is refused.
    `offer` adds the names a value already holds, so that a model removed from the registry
    still shows (ticked) on the keys and teams that name it, and can be unticked."""

    widget = forms.CheckboxSelectMultiple

    def offer(self, held: Iterable[str] = ()) -> None:
        names = sorted({*_model_names(), *held})
        self.choices = [(name, name) for name in names]
        if not names:
            self.help_text = f"{self.help_text} No model is registered yet.".strip()

    def to_python(self, value) -> list[str]:
        return [name for name in super().to_python(value) if name]  # "" from an empty post

    def clean(self, value) -> list[str]:
        return sorted(set(super().clean(value)))


class TeamForm(forms.ModelForm):
    member_key_models = ModelPickerField(
        required=False,
        label="Models of keys members create",
        help_text="None ticked: every model.",
    )

    class Meta:
        model = Team
        fields = [
            "name",
            "members_manage_keys",
            "member_key_models",
            "member_key_rpm",
            "member_key_tpm",
            "member_key_budget_tokens",
            "response_storage_bytes",
            "weight",
        ]

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["member_key_models"].offer(self.instance.member_key_models or ())


class LabelledInlineFormSet(forms.BaseInlineFormSet):
    """A tabular inline's inputs sit under column headings, with no label of their own: each
    gets its field's name as its accessible name (screen readers, axe-core)."""

    def add_fields(self, form, index):
        super().add_fields(form, index)
        for field in form.fields.values():
            field.widget.attrs.setdefault("aria-label", str(field.label))


class MembershipInline(admin.TabularInline):
    model = Membership
    formset = LabelledInlineFormSet
    extra = 1
    # Not autocomplete: its select2 box has no accessible name (the user's id, with a lookup).
    raw_id_fields = ["user"]


@admin.register(Team)
class TeamAdmin(admin.ModelAdmin):
    form = TeamForm
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

    def get_urls(self):
        invite = path(
            "invite/", self.admin_site.admin_view(self.invite_view), name="accounts_team_invite"
        )
        return [invite, *super().get_urls()]

    def invite_view(self, request):
        """One screen for a new member: the account, the membership and the first key, made
        together (accounts.services.member_invite); the key and a set-password link are then
        shown once."""
        if not may_invite(request.user):
            raise PermissionDenied
        teams = teams_owned_by(user=request.user)
        may_add_users = request.user.has_perm("auth.add_user")
        key_form_class = invite_key_form(may_grant_priority=request.user.is_superuser)
        if request.method == "POST":
            form = InviteForm(request.POST, teams=teams, may_add_users=may_add_users)
            key_form = key_form_class(request.POST, prefix="key")
            if form.is_valid() and (not form.cleaned_data["issue_key"] or key_form.is_valid()):
                data = form.cleaned_data
                invitation = member_invite(
                    team=data["team"],
                    username=data["username"],
                    email=data["email"],
                    password=data["password"] or None,
                    role=data["role"],
                    key=key_arguments(key_form.cleaned_data) if data["issue_key"] else None,
                    created_by=request.user,
                )
                return invited_response(request, invitation)
        else:
            form = InviteForm(
                initial={"team": request.GET.get("team")}, teams=teams, may_add_users=may_add_users
            )
            key_form = key_form_class(prefix="key")
        context = {
            **self.admin_site.each_context(request),
            "title": "Invite a member",
            "opts": Team._meta,
            "form": form,
            "key_form": key_form,
            # Laid out as the admin lays out its own forms.
            "fieldsets": [
                helpers.AdminForm(form, [("Member", {"fields": list(form.fields)})], {}),
                helpers.AdminForm(
                    key_form, [("Their API key", {"fields": list(key_form.fields)})], {}
                ),
            ],
            "media": self.media + form.media + key_form.media,
        }
        return TemplateResponse(request, INVITE_TEMPLATE, context)


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


def may_invite(user) -> bool:
    """Staff who may add memberships and keys, in a team they own (superusers: any team)."""
    perms = ("accounts.add_membership", "accounts.add_apikey")
    return user.has_perms(perms) and owns_team(user, None)


class InviteForm(forms.Form):
    team = forms.ModelChoiceField(queryset=Team.objects.none())
    username = forms.CharField(
        max_length=150, help_text="An existing account, or a new one made now."
    )
    email = forms.EmailField(required=False, help_text="For a new account.")
    password = forms.CharField(
        required=False,
        strip=False,
        widget=forms.PasswordInput(attrs={"autocomplete": "new-password"}),
        help_text="For a new account. Empty: the next page shows a one-time link where they "
        "set their own.",
    )
    role = forms.ChoiceField(choices=Membership.Role.choices, initial=Membership.Role.MEMBER)
    issue_key = forms.BooleanField(required=False, initial=True, label="Issue an API key")

    def __init__(self, *args, teams, may_add_users: bool, **kwargs):
        super().__init__(*args, **kwargs)
        self.fields["team"].queryset = teams
        self.may_add_users = may_add_users

    def clean_username(self) -> str:
        username = self.cleaned_data["username"].strip()
        get_user_model().username_validator(username)
        return username

    def clean(self):
        cleaned = super().clean()
        username, password = cleaned.get("username"), cleaned.get("password")
        if not username:
            return cleaned
        user_model = get_user_model()
        if user_model.objects.filter(username=username).exists():
            if password:
                self.add_error("password", ERROR_PASSWORD_OF_EXISTING.format(username=username))
        elif not self.may_add_users:
            self.add_error("username", ERROR_ADDS_NO_USERS.format(username=username))
        elif password:
            try:
                validate_password(password, user_model(username=username))
            except forms.ValidationError as exc:
                self.add_error("password", exc)
        return cleaned


def invite_key_form(*, may_grant_priority: bool) -> type[ApiKeyForm]:
    """The key's half of the invite form: the key form without its team and user (the invite
    names them)."""
    form = forms.modelform_factory(
        ApiKey,
        form=ApiKeyForm,
        fields=[
            "name",
            "all_models",
            "allowed_models",
            "rpm",
            "tpm",
            "max_parallel",
            "budget_tokens",
            "max_output_tokens",
            "expires_at",
            "service_tiers",
        ],
        widgets={"expires_at": AdminSplitDateTime},
        field_classes={"expires_at": forms.SplitDateTimeField},
    )
    form.may_grant_priority = may_grant_priority
    return form


def invited_response(request, invitation: Invitation):
    """The invite's result, with the key's secret and the set-password link: like a new key's
    page, rendered once and never stored."""
    user = invitation.user
    password_link = None
    if not user.has_usable_password():
        uid = urlsafe_base64_encode(force_bytes(user.pk))
        token = default_token_generator.make_token(user)
        password_link = request.build_absolute_uri(reverse("web-password-set", args=[uid, token]))
    response = TemplateResponse(
        request,
        INVITED_TEMPLATE,
        {
            **admin.site.each_context(request),
            "title": f"{user} invited to {invitation.membership.team}",
            "opts": Team._meta,
            "invitation": invitation,
            "password_link": password_link,
            "base_url": request.build_absolute_uri("/v1").rstrip("/"),
        },
    )
    add_never_cache_headers(response)
    return response
