"""API key format: `sk-orch-` + 40 base62 characters (~238 bits). The first 16 characters are the
stored lookup prefix; the whole key is stored only as a SHA-256 digest. A fast hash is right for
keys this random (there is nothing to brute-force), and a cheap format check runs before any query.
"""

import hashlib
import hmac
import re
import secrets
import string

KEY_PREFIX = "sk-orch-"
SECRET_LENGTH = 40
LOOKUP_PREFIX_LENGTH = len(KEY_PREFIX) + 8
_ALPHABET = string.ascii_letters + string.digits
_KEY_RE = re.compile(rf"^{re.escape(KEY_PREFIX)}[A-Za-z0-9]{{{SECRET_LENGTH}}}$")
_KEY_IN_TEXT_RE = re.compile(rf"{re.escape(KEY_PREFIX)}[A-Za-z0-9]+")


def generate_key() -> str:
    return KEY_PREFIX + "".join(secrets.choice(_ALPHABET) for _ in range(SECRET_LENGTH))


def is_well_formed(raw_key: str) -> bool:
    return bool(_KEY_RE.match(raw_key))


def lookup_prefix(raw_key: str) -> str:
    return raw_key[:LOOKUP_PREFIX_LENGTH]


def redact_keys(text: str) -> str:
    """`text` with anything key-shaped in it cut to its lookup prefix: safe to echo, log or put in
    a URL, and still enough to find the key."""
    return _KEY_IN_TEXT_RE.sub(lambda match: lookup_prefix(match.group()), text)


def presented_key(authorization: str | None, x_api_key: str | None = None) -> str | None:
    """The key a request presents: `x_api_key` (the `x-api-key` header of Anthropic's clients)
    when given, else the token of an `Authorization: Bearer <key>` header; None for neither."""
    if x_api_key:
        return x_api_key
    parts = (authorization or "").split()
    if len(parts) == 2 and parts[0].lower() == "bearer":
        return parts[1]
    return None


def digest(raw_key: str) -> str:
    return hashlib.sha256(raw_key.encode()).hexdigest()


def digest_matches(raw_key: str, stored_digest: str) -> bool:
    return hmac.compare_digest(digest(raw_key), stored_digest)
