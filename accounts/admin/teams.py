"""The teams' and memberships' admin: a team with its members inline and its invite page (one
screen for a new member's account, membership and first key; invites.py holds its parts), and
the membership list. Staff who are not superusers manage only the teams they own, and not a
team's storage or weight.
"""

from django import forms
from django.contrib import admin
from django.contrib.admin import helpers
from django.core.exceptions import PermissionDenied
from django.template.response import TemplateResponse
from django.urls import path

from accounts.admin.api_keys import key_arguments
from accounts.admin.common import ModelPickerField, VisibleTeamFilter, owns_team
from accounts.admin.invites import (
    INVITE_TEMPLATE,
    InviteForm,
    invite_key_form,
    invited_response,
    may_invite,
)
from accounts.models import Membership, Team
from accounts.selectors import teams_owned_by
from accounts.services import member_invite


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
