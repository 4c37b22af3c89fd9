"""Key format and the key services: digest only, recognisable prefix, find, revoke, rotate, the
rules for keys members make themselves, and who may see which keys."""

from datetime import timedelta

import pytest
from django.core.exceptions import ValidationError
from django.utils import timezone

from accounts import keys
from accounts.models import ApiKey, Membership
from accounts.selectors import api_keys_visible_to, teams_owned_by, teams_visible_to
from accounts.services import (
    ERROR_MEMBER_KEYS_MAX,
    ERROR_OWNERS_MANAGE_KEYS,
    LAST_USED_RESOLUTION_SECONDS,
    MEMBER_KEYS_MAX,
    MemberKeyRefused,
    api_key_create,
    api_key_find,
    api_key_revoke,
    api_key_rotate,
    api_key_touch_last_used,
    member_key_create,
    member_key_revoke,
    team_membership_ensure,
    user_get_or_create,
)
from tests.factories import ApiKeyFactory, MembershipFactory, UserFactory, api_key_with_raw


def test_generated_keys_are_well_formed_and_distinct():
    generated = {keys.generate_key() for _ in range(200)}
    assert len(generated) == 200
    for raw in generated:
        assert raw.startswith("sk-orch-") and len(raw) == 48
        assert keys.is_well_formed(raw)
    assert len({keys.lookup_prefix(raw) for raw in generated}) == 200


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "sk-orch-",
        "sk-orch-" + "a" * 39,
        "sk-orch-" + "a" * 41,
        "sk-live-" + "a" * 40,
        "sk-orch-" + "a" * 39 + "!",
        " sk-orch-" + "a" * 40,
    ],
)
def test_malformed_keys_are_rejected(raw):
    assert not keys.is_well_formed(raw)


def test_digest_comparison():
    raw = keys.generate_key()
    assert keys.digest_matches(raw, keys.digest(raw))
    assert not keys.digest_matches(raw[:-1] + ("A" if raw[-1] != "A" else "B"), keys.digest(raw))


@pytest.mark.django_db
def test_create_stores_only_prefix_and_digest():
    api_key, raw = api_key_with_raw(name="ci", models=["b", "a", "a"], rpm=5)
    stored = ApiKey.objects.filter(pk=api_key.pk).values().get()
    assert raw not in str(stored)
    assert stored["prefix"] == raw[:16]
    assert stored["digest"] == keys.digest(raw)
    assert (api_key.all_models, api_key.allowed_models) == (False, ["a", "b"])
    assert api_key.allows_model("a") and not api_key.allows_model("c")
    assert raw not in str(api_key) and raw not in repr(api_key)


@pytest.mark.django_db
def test_find_by_prefix_or_raw_key():
    api_key, raw = api_key_with_raw()
    assert api_key_find(key_or_prefix=raw) == api_key
    assert api_key_find(key_or_prefix=f"{api_key.prefix}…") == api_key
    wrong = raw[:-1] + ("A" if raw[-1] != "A" else "B")
    with pytest.raises(ApiKey.DoesNotExist):
        api_key_find(key_or_prefix=wrong)
    with pytest.raises(ApiKey.DoesNotExist):
        api_key_find(key_or_prefix=api_key.prefix[:-1])  # a shorter prefix could match several


@pytest.mark.django_db
def test_revoke_is_idempotent():
    api_key = ApiKeyFactory()
    first = api_key_revoke(api_key=api_key).revoked_at
    assert first is not None
    assert api_key_revoke(api_key=ApiKey.objects.get(pk=api_key.pk)).revoked_at == first


@pytest.mark.django_db
def test_rotate_copies_settings_and_revokes_the_old_key():
    old, _ = api_key_with_raw(
        name="prod", rpm=1, tpm=2, max_parallel=3, budget_tokens=4, service_tiers=["priority"]
    )
    new, raw = api_key_rotate(api_key=old)
    assert new.service_tiers == ["priority"]
    assert keys.digest_matches(raw, new.digest)
    assert (new.name, new.rpm, new.tpm, new.max_parallel, new.budget_tokens) == (
        "prod",
        1,
        2,
        3,
        4,
    )
    assert new.team == old.team and new.user == old.user and new.all_models
    assert ApiKey.objects.get(pk=old.pk).is_revoked and not new.is_revoked


@pytest.mark.django_db
def test_team_creator_owns_it_later_members_do_not():
    alice = user_get_or_create(username="alice")
    bob = user_get_or_create(username="bob")
    team, first = team_membership_ensure(user=alice, team_name="t")
    _, second = team_membership_ensure(user=bob, team_name="t")
    assert (first.role, second.role) == (Membership.Role.OWNER, Membership.Role.MEMBER)
    api_key, _ = api_key_create(user=bob, team=team)
    assert api_key.team == team


@pytest.mark.django_db
def test_key_visibility_owner_member_and_other_team():
    owner, member, outsider = UserFactory(), UserFactory(), UserFactory()
    team = MembershipFactory(user=owner, role=Membership.Role.OWNER).team
    MembershipFactory(user=member, team=team)
    other_team = MembershipFactory(user=outsider, role=Membership.Role.OWNER).team
    owners_key = ApiKeyFactory(team=team, user=owner)
    members_key = ApiKeyFactory(team=team, user=member)
    outsiders_key = ApiKeyFactory(team=other_team, user=outsider)

    assert set(api_keys_visible_to(user=owner)) == {owners_key, members_key}
    assert set(api_keys_visible_to(user=member)) == {members_key}
    assert set(api_keys_visible_to(user=outsider)) == {outsiders_key}
    assert set(teams_visible_to(user=member)) == {team}
    assert set(teams_owned_by(user=member)) == set()
    assert set(teams_owned_by(user=outsider)) == {other_team}
    superuser = UserFactory(is_superuser=True)
    assert api_keys_visible_to(user=superuser).count() == 3


