"""GET /healthz (the process answers) and GET /readyz (it can serve: the checks of
inference/services/health.py), for load balancers and orchestrators: no key, no session, and
the API's light middleware (config/asgi.py)."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views.decorators.http import require_GET

from inference.services.health import readiness


@require_GET
async def healthz(request: HttpRequest) -> HttpResponse:
    return JsonResponse({"status": "ok"}, headers={"Cache-Control": "no-store"})


@require_GET
async def readyz(request: HttpRequest) -> HttpResponse:
    result = await readiness()
    body = {"status": "ok" if result.ready else "unavailable", "checks": result.checks}
    response = JsonResponse(
        body, status=200 if result.ready else 503, headers={"Cache-Control": "no-store"}
    )
    # A 503 here is an answer, not a failure of the request: Django's request logger would
    # log each probe at ERROR while a model loads (the engine logs its own load errors).
    response._has_been_logged = True
    return response
