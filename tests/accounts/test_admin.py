"""The admin through Django's test client: staff only, the show-once key page, revoke and rotate,
team isolation for staff who are not superusers (members' keys read-only), raw keys never echoed
by a search, the model registry and the usage pages."""

import re
from datetime import date

import pytest
from django.contrib.admin import site as admin_site
from django.contrib.auth.models import Permission
from django.urls import reverse

from accounts import keys
from accounts.admin import ERROR_NOT_A_MEMBER, ERROR_PRIORITY_BY_SUPERUSER
from accounts.authentication import ERROR_REVOKED, AuthenticationError, authenticate_header
from accounts.models import ApiKey, ApiKeyMonthlyUsage, Membership
from inference.models import ModelEntry, UsageRecord
from inference.services.usage import usage_finish
from tests.factories import (
    ApiKeyFactory,
    MembershipFactory,
    ModelEntryFactory,
    StaffUserFactory,
    TeamFactory,
    UsageRecordFactory,
    UserFactory,
    api_key_with_raw,
)

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:accounts_apikey_changelist")
ADD = reverse("admin:accounts_apikey_add")


@pytest.fixture
def admin_client(client):
    client.force_login(StaffUserFactory())
    return client


def _add_form(team, user, **overrides):
    data = {
        "name": "ci",
        "team": team.pk,
        "user": user.pk,
        "all_models": "on",
        "allowed_models": "",
        "rpm": "60",
        "tpm": "",
        "max_parallel": "2",
        "budget_tokens": "",
        "expires_at_0": "",
        "expires_at_1": "",
        "service_tiers": ["default", "flex"],
    }
    data.update(overrides)
    return data


def test_admin_is_staff_only(client):
    assert client.get(CHANGELIST).status_code == 302
    client.force_login(UserFactory())
    response = client.get(CHANGELIST)
    assert response.status_code == 302
    assert "/login/" in response["Location"]


def test_new_key_is_shown_once_on_its_own_page(admin_client):
    membership = MembershipFactory()
    response = admin_client.post(ADD, _add_form(membership.team, membership.user))
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    api_key = ApiKey.objects.get()
    raw_key = response.context["created"][0][1]
    assert keys.is_well_formed(raw_key) and keys.digest_matches(raw_key, api_key.digest)
    assert raw_key in response.content.decode()
    # Not through cookie-stored messages or the session, and never again on any page.
    assert all(raw_key not in morsel.value for morsel in response.cookies.values())
    assert raw_key not in str(dict(admin_client.session))
    for url in (CHANGELIST, reverse("admin:accounts_apikey_change", args=[api_key.pk])):
        page = admin_client.get(url).content.decode()
        assert api_key.prefix in page
        assert raw_key not in page and api_key.digest not in page
    assert (api_key.rpm, api_key.max_parallel, api_key.all_models) == (60, 2, True)
    assert api_key.created_by is not None
    assert authenticate_header(f"Bearer {raw_key}") == api_key


def test_key_with_model_list_picked_from_the_registry(admin_client):
    for name in ("a", "b"):
        ModelEntryFactory(name=name)
    page = admin_client.get(ADD).content.decode()
    for name in ("a", "b"):
        assert re.search(rf'<input type="checkbox" name="allowed_models" value="{name}"', page)
    membership = MembershipFactory()
    unknown = _add_form(membership.team, membership.user, all_models="", allowed_models=["zz"])
    response = admin_client.post(ADD, unknown)
    assert "allowed_models" in response.context["adminform"].form.errors
    form = _add_form(membership.team, membership.user, all_models="", allowed_models=["b", "a"])
    admin_client.post(ADD, form)
    api_key = ApiKey.objects.get()
    assert (api_key.all_models, api_key.allowed_models) == (False, ["a", "b"])


