"""Inviting a member: who may, the invite form (the account and the membership), its key half
(the key form without the team and user the invite names), and the page that shows the new key
and a set-password link once. The view itself is TeamAdmin's (teams.py), under the team's URLs.
"""

from django import forms
from django.contrib import admin
from django.contrib.admin.widgets import AdminSplitDateTime
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.contrib.auth.tokens import default_token_generator
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.cache import add_never_cache_headers
from django.utils.encoding import force_bytes
from django.utils.http import urlsafe_base64_encode

from accounts.admin.api_keys import ApiKeyForm
from accounts.admin.common import owns_team
from accounts.models import ApiKey, Membership, Team
from accounts.services import Invitation

INVITE_TEMPLATE = "admin/accounts/team/invite.html"
INVITED_TEMPLATE = "admin/accounts/team/invited.html"
ERROR_PASSWORD_OF_EXISTING = (
    "{username} already has an account: leave the password empty (it stays theirs)."
)
ERROR_ADDS_NO_USERS = (
    "There is no account {username}, and you may not create accounts: ask an administrator, "
    "or invite an existing user."
)


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
