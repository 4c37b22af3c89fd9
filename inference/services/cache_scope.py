"""Whose cached prompts a request may reuse: its prefix-cache scope.

The engine reuses a prompt's computed state only within one scope
(`GenerationRequest.cache_scope`). If two callers shared a scope, one could learn the other's
prompts: a prefix that hits is reported in `cached_tokens` and answered sooner, so a guessed
system prompt can be confirmed a token at a time. So the scope is the key's team: its members
share their cache (the same system prompts, the same agents), other teams never meet it.

A model with `prefix_cache_shared` drops the team part (one cache for everyone: for models that
serve public prompts, where the hits are worth more than the privacy). A request's `cache_salt`
narrows its scope further: only requests with the same salt (and team) share.
"""

from __future__ import annotations

import hashlib

from accounts.models import ApiKey
from inference.models import ModelEntry

SHARED_SCOPE = "shared"


def prefix_cache_scope(*, api_key: ApiKey, entry: ModelEntry, salt: str | None = None) -> str:
    """The cache scope of a request by `api_key` to the model `entry`, with the caller's
    `salt` (already validated at the edge: a non-empty string)."""
    scope = SHARED_SCOPE if entry.prefix_cache_shared else f"team:{api_key.team_id}"
    if salt is None:
        return scope
    # Hashed: a fixed length, and no text of the caller's travels to the engine workers.
    return f"{scope}/salt:{hashlib.sha256(salt.encode()).hexdigest()}"