def test_a_teams_member_key_models_are_picked_and_a_removed_model_stays_shown(client):
    ModelEntryFactory(name="m1")
    team = TeamFactory(member_key_models=["gone"])  # a model since removed from the registry
    client.force_login(StaffUserFactory())
    change = reverse("admin:accounts_team_change", args=[team.pk])
    page = client.get(change).content.decode()
    assert re.search(
        r'<input type="checkbox" name="member_key_models" value="gone"[^>]*checked', page
    )
    assert 'name="member_key_models" value="m1"' in page
    assert client.post(change, _team_form(team, member_key_models=["m1"])).status_code == 302
    team.refresh_from_db()
    assert team.member_key_models == ["m1"]


def test_key_user_must_belong_to_the_team(admin_client):
    membership = MembershipFactory()
    member_elsewhere = MembershipFactory().user
    response = admin_client.post(ADD, _add_form(membership.team, member_elsewhere))
    assert response.status_code == 200
    assert response.context["adminform"].form.non_field_errors() == [ERROR_NOT_A_MEMBER]
    nobodys = admin_client.post(ADD, _add_form(membership.team, UserFactory()))
    assert "user" in nobodys.context["adminform"].form.errors
    assert not ApiKey.objects.exists()


def test_revoke_action_makes_the_next_request_fail(admin_client):
    api_key, raw_key = api_key_with_raw()
    response = admin_client.post(
        CHANGELIST, {"action": "revoke_keys", "_selected_action": [api_key.pk]}
    )
    assert response.status_code == 302
    with pytest.raises(AuthenticationError) as caught:
        authenticate_header(f"Bearer {raw_key}")
    assert caught.value.message == ERROR_REVOKED


def test_rotate_action_shows_the_replacement_once(admin_client):
    old, old_raw = api_key_with_raw(rpm=7, models=["m"])
    response = admin_client.post(
        CHANGELIST, {"action": "rotate_keys", "_selected_action": [old.pk]}
    )
    assert response.status_code == 200
    assert "no-store" in response["Cache-Control"]
    new_key, new_raw = response.context["created"][0]
    assert new_raw in response.content.decode()
    old.refresh_from_db()
    assert old.is_revoked
    assert (new_key.rpm, new_key.allowed_models, new_key.team) == (7, ["m"], old.team)
    assert authenticate_header(f"Bearer {new_raw}") == new_key
    with pytest.raises(AuthenticationError):
        authenticate_header(f"Bearer {old_raw}")


def test_status_filter(admin_client):
    active = ApiKeyFactory()
    revoked = ApiKeyFactory()
    admin_client.post(CHANGELIST, {"action": "revoke_keys", "_selected_action": [revoked.pk]})
    page = admin_client.get(CHANGELIST, {"status": "revoked"}).content.decode()
    assert revoked.prefix in page and active.prefix not in page


def test_keys_cannot_be_deleted(admin_client):
    api_key = ApiKeyFactory()
    response = admin_client.get(reverse("admin:accounts_apikey_delete", args=[api_key.pk]))
    assert response.status_code == 403


def _team_owner_staff(permissions: list[str]):
    owner = UserFactory(is_staff=True)
    owner.user_permissions.set(Permission.objects.filter(codename__in=permissions))
    team = MembershipFactory(user=owner, role=Membership.Role.OWNER).team
    return owner, team


def test_staff_owner_sees_only_their_teams_keys_and_usage(client):
    owner, team = _team_owner_staff(["view_apikey", "change_apikey", "view_usagerecord"])
    mine = ApiKeyFactory(team=team, user=owner)
    theirs = ApiKeyFactory(team=TeamFactory(name="other-team-zz"))
    UsageRecordFactory(api_key=mine, request_id="req-mine")
    UsageRecordFactory(api_key=theirs, request_id="req-theirs")
    client.force_login(owner)
    page = client.get(CHANGELIST).content.decode()
    assert mine.prefix in page and theirs.prefix not in page
    assert theirs.team.name not in page  # not even in the team filter
    other = client.get(reverse("admin:accounts_apikey_change", args=[theirs.pk]))
    assert other.status_code == 302  # "doesn't exist", back to the index
    usage = client.get(reverse("admin:inference_usagerecord_changelist")).content.decode()
    assert "req-mine" in usage and "req-theirs" not in usage