@pytest.mark.django_db
def test_a_member_who_left_the_team_sees_none_of_its_keys():
    member = UserFactory()
    membership = MembershipFactory(user=member)
    ApiKeyFactory(team=membership.team, user=member)
    membership.delete()
    assert list(api_keys_visible_to(user=member)) == []


@pytest.mark.django_db
def test_touch_last_used_writes_at_most_once_a_resolution():
    api_key = ApiKeyFactory()
    start = timezone.now()
    api_key_touch_last_used(api_key=api_key, now=start)
    soon = start + timedelta(seconds=LAST_USED_RESOLUTION_SECONDS - 1)
    api_key_touch_last_used(api_key=api_key, now=soon)
    assert ApiKey.objects.get(pk=api_key.pk).last_used_at == start == api_key.last_used_at
    later = start + timedelta(seconds=LAST_USED_RESOLUTION_SECONDS)
    api_key_touch_last_used(api_key=api_key, now=later)
    assert ApiKey.objects.get(pk=api_key.pk).last_used_at == later == api_key.last_used_at


def test_redact_keys_cuts_every_key_to_its_prefix():
    raw, other = keys.generate_key(), keys.generate_key()
    text = f"q={raw} and Bearer {other}; prefix {keys.lookup_prefix(raw)}… stays"
    redacted = keys.redact_keys(text)
    assert raw not in redacted and other not in redacted
    assert redacted == (
        f"q={keys.lookup_prefix(raw)} and Bearer {keys.lookup_prefix(other)}; "
        f"prefix {keys.lookup_prefix(raw)}… stays"
    )


@pytest.mark.django_db
def test_a_member_makes_keys_under_the_teams_rules_and_an_owner_without():
    member = MembershipFactory(team__members_manage_keys=True, team__member_key_rpm=7)
    team = member.team
    team.member_key_models = ["m1"]
    team.save()
    api_key, raw = member_key_create(user=member.user, team=team, name="laptop")
    assert keys.digest_matches(raw, api_key.digest) and api_key.created_by == member.user
    assert (api_key.rpm, api_key.all_models, api_key.allowed_models) == (7, False, ["m1"])
    assert api_key.service_tiers == ["default", "flex"]  # priority is granted in the admin only
    for _ in range(MEMBER_KEYS_MAX - 1):
        member_key_create(user=member.user, team=team)
    with pytest.raises(MemberKeyRefused) as caught:
        member_key_create(user=member.user, team=team)
    assert str(caught.value) == ERROR_MEMBER_KEYS_MAX.format(active=MEMBER_KEYS_MAX, team=team)
    owner = MembershipFactory(team=team, role=Membership.Role.OWNER).user
    for _ in range(MEMBER_KEYS_MAX + 1):
        own, _ = member_key_create(user=owner, team=team)
    assert own.rpm is None and own.all_models  # owners: no limits, no cap
    assert own.service_tiers == ["default", "flex"]  # nor priority for an owner's own key


@pytest.mark.django_db
def test_a_keys_service_tiers_are_known_tiers_kept_highest_first():
    api_key, _ = api_key_with_raw(service_tiers=["flex", "priority", "flex"])
    assert ApiKey.objects.get(pk=api_key.pk).service_tiers == ["priority", "flex"]
    for tiers in ([], ["scale"], ["default", "auto"]):
        with pytest.raises(ValidationError):
            api_key_with_raw(service_tiers=tiers)


@pytest.mark.django_db
def test_a_form_sent_again_makes_no_second_key():
    member = MembershipFactory(team__members_manage_keys=True)
    first, raw = member_key_create(user=member.user, team=member.team, creation_token="a" * 32)
    again, no_raw = member_key_create(user=member.user, team=member.team, creation_token="a" * 32)
    assert raw and no_raw is None and again == first
    assert ApiKey.objects.filter(user=member.user).count() == 1


@pytest.mark.django_db
def test_where_owners_manage_keys_members_neither_make_nor_revoke_them():
    member = MembershipFactory()  # members_manage_keys is off by default
    with pytest.raises(MemberKeyRefused) as caught:
        member_key_create(user=member.user, team=member.team)
    assert str(caught.value) == ERROR_OWNERS_MANAGE_KEYS
    theirs = ApiKeyFactory(team=member.team, user=member.user)
    with pytest.raises(MemberKeyRefused):
        member_key_revoke(user=member.user, key_id=theirs.pk)
    member.team.members_manage_keys = True
    member.team.save()
    assert member_key_revoke(user=member.user, key_id=theirs.pk).is_revoked
    someone_elses = ApiKeyFactory(team=member.team)
    with pytest.raises(ApiKey.DoesNotExist):
        member_key_revoke(user=member.user, key_id=someone_elses.pk)
    someone_elses.refresh_from_db()
    assert not someone_elses.is_revoked
