"""The playground's keys: made from a key the member holds (whatever the team's rules for
members' own keys), for one model and an hour, spending that key's limits and budget; ended by
their hour, by their key's end, and by signing out."""

from datetime import timedelta

import pytest
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.authentication import (
    ERROR_EXPIRED,
    ERROR_REVOKED,
    AuthenticationError,
    authenticate_header,
)
from accounts.limits.base import Limits
from accounts.models import ApiKey, ApiKeyMonthlyUsage
from accounts.selectors import api_key_month_tokens, month_start
from accounts.services import (
    ERROR_PLAYGROUND_KEYS_MAX,
    ERROR_PLAYGROUND_MODEL,
    ERROR_PLAYGROUND_PARENT,
    PLAYGROUND_KEY_LIFETIME,
    PLAYGROUND_KEYS_MAX,
    PlaygroundKeyRefused,
    api_key_revoke,
    playground_key_create,
)
from tests.factories import ApiKeyFactory, TeamFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def parent():
    """A key an owner issued to a member of a team whose members may not make keys."""
    team = TeamFactory(members_manage_keys=False)
    return ApiKeyFactory(
        team=team,
        models=["m1", "m2"],
        rpm=5,
        budget_tokens=1000,
        max_output_tokens=64,
        expires_at=timezone.now() + timedelta(days=3),
    )


def refusal(**kwargs) -> str:
    with pytest.raises(PlaygroundKeyRefused) as caught:
        playground_key_create(**kwargs)
    return str(caught.value)


def auth_error(raw: str) -> str:
    with pytest.raises(AuthenticationError) as caught:
        authenticate_header(f"Bearer {raw}")
    return caught.value.message


def test_a_playground_key_is_one_model_for_an_hour_on_its_keys_limits(parent):
    before = timezone.now()
    key, raw = playground_key_create(user=parent.user, parent_id=parent.pk, model="m1")
    assert (key.all_models, key.allowed_models, key.parent) == (False, ["m1"], parent)
    assert key.name.startswith("Playground: m1") and parent.prefix in key.name
    assert (
        before + PLAYGROUND_KEY_LIFETIME
        <= key.expires_at
        <= timezone.now() + PLAYGROUND_KEY_LIFETIME
    )
    assert (key.max_output_tokens, key.service_tiers, key.reads_usage) == (
        64,
        parent.service_tiers,
        False,
    )

    # Its requests count on the parent's counters: the same limits, under the same identity...
    assert Limits.of(authenticate_header(f"Bearer {raw}")) == Limits.of(parent)
    # ...and what it used this month is in the parent's budget seed.
    month = month_start(timezone.now().date())
    ApiKeyMonthlyUsage.objects.create(api_key=parent, month=month, tokens=100)
    ApiKeyMonthlyUsage.objects.create(api_key=key, month=month, tokens=300)
    assert api_key_month_tokens(api_key_id=parent.pk, month=month) == 400

    # Never past its parent's own expiry.
    ApiKey.objects.filter(pk=parent.pk).update(expires_at=timezone.now() + timedelta(minutes=5))
    short, _ = playground_key_create(user=parent.user, parent_id=parent.pk, model="m2")
    assert short.expires_at == ApiKey.objects.get(pk=parent.pk).expires_at


def test_what_a_playground_key_cannot_be_made_from(parent):
    assert refusal(user=parent.user, parent_id=parent.pk, model="m3") == (
        ERROR_PLAYGROUND_MODEL.format(model="m3")
    )
    someone_elses = ApiKeyFactory(team=parent.team)
    assert refusal(user=parent.user, parent_id=someone_elses.pk, model="m1") == (
        ERROR_PLAYGROUND_PARENT
    )
    child, _ = playground_key_create(user=parent.user, parent_id=parent.pk, model="m1")
    assert refusal(user=parent.user, parent_id=child.pk, model="m1") == ERROR_PLAYGROUND_PARENT
    for _ in range(PLAYGROUND_KEYS_MAX - 1):
        playground_key_create(user=parent.user, parent_id=parent.pk, model="m1")
    assert refusal(user=parent.user, parent_id=parent.pk, model="m1") == (
        ERROR_PLAYGROUND_KEYS_MAX.format(active=PLAYGROUND_KEYS_MAX)
    )
    api_key_revoke(api_key=parent)
    assert refusal(user=parent.user, parent_id=parent.pk, model="m1") == ERROR_PLAYGROUND_PARENT


def test_a_playground_key_ends_with_its_hour_its_key_and_sign_out(parent):
    expiring, raw = playground_key_create(user=parent.user, parent_id=parent.pk, model="m1")
    authenticate_header(f"Bearer {raw}")
    ApiKey.objects.filter(pk=expiring.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert auth_error(raw) == ERROR_EXPIRED

    # The parent expiring (no row of the child changes) ends it too.
    _, raw = playground_key_create(user=parent.user, parent_id=parent.pk, model="m1")
    authenticate_header(f"Bearer {raw}")
    ApiKey.objects.filter(pk=parent.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert auth_error(raw) == ERROR_REVOKED
    ApiKey.objects.filter(pk=parent.pk).update(expires_at=None)

    # Revoking the parent revokes it.
    child, raw = playground_key_create(user=parent.user, parent_id=parent.pk, model="m1")
    api_key_revoke(api_key=parent)
    assert ApiKey.objects.get(pk=child.pk).revoked_at is not None
    assert auth_error(raw) == ERROR_REVOKED

    # Signing out revokes the user's playground keys, and only those.
    other = ApiKeyFactory(team=parent.team, user=parent.user, models=["m1"])
    child, _ = playground_key_create(user=parent.user, parent_id=other.pk, model="m1")
    browser = Client()
    browser.force_login(parent.user)
    browser.post(reverse("web-logout"))
    assert ApiKey.objects.get(pk=child.pk).revoked_at is not None
    assert ApiKey.objects.get(pk=other.pk).revoked_at is None
