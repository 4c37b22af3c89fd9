"""Bearer-key authentication for /v1 (the shape of DRF's TokenAuthentication: None for another
scheme or no header, an error for a malformed or unknown key)."""

from django.db.models import Exists, OuterRef
from django.utils import timezone

from accounts import keys
from accounts.limits.budgets import budget_rows_for
from accounts.models import ApiKey, Membership
from accounts.services import api_key_touch_last_used
from common.precompiled import Precompiled

ERROR_MISSING = "You didn't provide an API key. Use an 'Authorization: Bearer sk-orch-...' header."
ERROR_MALFORMED = "Malformed Authorization header; expected 'Bearer <key>'."
ERROR_INVALID = "Incorrect API key provided."
ERROR_REVOKED = "This API key has been revoked."
ERROR_EXPIRED = "This API key has expired."
ERROR_NOT_A_MEMBER = "This API key's user is no longer a member of its team."


class AuthenticationError(Exception):
    def __init__(self, message: str, code: str = "invalid_api_key"):
        super().__init__(message)
        self.message = message
        self.code = code


def authenticate_header(header: str | None) -> ApiKey:
    """The active key for an Authorization header value; raises AuthenticationError otherwise.
    Always reads the database (no cache), so revocation, expiry, a member leaving the key's team
    and a deactivated account take effect on the next request in every process. Leaving and
    deactivation also revoke the keys (accounts/signals.py); they are checked here too, in the
    same query, for any path that changed the rows without them."""
    if not header:
        raise AuthenticationError(ERROR_MISSING)
    parts = header.split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        raise AuthenticationError(ERROR_MALFORMED)
    raw_key = parts[1]
    if not keys.is_well_formed(raw_key):
        raise AuthenticationError(ERROR_INVALID)
    found = _key_by_prefix(keys.lookup_prefix(raw_key))
    api_key = found[0] if found else None
    if api_key is None or not keys.digest_matches(raw_key, api_key.digest):
        raise AuthenticationError(ERROR_INVALID)
    _check(api_key)
    now = timezone.now()
    # The budgets its requests spend today, read here with the key (the limiter would otherwise
    # read them on the event loop's behalf, in a thread of its own).
    api_key.budget_rows = budget_rows_for(api_key, now.date())
    api_key_touch_last_used(api_key=api_key, now=now)
    return api_key


def api_key_still_valid(api_key_id: int) -> ApiKey:
    """The key `api_key_id`, loaded and checked as a request's key is (revoked, expired, its
    member gone: AuthenticationError), for work it started that runs on after its request (a
    batch's lines)."""
    api_key = _with_membership().filter(pk=api_key_id).first()
    if api_key is None:
        raise AuthenticationError(ERROR_REVOKED)
    _check(api_key)
    api_key.budget_rows = budget_rows_for(api_key, timezone.now().date())
    return api_key


def _with_membership():
    membership = Membership.objects.filter(team_id=OuterRef("team_id"), user_id=OuterRef("user_id"))
    return ApiKey.objects.select_related("team", "user", "parent").annotate(
        user_is_member=Exists(membership)
    )


# Every request's query, compiled once (common/precompiled.py): as `.first()` would run it.
_key_by_prefix = Precompiled(
    lambda prefix: _with_membership().filter(prefix=prefix).order_by("pk")[:1],
    "\x00a stand-in for a key's prefix\x00",
)


def _check(api_key: ApiKey) -> None:
    if api_key.is_revoked:
        raise AuthenticationError(ERROR_REVOKED)
    if api_key.is_expired:
        raise AuthenticationError(ERROR_EXPIRED)
    if api_key.parent is not None and not api_key.parent.is_active:
        raise AuthenticationError(ERROR_REVOKED)  # a playground key ends with its key
    if not api_key.user.is_active:
        raise AuthenticationError(ERROR_INVALID)
    if not api_key.user_is_member:
        raise AuthenticationError(ERROR_NOT_A_MEMBER)
