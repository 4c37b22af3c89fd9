"""Bearer-key authentication for /v1 (the shape of DRF's TokenAuthentication: None for another
scheme or no header, an error for a malformed or unknown key)."""

from django.utils import timezone

from accounts import keys
from accounts.models import ApiKey
from accounts.services import api_key_touch_last_used

ERROR_MISSING = "You didn't provide an API key. Use an 'Authorization: Bearer sk-orch-...' header."
ERROR_MALFORMED = "Malformed Authorization header; expected 'Bearer <key>'."
ERROR_INVALID = "Incorrect API key provided."
ERROR_REVOKED = "This API key has been revoked."
ERROR_EXPIRED = "This API key has expired."


class AuthenticationError(Exception):
    def __init__(self, message: str, code: str = "invalid_api_key"):
        super().__init__(message)
        self.message = message
        self.code = code


def authenticate_header(header: str | None) -> ApiKey:
    """The active key for an Authorization header value; raises AuthenticationError otherwise.
    Always reads the database, so revocation and expiry take effect on the next request in every
    process."""
    if not header:
        raise AuthenticationError(ERROR_MISSING)
    parts = header.split()
    if len(parts) != 2 or parts[0].lower() != "bearer":
        raise AuthenticationError(ERROR_MALFORMED)
    raw_key = parts[1]
    if not keys.is_well_formed(raw_key):
        raise AuthenticationError(ERROR_INVALID)
    api_key = (
        ApiKey.objects.select_related("team", "user")
        .filter(prefix=keys.lookup_prefix(raw_key))
        .first()
    )
    if api_key is None or not keys.digest_matches(raw_key, api_key.digest):
        raise AuthenticationError(ERROR_INVALID)
    if api_key.is_revoked:
        raise AuthenticationError(ERROR_REVOKED)
    if api_key.is_expired:
        raise AuthenticationError(ERROR_EXPIRED)
    if not api_key.user.is_active:
        raise AuthenticationError(ERROR_INVALID)
    api_key_touch_last_used(api_key=api_key, now=timezone.now())
    return api_key
