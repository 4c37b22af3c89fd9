"""Inviting a member on one admin screen: the account, its membership and its first key made
together (or not at all), the key and a one-time set-password link shown once; who may invite
whom; and the member setting their password by that link."""

import re

import pytest
from django.contrib.auth import get_user_model
from django.contrib.auth.models import Permission
from django.urls import reverse

from accounts.admin import ERROR_ADDS_NO_USERS, ERROR_PASSWORD_OF_EXISTING
from accounts.authentication import authenticate_header
from accounts.models import ApiKey, Membership
from tests.factories import (
    MembershipFactory,
    ModelEntryFactory,
    StaffUserFactory,
    TeamFactory,
    UserFactory,
)

pytestmark = pytest.mark.django_db

INVITE = reverse("admin:accounts_team_invite")


def invite_form(team, username="newbie", **overrides):
    return {
        "team": team.pk,
        "username": username,
        "email": "",
        "password": "",
        "role": "member",
        "issue_key": "on",
        "key-name": "first key",
        "key-all_models": "",
        "key-allowed_models": ["tiny"],
        "key-rpm": "30",
        "key-max_parallel": "2",
        "key-budget_tokens": "100000",
        "key-service_tiers": ["default", "flex"],
        **overrides,
    }


def test_one_screen_makes_the_account_membership_and_key(client):
    ModelEntryFactory(name="tiny")
    team = TeamFactory()
    client.force_login(StaffUserFactory())
    page = client.get(f"{INVITE}?team={team.pk}").content.decode()
    assert re.search(rf'<option value="{team.pk}" selected>', page)
    assert 'name="key-allowed_models" value="tiny"' in page

    response = client.post(INVITE, invite_form(team))
    assert response.status_code == 200 and "no-store" in response["Cache-Control"]
    user = get_user_model().objects.get(username="newbie")
    assert not user.has_usable_password()
    assert Membership.objects.get(user=user, team=team).role == "member"
    api_key = ApiKey.objects.get(user=user)
    assert (api_key.allowed_models, api_key.rpm, api_key.budget_tokens) == (["tiny"], 30, 100000)
    raw_key = response.context["invitation"].raw_key
    assert authenticate_header(f"Bearer {raw_key}") == api_key
    page = response.content.decode()
    assert raw_key in page and 'data-copy-from="raw-key"' in page
    link = response.context["password_link"]
    assert link in page and 'data-copy-from="password-link"' in page

    # The member sets their password by the link, once.
    set_page = client.get(link, follow=True)
    assert set_page.context["validlink"]
    new_password = "a-long-new-password"
    done = client.post(
        set_page.redirect_chain[-1][0],
        {"new_password1": new_password, "new_password2": new_password},
        follow=True,
    )
    assert done.redirect_chain[-1][0] == reverse("web-password-set-done")
    user.refresh_from_db()
    assert user.check_password(new_password)
    assert not client.get(link, follow=True).context["validlink"]


def test_an_invite_that_fails_makes_nothing(client):
    team = TeamFactory()
    existing = UserFactory(username="known")
    client.force_login(StaffUserFactory())
    # A password for an existing account is refused; a key form error keeps the account unmade.
    refused = client.post(INVITE, invite_form(team, "known", password="a-long-new-password"))
    assert refused.context["form"].errors["password"] == [
        ERROR_PASSWORD_OF_EXISTING.format(username="known")
    ]
    unknown_model = client.post(INVITE, invite_form(team, "other"))
    assert "allowed_models" in unknown_model.context["key_form"].errors
    assert not get_user_model().objects.filter(username="other").exists()
    assert not Membership.objects.filter(team=team).exists()

    # An existing user, no key: only the membership.
    joined = client.post(INVITE, invite_form(team, "known", issue_key=""))
    assert joined.context["invitation"].joined and joined.context["password_link"] is None
    assert Membership.objects.filter(team=team, user=existing).exists()
    assert not ApiKey.objects.exists()


def test_a_team_owner_invites_into_their_own_team_and_makes_no_accounts_unless_allowed(client):
    owner = MembershipFactory(role="owner", user=UserFactory(is_staff=True))
    owner.user.user_permissions.add(
        *Permission.objects.filter(codename__in=["add_membership", "add_apikey"])
    )
    other_team = TeamFactory()
    UserFactory(username="known")
    client.force_login(owner.user)
    page = client.get(INVITE).content.decode()
    assert f'value="{owner.team.pk}"' in page and f'value="{other_team.pk}"' not in page
    elsewhere = client.post(INVITE, invite_form(other_team, "known", issue_key=""))
    assert "team" in elsewhere.context["form"].errors
    new_account = client.post(INVITE, invite_form(owner.team, "stranger", issue_key=""))
    assert new_account.context["form"].errors["username"] == [
        ERROR_ADDS_NO_USERS.format(username="stranger")
    ]
    assert client.post(INVITE, invite_form(owner.team, "known", issue_key="")).status_code == 200
    assert Membership.objects.filter(team=owner.team, user__username="known").exists()
    client.force_login(UserFactory(is_staff=True))  # staff who own no team
    assert client.get(INVITE).status_code == 403
