"""Template tags for the admin index: today's usage totals (from the daily roll-ups the user
may see, for those who may view the usage list) and the engine workers (from their
heartbeats)."""

import logging
import time
from typing import Any

from django import template
from django.conf import settings
from django.utils import timezone

from inference.admin.lists import admin_list_rows
from inference.models import UsageRecord
from inference.services import reports
from inference.services.usage import daily_usage_visible_to

logger = logging.getLogger(__name__)
register = template.Library()


@register.simple_tag(takes_context=True)
def orchard_today_totals(context) -> dict[str, int] | None:
    request = context["request"]
    if admin_list_rows(request, UsageRecord) is None:
        return None
    today = timezone.now().date()
    rows = daily_usage_visible_to(user=request.user).filter(date=today)
    return reports.totals(rows)


@register.simple_tag
def orchard_engine_workers() -> dict[str, Any]:
    """The live engine workers as plain values for the admin index: `mode` ("local" or
    "remote"), `workers` (one dict per worker, its models sorted by name) and `error` (a short
    reason when the workers could not be read). Worker-supplied strings are left as they are:
    the template escapes them."""
    if settings.ORCHARD_ENGINE == "local":
        return {"mode": "local", "workers": [], "error": None}
    try:
        from inference.services.engines import get_engine_client

        beats = get_engine_client().workers()
        now = time.time()
        workers = [_worker_row(beat, now) for beat in sorted(beats, key=lambda b: b.worker_id)]
    except Exception as exc:
        logger.warning("the admin could not read the engine workers: %s", exc)
        return {"mode": "remote", "workers": [], "error": _short_reason(exc)}
    return {"mode": "remote", "workers": workers, "error": None}


def _worker_row(beat, now: float) -> dict[str, Any]:
    return {
        "worker_id": str(beat.worker_id),
        "host": str(beat.host),
        "pid": int(beat.pid),
        "state": "draining" if beat.draining else "serving",
        "model_filter": ", ".join(str(m) for m in beat.model_filter) if beat.model_filter else "",
        "beat_age_s": f"{max(0.0, now - float(beat.at)):.1f}",
        "models": [_model_row(beat.models[name]) for name in sorted(beat.models)],
    }


def _model_row(model) -> dict[str, Any]:
    stats = model.stats or {}
    cache = stats.get("prefix_cache") or {}
    cache_max = int(cache.get("max_bytes", 0))
    state = str(model.state)
    if model.loading and state != "loading":
        state += ", loading a new version"
    return {
        "name": str(model.name),
        "state": state,
        "error": str(model.error)[:300] if model.error else "",
        "waiting": int(stats.get("num_waiting", 0)),
        "running": int(stats.get("num_running", 0)),
        "tokens_per_second": f"{float(stats.get('tokens_per_second', 0.0)):.1f}",
        "prefix_cache": (
            f"{int(cache.get('bytes', 0)) / 1e6:.1f} of {cache_max / 1e6:.1f} MB"
            if cache_max
            else "off"
        ),
        "restarts": int(model.restarts),
    }


def _short_reason(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return reason if len(reason) <= 200 else reason[:199] + "…"