def test_usage_search_filters_and_totals(admin_client):
    api_key = ApiKeyFactory()
    other = UsageRecordFactory(request_id="req-other")
    for n in range(3):
        record = UsageRecordFactory(api_key=api_key, request_id=f"req-{n}", model="m1")
        usage_finish(
            record_id=record.pk,
            status=UsageRecord.Status.COMPLETED,
            prompt_tokens=10,
            completion_tokens=5,
        )
    url = reverse("admin:inference_usagerecord_changelist")
    by_prefix = admin_client.get(url, {"q": f"{api_key.prefix}…"}).content.decode()
    assert "req-0" in by_prefix and "req-other" not in by_prefix
    by_id = admin_client.get(url, {"q": "req-other"}).content.decode()
    assert "req-other" in by_id and "req-1" not in by_id
    by_status = admin_client.get(url, {"status__exact": "completed"}).content.decode()
    assert "req-2" in by_status and other.request_id not in by_status
    totals = admin_client.get(reverse("admin:inference_usagerecord_totals"))
    assert totals.status_code == 200
    assert totals.context["keys"][0]["prompt_tokens"] == 30
    assert totals.context["teams"][0]["completion_tokens"] == 15
    assert admin_client.get(reverse("admin:inference_dailyusage_changelist")).status_code == 200


def test_usage_is_read_only(admin_client):
    record = UsageRecordFactory()
    change = reverse("admin:inference_usagerecord_change", args=[record.pk])
    assert admin_client.post(change, {"status": "completed"}).status_code == 403
    assert admin_client.get(reverse("admin:inference_usagerecord_add")).status_code == 403


def test_model_registry_actions(admin_client):
    first = ModelEntryFactory(is_default=True)
    second = ModelEntryFactory()
    url = reverse("admin:inference_modelentry_changelist")
    admin_client.post(url, {"action": "make_default", "_selected_action": [second.pk]})
    first.refresh_from_db()
    second.refresh_from_db()
    assert (first.is_default, second.is_default) == (False, True)
    admin_client.post(url, {"action": "disable", "_selected_action": [first.pk]})
    assert not ModelEntry.objects.get(pk=first.pk).enabled
    assert admin_client.get(url).status_code == 200


def test_staff_owner_cannot_issue_keys_for_another_team(client):
    owner, team = _team_owner_staff(["view_apikey", "add_apikey"])
    stranger = MembershipFactory(team=TeamFactory(name="other-team-yy"))
    client.force_login(owner)
    form_page = client.get(ADD).content.decode()
    assert team.name in form_page and "other-team-yy" not in form_page
    response = client.post(ADD, _add_form(stranger.team, stranger.user))
    assert set(response.context["adminform"].form.errors) == {"team", "user"}
    assert not ApiKey.objects.exists()
    client.post(ADD, _add_form(team, owner))
    assert ApiKey.objects.get().team == team


MEMBERSHIP_ADD = reverse("admin:accounts_membership_add")


def test_staff_owner_cannot_join_another_team_through_the_membership_form(client):
    owner, team = _team_owner_staff(
        ["view_membership", "add_membership", "change_membership", "view_team"]
    )
    other = TeamFactory(name="other-team-xx")
    client.force_login(owner)
    response = client.post(MEMBERSHIP_ADD, {"user": owner.pk, "team": other.pk, "role": "owner"})
    assert response.status_code == 200
    assert "team" in response.context["adminform"].form.errors
    assert not Membership.objects.filter(team=other).exists()
    newcomer = UserFactory()
    client.post(MEMBERSHIP_ADD, {"user": newcomer.pk, "team": team.pk, "role": "member"})
    assert Membership.objects.filter(team=team, user=newcomer).exists()


def test_membership_permissions_stop_at_the_teams_a_user_owns(rf):
    owner, team = _team_owner_staff(
        ["view_membership", "add_membership", "change_membership", "delete_membership"]
    )
    member, _ = _team_owner_staff(["add_membership", "change_membership"])
    Membership.objects.filter(user=member).update(role=Membership.Role.MEMBER)
    model_admin = admin_site._registry[Membership]
    request = rf.get("/")
    request.user = owner
    mine = MembershipFactory(team=team)
    foreign = MembershipFactory()
    assert model_admin.has_change_permission(request, mine)
    assert not model_admin.has_change_permission(request, foreign)
    assert model_admin.has_delete_permission(request, mine)
    assert not model_admin.has_delete_permission(request, foreign)
    request.user = member
    assert not model_admin.has_add_permission(request)
    assert not model_admin.has_change_permission(request)


