"""A member's keys end with their membership, and a deactivated user's keys with the account,
however the rows change: the admin's delete page, its bulk delete action, the team page's
inline, a membership moved to another user, a plain save or delete in code. Only the member's
keys in that team: their keys elsewhere and their colleagues' keep working. (Through the real
API: tests/inference/api/test_member_keys.py.)"""

import pytest
from django.test import Client
from django.urls import reverse

from accounts.authentication import ERROR_REVOKED, AuthenticationError, authenticate_header
from accounts.models import ApiKey, Membership
from tests.factories import StaffUserFactory, TeamFactory, UserFactory, api_key_with_raw

pytestmark = pytest.mark.django_db


def refused(raw: str) -> str | None:
    try:
        authenticate_header(f"Bearer {raw}")
    except AuthenticationError as exc:
        return exc.message
    return None


@pytest.fixture
def world():
    alpha, beta = TeamFactory(name="alpha"), TeamFactory(name="beta")
    alice, colleague = UserFactory(username="alice"), UserFactory(username="colleague")
    raw = {
        "alice_alpha": api_key_with_raw(team=alpha, user=alice)[1],
        "alice_alpha_2": api_key_with_raw(team=alpha, user=alice)[1],
        "alice_beta": api_key_with_raw(team=beta, user=alice)[1],
        "colleague_alpha": api_key_with_raw(team=alpha, user=colleague)[1],
    }
    membership = Membership.objects.get(team=alpha, user=alice)
    return {"alpha": alpha, "beta": beta, "alice": alice, "membership": membership, "raw": raw}


def assert_only_alphas_keys_of_alice_end(world) -> None:
    raw = world["raw"]
    assert refused(raw["alice_alpha"]) == ERROR_REVOKED
    assert refused(raw["alice_alpha_2"]) == ERROR_REVOKED
    assert refused(raw["alice_beta"]) is None
    assert refused(raw["colleague_alpha"]) is None


def admin_client() -> Client:
    client = Client()
    client.force_login(StaffUserFactory())
    return client


def test_deleting_the_membership_row_in_code(world):
    world["membership"].delete()
    assert_only_alphas_keys_of_alice_end(world)


def test_the_admins_delete_page(world):
    url = reverse("admin:accounts_membership_delete", args=[world["membership"].pk])
    assert admin_client().post(url, {"post": "yes"}).status_code == 302
    assert_only_alphas_keys_of_alice_end(world)


def test_the_admins_bulk_delete_action(world):
    changelist = reverse("admin:accounts_membership_changelist")
    response = admin_client().post(
        changelist,
        {"action": "delete_selected", "_selected_action": [world["membership"].pk], "post": "yes"},
    )
    assert response.status_code == 302
    assert_only_alphas_keys_of_alice_end(world)


def test_the_team_pages_membership_inline(world):
    alpha = world["alpha"]
    rows = list(Membership.objects.filter(team=alpha).order_by("pk"))
    form = {
        "name": alpha.name,
        "weight": "1",
        "memberships-TOTAL_FORMS": str(len(rows)),
        "memberships-INITIAL_FORMS": str(len(rows)),
        "memberships-MIN_NUM_FORMS": "0",
        "memberships-MAX_NUM_FORMS": "1000",
    }
    for index, row in enumerate(rows):
        prefix = f"memberships-{index}-"
        form |= {prefix + "id": row.pk, prefix + "team": alpha.pk, prefix + "user": row.user_id}
        form[prefix + "role"] = row.role
        if row.user_id == world["alice"].pk:
            form[prefix + "DELETE"] = "on"
    url = reverse("admin:accounts_team_change", args=[alpha.pk])
    response = admin_client().post(url, form)
    assert response.status_code == 302, response.context["errors"]
    assert_only_alphas_keys_of_alice_end(world)


def test_a_membership_moved_to_another_user_ends_the_one_it_was(world):
    membership = world["membership"]
    membership.user = UserFactory(username="newcomer")
    membership.save()
    assert_only_alphas_keys_of_alice_end(world)


def test_deactivating_a_user_revokes_all_their_keys_for_good(world):
    alice = world["alice"]
    alice.is_active = False
    alice.save()
    raw = world["raw"]
    for name in ("alice_alpha", "alice_alpha_2", "alice_beta"):
        assert refused(raw[name]) == ERROR_REVOKED
    assert refused(raw["colleague_alpha"]) is None
    alice.is_active = True
    alice.save()
    assert refused(raw["alice_beta"]) == ERROR_REVOKED  # reactivating brings no key back
    assert not ApiKey.objects.active().filter(user=alice).exists()


def test_saving_an_active_user_or_a_membership_in_place_revokes_nothing(world):
    world["alice"].save()
    membership = world["membership"]
    membership.role = Membership.Role.OWNER
    membership.save()
    assert ApiKey.objects.active().count() == 4
