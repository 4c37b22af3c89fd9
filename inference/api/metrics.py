"""GET /metrics: Prometheus's text format, never public by accident.

A scrape authenticates with `Authorization: Bearer <ORCHARD_METRICS_TOKEN>` when that setting is
set (what a Prometheus server is given), or with an Orchard API key whose user is staff.
Anything else is a 401 (no or unknown credentials) or a 403 (a key of a non-staff user)."""

from __future__ import annotations

import hmac

from asgiref.sync import sync_to_async
from django.conf import settings
from django.http import HttpRequest, HttpResponse
from django.views.decorators.http import require_GET
from prometheus_client import CONTENT_TYPE_LATEST

from accounts.authentication import AuthenticationError, authenticate_header
from inference.services.engines import get_engine_client, registered_names
from inference.services.metrics import exposition
from inference.services.tenants import tenant_labels


def _refused(status: int, message: str) -> HttpResponse:
    response = HttpResponse(message + "\n", status=status, content_type="text/plain")
    if status == 401:
        response["WWW-Authenticate"] = 'Bearer realm="metrics"'
    return response


async def _allowed(request: HttpRequest) -> HttpResponse | None:
    header = request.headers.get("Authorization") or ""
    token = settings.ORCHARD_METRICS_TOKEN
    if token and hmac.compare_digest(header.encode(), f"Bearer {token}".encode()):
        return None
    if not header:
        return _refused(401, "Metrics need a bearer token or a staff API key.")
    try:
        api_key = await sync_to_async(authenticate_header)(header)
    except AuthenticationError:
        return _refused(401, "Unknown metrics token or API key.")
    if not api_key.user.is_staff:
        return _refused(403, "Metrics are for staff keys (or ORCHARD_METRICS_TOKEN).")
    return None


@require_GET
async def metrics(request: HttpRequest) -> HttpResponse:
    refused = await _allowed(request)
    if refused is not None:
        return refused
    client = get_engine_client()
    stats = await client.stats()
    tenants = {tenant for s in stats for tenant in s.tenants}
    teams = await sync_to_async(tenant_labels)(tenants) if tenants else {}
    names = await sync_to_async(registered_names)()
    statuses = [client.model_status(name) for name in names]
    body = exposition(stats, teams, statuses=statuses, budgets=client.memory_budgets())
    return HttpResponse(body, content_type=CONTENT_TYPE_LATEST)