def test_members_keys_are_read_only_to_them(client):
    """Owner of one team, member of another: their key in the other team is view-only, and the
    revoke and rotate actions skip it."""
    user, owned = _team_owner_staff(["view_apikey", "change_apikey"])
    elsewhere = MembershipFactory(user=user, role=Membership.Role.MEMBER).team
    own_key = ApiKeyFactory(team=elsewhere, user=user, rpm=10)
    managed = ApiKeyFactory(team=owned, user=user)
    client.force_login(user)
    url = reverse("admin:accounts_apikey_change", args=[own_key.pk])
    page = client.get(url)
    assert page.status_code == 200 and not page.context["has_change_permission"]
    form = _add_form(elsewhere, user, rpm="", max_parallel="", budget_tokens="")
    assert client.post(url, form).status_code == 403
    for action in ("revoke_keys", "rotate_keys"):
        client.post(CHANGELIST, {"action": action, "_selected_action": [own_key.pk]})
    own_key.refresh_from_db()
    assert (own_key.rpm, own_key.is_revoked) == (10, False)
    assert ApiKey.objects.filter(team=elsewhere).count() == 1
    client.post(CHANGELIST, {"action": "revoke_keys", "_selected_action": [managed.pk]})
    managed.refresh_from_db()
    assert managed.is_revoked


@pytest.mark.parametrize(
    "url_name",
    [
        "admin:accounts_apikey_changelist",
        "admin:accounts_apikeymonthlyusage_changelist",
        "admin:inference_usagerecord_changelist",
    ],
)
def test_a_raw_key_in_a_search_is_cut_to_its_prefix(admin_client, url_name):
    api_key, raw_key = api_key_with_raw()
    other = ApiKeyFactory()
    for key in (api_key, other):
        UsageRecordFactory(api_key=key)
        ApiKeyMonthlyUsage.objects.create(api_key=key, month=date(2025, 1, 1), tokens=1)
    response = admin_client.get(reverse(url_name), {"q": f"  {raw_key} "})
    assert response.status_code == 302
    assert raw_key not in response["Location"] and api_key.prefix in response["Location"]
    page = admin_client.get(response["Location"])
    assert raw_key not in page.content.decode()
    assert page.context["cl"].result_count == 1


def test_resubmitting_the_add_form_does_not_create_a_second_key(client, django_user_model):
    from accounts.models import ApiKey, Membership, Team

    admin_user = django_user_model.objects.create_superuser("root", password="pw")
    team = Team.objects.create(name="resubmit")
    Membership.objects.create(team=team, user=admin_user, role="owner")
    client.force_login(admin_user)
    form = {
        "name": "once",
        "team": team.pk,
        "user": admin_user.pk,
        "all_models": "on",
        "allowed_models": "",
        "service_tiers": ["default", "flex"],
        "submission_token": "f" * 32,
    }
    first = client.post("/admin/accounts/apikey/add/", form)
    assert first.status_code == 200 and b"sk-orch-" in first.content
    again = client.post("/admin/accounts/apikey/add/", form)  # the browser's "resubmit"
    assert b"already submitted" in again.content
    assert ApiKey.objects.filter(name="once").count() == 1


def test_add_form_carries_a_fresh_submission_token(client, django_user_model):
    admin_user = django_user_model.objects.create_superuser("root2", password="pw")
    client.force_login(admin_user)
    pages = [client.get("/admin/accounts/apikey/add/").content.decode() for _ in range(2)]
    tokens = [page.split('name="submission_token" value="')[1][:32] for page in pages]
    assert tokens[0] != tokens[1]


