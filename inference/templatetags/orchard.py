"""Template tags for the admin index: today's usage totals (from the daily roll-ups the user
may see, for those who may view the usage list) and the engine workers (from their
heartbeats); `money`, a cost in nano-units as the pages show it ("12.50 USD"); and a team
report's table rows."""

import html
import logging
import time
from typing import Any

from django import template
from django.conf import settings
from django.utils import timezone
from django.utils.safestring import mark_safe

from common.money import format_money
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


@register.filter
def money(nanos: int | None) -> str:
    return format_money(nanos or 0)


@register.simple_tag
def report_rows(rows: list[dict]) -> str:
    """A team report's table rows, escaped: a template loop over a 90-day report's thousands of
    rows spent most of the page's time localizing and escaping its numbers (bench/reports.py).
    Only the texts are escaped here; the numbers are integers."""
    return mark_safe(
        "".join(
            _ROW.format(
                row["day"].isoformat(),
                html.escape(str(row["model"])),
                html.escape(str(row["key"])),
                html.escape(str(row["member"])),
                html.escape(str(row["tier"])),
                "yes" if row["batch"] else "no",
                int(row["requests"]),
                int(row["prompt_tokens"]),
                int(row["cached_tokens"]),
                int(row["completion_tokens"]),
                int(row["total_tokens"]),
                format_money(row["cost"]),
            )
            for row in rows
        )
    )


_ROW = (
    "<tr><td>{}</td><td>{}</td><td><code>{}…</code></td><td>{}</td><td>{}</td><td>{}</td>"
    "<td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>"
)


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
        "memory": _worker_memory(beat),
        "models": [_model_row(beat.models[name]) for name in sorted(beat.models)],
    }


def _worker_memory(beat) -> str:
    used = f"{int(beat.memory_used_bytes) / 1e6:,.0f}"
    if not beat.memory_max_bytes:
        return f"{used} MB (no budget)"
    return f"{used} of {int(beat.memory_max_bytes) / 1e6:,.0f} MB"


def _model_row(model) -> dict[str, Any]:
    stats = model.stats or {}
    cache = stats.get("prefix_cache") or {}
    cache_max = int(cache.get("max_bytes", 0))
    disk_max = int(cache.get("disk_max_bytes", 0))  # the disk tier's (engine/cache/disk/)
    disk = f"; disk {int(cache.get('disk_bytes', 0)) / 1e6:.1f} of {disk_max / 1e6:.1f} MB"
    state = str(model.state)
    if model.loading and state != "loading":
        state += ", loading a new version"
    return {
        "name": str(model.name),
        "state": state,
        "error": str(model.error)[:300] if model.error else "",
        "memory": f"{int(model.memory_bytes) / 1e6:,.0f} MB" if model.memory_bytes else "-",
        "waiting": int(stats.get("num_waiting", 0)),
        "running": int(stats.get("num_running", 0)),
        "tokens_per_second": f"{float(stats.get('tokens_per_second', 0.0)):.1f}",
        "prefix_cache": (
            f"{int(cache.get('bytes', 0)) / 1e6:.1f} of {cache_max / 1e6:.1f} MB"
            + (disk if disk_max else "")
            if cache_max
            else "off"
        ),
        "restarts": int(model.restarts),
    }


def _short_reason(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    reason = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return reason if len(reason) <= 200 else reason[:199] + "…"
