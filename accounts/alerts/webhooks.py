"""Budget alerts by webhook: one `WebhookDelivery` per alert and webhook (the team's and the
global ones), POSTed by the alerts' background worker, signed, and retried with exponential
backoff.

Each attempt sends the delivery's JSON body with `X-Orchard-Timestamp` (Unix seconds, the
attempt's) and `X-Orchard-Signature: sha256=<hex>`, the HMAC-SHA256 under the webhook's secret
of the timestamp, a dot, and the body's bytes: a receiver recomputes it, compares in constant
time, and rejects old timestamps (a replayed delivery). A 2xx answer delivers it; anything else
(another status, a redirect, a timeout, a refused connection) is an attempt logged with its
status code or error, and the next is due ORCHARD_WEBHOOK_RETRY_SECONDS later, doubling each
time, until ORCHARD_WEBHOOK_MAX_ATTEMPTS (then the delivery is failed). A due delivery is
claimed with one conditional UPDATE, so of several processes one sends it; a delivery whose
process died is claimed again once its claim lapses.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
import time
import urllib.error
import urllib.request

from django.conf import settings
from django.db.models import Min, Q
from django.utils import timezone

from accounts.models import AlertWebhook, BudgetAlert, WebhookDelivery

EVENT = "budget.threshold_reached"
SIGNATURE_HEADER = "X-Orchard-Signature"
TIMESTAMP_HEADER = "X-Orchard-Timestamp"
MAX_ERROR_CHARS = 500


def signature(secret: str, timestamp: int, body: bytes) -> str:
    """The X-Orchard-Signature value for `body` sent at `timestamp`."""
    signed = str(timestamp).encode() + b"." + body
    return "sha256=" + hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def alert_body(alert: BudgetAlert) -> str:
    """The JSON a webhook receives: amounts as exact decimal strings (money) or integers
    (tokens)."""
    tokens = alert.unit == "tokens"

    def amount(value):
        return int(value) if tokens else f"{value.normalize():f}"

    return json.dumps(
        {
            "id": f"alert_{alert.pk}",
            "type": EVENT,
            "created": int(alert.created_at.timestamp()),
            "team": {"id": alert.team_id, "name": alert.team.name},
            "budget": {
                "id": alert.budget_id,
                "scope": alert.scope,
                "unit": alert.unit,
                "description": alert.description,
                "period_start": alert.period_start.isoformat(),
                "period_end": alert.period_end.isoformat(),
                "limit": amount(alert.limit),
                "currency": alert.currency or None,
                "member": alert.user.username if alert.user_id else None,
                "api_key": f"{alert.api_key.prefix}" if alert.api_key_id else None,
            },
            "threshold": alert.threshold,
            "used": amount(alert.used),
        },
        separators=(",", ":"),
    )


def deliveries_create(alert: BudgetAlert) -> list[WebhookDelivery]:
    """A pending delivery of `alert` to each enabled webhook of its team, and each global one."""
    hooks = AlertWebhook.objects.filter(enabled=True).filter(
        Q(team_id=alert.team_id) | Q(team__isnull=True)
    )
    body = alert_body(alert)
    now = timezone.now()
    return [
        WebhookDelivery.objects.create(webhook=hook, alert=alert, body=body, next_attempt_at=now)
        for hook in hooks
    ]


def _due(now: datetime.datetime) -> Q:
    unclaimed = Q(claimed_until__isnull=True) | Q(claimed_until__lt=now)
    return Q(status=WebhookDelivery.Status.PENDING, next_attempt_at__lte=now) & unclaimed


def deliveries_run_due(*, batch: int = 50) -> float | None:
    """Attempt every delivery that is due (those this process claims); then the seconds until
    the next pending one is due (0: now), or None when none is pending."""
    now = timezone.now()
    claim = datetime.timedelta(seconds=2 * settings.ORCHARD_WEBHOOK_TIMEOUT_SECONDS + 30)
    due = WebhookDelivery.objects.filter(_due(now)).order_by("next_attempt_at")
    for pk in list(due.values_list("pk", flat=True)[:batch]):
        if WebhookDelivery.objects.filter(_due(now), pk=pk).update(claimed_until=now + claim):
            _attempt(WebhookDelivery.objects.select_related("webhook").get(pk=pk))
    # The next one due, or the first claim (another process's) to lapse, whichever is sooner.
    now = timezone.now()
    pending = WebhookDelivery.objects.filter(status=WebhookDelivery.Status.PENDING)
    unclaimed = pending.filter(Q(claimed_until__isnull=True) | Q(claimed_until__lt=now))
    times = [
        unclaimed.aggregate(at=Min("next_attempt_at"))["at"],
        pending.filter(claimed_until__gte=now).aggregate(at=Min("claimed_until"))["at"],
    ]
    times = [at for at in times if at is not None]
    if not times:
        return None
    return max(0.0, (min(times) - now).total_seconds())


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None  # a 3xx is an answer like any other non-2xx: logged, retried


_opener = urllib.request.build_opener(_NoRedirects)


def _post(delivery: WebhookDelivery) -> tuple[int | None, str]:
    """One attempt: (status code or None, error or "")."""
    body = delivery.body.encode()
    timestamp = int(time.time())
    request = urllib.request.Request(
        delivery.webhook.url,
        data=body,
        method="POST",
        headers={
            "Content-Type": "application/json",
            "User-Agent": "Orchard-Webhooks",
            "X-Orchard-Event": EVENT,
            "X-Orchard-Delivery": str(delivery.pk),
            TIMESTAMP_HEADER: str(timestamp),
            SIGNATURE_HEADER: signature(delivery.webhook.secret, timestamp, body),
        },
    )
    try:
        with _opener.open(request, timeout=settings.ORCHARD_WEBHOOK_TIMEOUT_SECONDS) as answer:
            return answer.status, ""
    except urllib.error.HTTPError as exc:
        return exc.code, f"HTTP {exc.code} {exc.reason}"
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def _attempt(delivery: WebhookDelivery) -> None:
    started = time.monotonic()
    status_code, error = _post(delivery)
    now = timezone.now()
    delivered = status_code is not None and 200 <= status_code < 300
    delivery.attempts += 1
    delivery.last_status_code = status_code
    delivery.last_error = error[:MAX_ERROR_CHARS]
    delivery.log = [
        *delivery.log,
        {
            "at": now.isoformat(timespec="seconds"),
            "status_code": status_code,
            "error": error[:MAX_ERROR_CHARS],
            "ms": int((time.monotonic() - started) * 1000),
        },
    ]
    delivery.claimed_until = None
    if delivered:
        delivery.status, delivery.delivered_at = WebhookDelivery.Status.DELIVERED, now
    elif delivery.attempts >= settings.ORCHARD_WEBHOOK_MAX_ATTEMPTS:
        delivery.status = WebhookDelivery.Status.FAILED
    else:
        backoff = settings.ORCHARD_WEBHOOK_RETRY_SECONDS * 2 ** (delivery.attempts - 1)
        delivery.next_attempt_at = now + datetime.timedelta(seconds=backoff)
    delivery.save()
