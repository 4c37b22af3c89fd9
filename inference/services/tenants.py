"""Tenants of the engine's fair share (engine/core/fairness.py): each team is one, named
`team:<id>` in `ServiceClass.tenant`; `tenant_labels` turns the names the engines report back
into team names for people (metrics, the admin's dashboard)."""

from __future__ import annotations

from collections.abc import Iterable

from accounts.models import Team

PREFIX = "team:"


def tenant_of(team_id: int) -> str:
    return f"{PREFIX}{team_id}"


def tenant_labels(tenants: Iterable[str]) -> dict[str, str]:
    """Team names by tenant; a tenant that is no team (or no longer one) keeps its id."""
    tenants = set(tenants)
    ids = {
        int(t[len(PREFIX) :])
        for t in tenants
        if t.startswith(PREFIX) and t[len(PREFIX) :].isdigit()
    }
    names = dict(Team.objects.filter(pk__in=ids).values_list("pk", "name"))
    labels = {}
    for tenant in tenants:
        suffix = tenant[len(PREFIX) :]
        labels[tenant] = names.get(int(suffix), tenant) if suffix.isdigit() else (tenant or "-")
    return labels