def test_only_superusers_set_a_teams_storage_quota_and_weight(client):
    owner, team = _team_owner_staff(["view_team", "change_team"])
    change = reverse("admin:accounts_team_change", args=[team.pk])
    client.force_login(owner)
    page = client.get(change)
    form = page.context["adminform"].form
    assert "members_manage_keys" in form.fields
    assert "response_storage_bytes" not in form.fields and "weight" not in form.fields
    assert "Share of the engine while teams compete" in page.content.decode()  # shown, read-only
    client.force_login(StaffUserFactory())
    fields = client.get(change).context["adminform"].form.fields
    assert "response_storage_bytes" in fields and "weight" in fields


def _team_form(team, **overrides):
    return {
        "name": team.name,
        "weight": "1",
        "memberships-TOTAL_FORMS": "0",
        "memberships-INITIAL_FORMS": "0",
        "memberships-MIN_NUM_FORMS": "0",
        "memberships-MAX_NUM_FORMS": "1000",
        **overrides,
    }


def test_a_superuser_sets_a_teams_weight_between_1_and_1000(admin_client):
    team = TeamFactory()
    assert team.weight == 1
    change = reverse("admin:accounts_team_change", args=[team.pk])
    assert admin_client.post(change, _team_form(team, weight="5")).status_code == 302
    team.refresh_from_db()
    assert team.weight == 5
    for weight in ("0", "1001"):
        response = admin_client.post(change, _team_form(team, weight=weight))
        assert "weight" in response.context["adminform"].form.errors
    team.refresh_from_db()
    assert team.weight == 5
    assert ">5<" in admin_client.get(reverse("admin:accounts_team_changelist")).content.decode()


def test_a_keys_service_tiers_are_checkboxes_and_priority_is_a_superusers_grant(
    admin_client, client
):
    page = admin_client.get(ADD).content.decode()
    for tier, checked in (("priority", False), ("default", True), ("flex", True)):
        box = re.search(rf'<input[^>]*name="service_tiers" value="{tier}"[^>]*>', page)
        assert box and 'type="checkbox"' in box.group(0), tier
        assert ("checked" in box.group(0)) == checked, tier
    membership = MembershipFactory()
    form = _add_form(membership.team, membership.user, service_tiers=["flex", "priority"])
    assert admin_client.post(ADD, form).status_code == 200  # the show-once page
    granted = ApiKey.objects.get()
    assert granted.service_tiers == ["priority", "flex"]
    assert "priority, flex" in admin_client.get(CHANGELIST).content.decode()
    # A team owner who is staff may not grant it (it goes before every team), nor check none.
    owner, team = _team_owner_staff(["view_apikey", "add_apikey", "change_apikey"])
    client.force_login(owner)
    refused = client.post(ADD, _add_form(team, owner, service_tiers=["priority", "default"]))
    assert refused.context["adminform"].form.errors["service_tiers"] == [
        ERROR_PRIORITY_BY_SUPERUSER
    ]
    empty = client.post(ADD, _add_form(team, owner, service_tiers=[]))
    assert "service_tiers" in empty.context["adminform"].form.errors
    assert not ApiKey.objects.filter(team=team).exists()
    # A key a superuser granted it keeps it through the owner's edits, or loses it.
    kept = ApiKeyFactory(team=team, user=owner, service_tiers=["priority", "default"])
    change = reverse("admin:accounts_apikey_change", args=[kept.pk])
    edit = _add_form(team, owner, rpm="5", service_tiers=["priority", "default"])
    assert client.post(change, edit).status_code == 302
    kept.refresh_from_db()
    assert (kept.rpm, kept.service_tiers) == (5, ["priority", "default"])
    assert client.post(change, {**edit, "service_tiers": ["flex"]}).status_code == 302
    kept.refresh_from_db()
    assert kept.service_tiers == ["flex"]


@pytest.mark.django_db
def test_the_key_list_shows_tiers_only_where_they_differ_from_the_default():
    admin_ = admin_site._registry[ApiKey]
    plain = ApiKeyFactory(rpm=60)
    granted = ApiKeyFactory(rpm=60, service_tiers=["priority", "default", "flex"])
    assert admin_.limits(plain) == "rpm 60"
    assert admin_.limits(granted) == "rpm 60 · tiers priority, default, flex"
