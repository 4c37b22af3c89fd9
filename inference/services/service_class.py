"""Whose share of the engine a request uses, and how urgently: its `engine.ServiceClass`.

The engine's scheduler divides the engine between teams with requests waiting in proportion to
their `weight` (the tenant is the key's team), within a team between its keys (the principal),
and serves higher tiers first (engine.SERVICE_TIERS: priority, default, flex). A request says
which tiers it accepts, most wanted first (its `service_tier`, read by the endpoint:
inference/api/serializers.py); it is served in the first of them its key may use
(`ApiKey.service_tiers`; priority is granted by a superuser), and a request whose key may use
none of them is a 400 before anything is reserved.
"""

from __future__ import annotations

from collections.abc import Sequence

from accounts.models import ApiKey
from engine import ServiceClass
from inference.errors import APIError
from inference.services.tenants import tenant_of

# What a request that names no tier accepts (OpenAI's "auto"): default, else what the key has.
AUTO_TIERS = ("default", "flex", "priority")
# The tier every line of a batch runs in (/v1/batches), the lowest.
BATCH_TIER = "flex"
ERROR_TIER_NOT_ALLOWED = (
    "This API key may not use service_tier {requested}; it may use {allowed} (an administrator "
    "grants the others)."
)


def service_tier_resolve(*, allowed: Sequence[str], accepted: Sequence[str]) -> str:
    """The first of the `accepted` tiers that is `allowed`; a 400 (`param: service_tier`)
    naming the allowed ones when there is none."""
    for tier in accepted:
        if tier in allowed:
            return tier
    raise APIError(
        400,
        ERROR_TIER_NOT_ALLOWED.format(
            requested=" or ".join(f"'{tier}'" for tier in accepted),
            allowed=", ".join(f"'{tier}'" for tier in allowed) or "no tier",
        ),
        param="service_tier",
    )


def service_class(*, api_key: ApiKey, accepted: Sequence[str], batch: bool = False) -> ServiceClass:
    """The service class of a request by `api_key` that accepts the `accepted` tiers (the key's
    team is loaded with it: accounts.authentication). A line of a batch (`batch`) is served in
    BATCH_TIER whatever it asks for: batches use what interactive traffic leaves."""
    tier = BATCH_TIER
    if not batch:
        tier = service_tier_resolve(allowed=api_key.service_tiers, accepted=accepted)
    return ServiceClass(
        tenant=tenant_of(api_key.team_id),
        weight=float(api_key.team.weight),
        principal=f"key:{api_key.pk}",
        tier=tier,
    )
