"""Bearer authentication: the format is checked before any query, comparison is by digest, and
revocation, expiry, a member leaving the key's team or a deactivated user applies on the very
next request because nothing is cached (also where the rows changed without the signals that
revoke such keys)."""

from datetime import timedelta

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from accounts import keys
from accounts.authentication import (
    ERROR_EXPIRED,
    ERROR_INVALID,
    ERROR_MALFORMED,
    ERROR_MISSING,
    ERROR_NOT_A_MEMBER,
    ERROR_REVOKED,
    AuthenticationError,
    authenticate_header,
)
from accounts.models import ApiKey, Membership
from accounts.services import LAST_USED_RESOLUTION_SECONDS
from tests.factories import TeamFactory, api_key_with_raw


def _error(header):
    with pytest.raises(AuthenticationError) as caught:
        authenticate_header(header)
    return caught.value.message


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (None, ERROR_MISSING),
        ("", ERROR_MISSING),
        ("Basic dXNlcjpwYXNz", ERROR_MALFORMED),
        ("Bearer", ERROR_MALFORMED),
        ("Bearer a b", ERROR_MALFORMED),
        ("Bearer sk-orch-short", ERROR_INVALID),
        ("Bearer " + "x" * 48, ERROR_INVALID),
    ],
)
def test_bad_headers_fail_without_touching_the_database(header, message):
    # No django_db mark: any query would raise instead of the expected error.
    assert _error(header) == message


@pytest.mark.django_db
def test_valid_key_authenticates_and_records_last_use():
    api_key, raw = api_key_with_raw()
    assert authenticate_header(f"Bearer {raw}") == api_key
    assert authenticate_header(f"bearer  {raw}") == api_key  # scheme is case-insensitive
    assert ApiKey.objects.get(pk=api_key.pk).last_used_at is not None


@pytest.mark.django_db
def test_last_used_is_written_at_most_once_a_resolution():
    api_key, raw = api_key_with_raw()
    authenticate_header(f"Bearer {raw}")
    with CaptureQueriesContext(connection) as queries:
        authenticate_header(f"Bearer {raw}")
    assert not any(q["sql"].startswith("UPDATE") for q in queries)
    stale = timezone.now() - timedelta(seconds=LAST_USED_RESOLUTION_SECONDS + 1)
    ApiKey.objects.filter(pk=api_key.pk).update(last_used_at=stale)
    authenticate_header(f"Bearer {raw}")
    assert ApiKey.objects.get(pk=api_key.pk).last_used_at > stale


@pytest.mark.django_db
def test_unknown_key_and_wrong_secret_are_invalid():
    _, raw = api_key_with_raw()
    assert _error(f"Bearer {keys.generate_key()}") == ERROR_INVALID
    wrong_secret = raw[:-1] + ("A" if raw[-1] != "A" else "B")
    assert _error(f"Bearer {wrong_secret}") == ERROR_INVALID


@pytest.mark.django_db
def test_revocation_elsewhere_applies_to_the_next_request():
    api_key, raw = api_key_with_raw()
    assert authenticate_header(f"Bearer {raw}") == api_key
    # As another process would: straight to the database, no signal, no cache to clear.
    ApiKey.objects.filter(pk=api_key.pk).update(revoked_at=timezone.now())
    assert _error(f"Bearer {raw}") == ERROR_REVOKED


@pytest.mark.django_db
def test_expired_key_is_refused():
    api_key, raw = api_key_with_raw(expires_at=timezone.now() + timedelta(hours=1))
    assert authenticate_header(f"Bearer {raw}") == api_key
    ApiKey.objects.filter(pk=api_key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert _error(f"Bearer {raw}") == ERROR_EXPIRED


@pytest.mark.django_db
def test_key_of_a_deactivated_user_is_refused(django_user_model):
    api_key, raw = api_key_with_raw()
    api_key.user.is_active = False
    api_key.user.save()  # as the admin's user form does: the keys are revoked
    assert _error(f"Bearer {raw}") == ERROR_REVOKED
    other, other_raw = api_key_with_raw()
    # An update() sends no signal and revokes nothing: authentication refuses the key anyway.
    django_user_model.objects.filter(pk=other.user_id).update(is_active=False)
    assert ApiKey.objects.get(pk=other.pk).revoked_at is None
    assert _error(f"Bearer {other_raw}") == ERROR_INVALID


@pytest.mark.django_db
def test_key_of_a_user_no_longer_in_its_team_is_refused():
    api_key, raw = api_key_with_raw()
    assert authenticate_header(f"Bearer {raw}") == api_key
    # Moved to another team by an update(), which no signal sees: the key is not revoked...
    Membership.objects.filter(user=api_key.user).update(team=TeamFactory())
    assert ApiKey.objects.get(pk=api_key.pk).revoked_at is None
    # ...and refused all the same, in the query that reads the key.
    with CaptureQueriesContext(connection) as queries:
        assert _error(f"Bearer {raw}") == ERROR_NOT_A_MEMBER
    assert len(queries) == 1


def test_errors_never_echo_the_key():
    raw = keys.generate_key()
    messages = (ERROR_MISSING, ERROR_MALFORMED, ERROR_INVALID, ERROR_REVOKED, ERROR_EXPIRED)
    for message in (*messages, ERROR_NOT_A_MEMBER):
        assert raw not in message
