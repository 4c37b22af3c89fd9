"""Budget alerts: each threshold once per budget and period, by email (Django's test outbox) to
the team's owners and the key's holder, and by webhook to a local HTTP server: signed (the
signature checked here as a receiver would), a failing one retried with backoff and every
attempt logged, a dead one given up; all of it on the background worker, never in the way of the
request that crossed the threshold."""

import datetime
import hashlib
import hmac
import json
import threading
import time
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.core import mail
from django.db import transaction
from django.utils import timezone

from accounts.alerts import alert_worker, alerts_check, deliveries_run_due, signature, spent
from accounts.limits.budgets import budget_limit, budget_limits_for
from accounts.models import AlertWebhook, Budget, BudgetAlert, Membership, WebhookDelivery
from accounts.selectors import month_start
from accounts.services import api_key_monthly_usage_add
from inference.models import DailyUsage
from tests.factories import ApiKeyFactory, MembershipFactory, TeamFactory, UserFactory

pytestmark = pytest.mark.django_db(transaction=True)
TODAY = timezone.now().date()


class Receiver:
    """A local webhook receiver: answers each POST with the next of `statuses` (the last one
    repeats) and keeps what it was sent."""

    def __init__(self, statuses=(200,)):
        self.statuses = list(statuses)
        self.received: list[dict] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.received.append({"headers": dict(self.headers), "body": body})
                status = receiver.statuses[min(len(receiver.received), len(receiver.statuses)) - 1]
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver():
    made = []

    def make(statuses=(200,)):
        made.append(Receiver(statuses))
        return made[-1]

    yield make
    for one in made:
        one.close()


@pytest.fixture
def fast_retries(settings):
    settings.ORCHARD_WEBHOOK_RETRY_SECONDS = 0.05
    settings.ORCHARD_WEBHOOK_MAX_ATTEMPTS = 3
    settings.ORCHARD_WEBHOOK_TIMEOUT_SECONDS = 2


@pytest.fixture
def team_world():
    team = TeamFactory(name="alpha")
    owner = UserFactory(username="olive", email="olive@example.com")
    MembershipFactory(team=team, user=owner, role=Membership.Role.OWNER)
    mia = UserFactory(username="mia", email="mia@example.com")
    key = ApiKeyFactory(team=team, user=mia)
    other = ApiKeyFactory(team=TeamFactory(name="beta"))
    return {"team": team, "owner": owner, "mia": mia, "key": key, "other": other}


def spend(api_key, *, tokens=0, cost=0, day=TODAY):
    """Usage as the roll-up records it, in one transaction: the day's row and the key's month."""
    with transaction.atomic():
        api_key_monthly_usage_add(api_key_id=api_key.pk, month=month_start(day), tokens=tokens)
        record_day(api_key, tokens=tokens, cost=cost, day=day)


def record_day(api_key, *, tokens, cost, day):
    DailyUsage.objects.create(
        date=day,
        team_id=api_key.team_id,
        api_key=api_key,
        model=f"m{DailyUsage.objects.count()}",
        prompt_tokens=tokens,
        output_cost=cost,
    )


def until(condition, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_each_threshold_alerts_once_per_period_by_email(team_world, settings):
    settings.ORCHARD_BUDGET_ALERT_EMAILS = ["owners", "member", "finance@example.com"]
    team, key = team_world["team"], team_world["key"]
    budget = Budget.objects.create(team=team, scope="team", unit="tokens", amount=1000)
    [limit] = [b for b in budget_limits_for(key, TODAY) if b.budget_id == budget.pk]
    assert limit.thresholds == (50, 80, 100)  # the default
    spend(key, tokens=499)
    assert alerts_check([limit]) == [] and mail.outbox == []
    spend(key, tokens=1)  # 50%
    [half] = alerts_check([limit])
    assert half.threshold == 50 and half.used == 500 and half.limit == 1000
    assert alerts_check([limit, limit]) == []  # once, however often it is checked
    spend(key, tokens=400)  # 90%: 80 crossed, 100 not
    assert [a.threshold for a in alerts_check([limit])] == [80]
    spend(key, tokens=200)  # past the limit
    assert [a.threshold for a in alerts_check([limit])] == [100]
    assert alerts_check([limit]) == []
    assert [m.subject for m in mail.outbox] == [
        f"[Orchard] {t}% of a budget used: team alpha: monthly token budget" for t in (50, 80, 100)
    ]
    # A team budget goes to the team's owners and the listed addresses (no member to tell).
    assert mail.outbox[0].to == ["finance@example.com", "olive@example.com"]
    assert "The team alpha has used 50% of its monthly token budget: 500 tokens of 1,000" in (
        mail.outbox[0].body
    )
    # The next month is another period: its thresholds alert again.
    next_month = (TODAY.replace(day=28) + datetime.timedelta(days=4)).replace(day=1)
    spend(key, tokens=600, day=next_month)
    again = budget_limit(budget, next_month)
    assert [a.threshold for a in alerts_check([again])] == [50]
    assert BudgetAlert.objects.filter(threshold=50).count() == 2


def test_a_key_budget_alerts_its_holder_and_a_money_budget_says_its_currency(team_world):
    team, key = team_world["team"], team_world["key"]
    key.budget_tokens = 100  # the key's own monthly token budget alerts too (default thresholds)
    key.save()
    Budget.objects.create(
        team=team,
        scope="key",
        api_key=key,
        unit="money",
        amount=Decimal("2"),
        alert_thresholds=[90],
    )
    spend(key, tokens=60, cost=1_900_000_000)
    written = alerts_check(budget_limits_for(key, TODAY))
    assert sorted((a.unit, a.threshold) for a in written) == [("money", 90), ("tokens", 50)]
    money = next(a for a in written if a.unit == "money")
    assert money.currency == "USD" and money.used == Decimal("1.9")
    message = next(m for m in mail.outbox if "money" in m.subject)
    assert message.to == ["mia@example.com", "olive@example.com"]
    assert "1.90 USD of 2.00 USD" in message.body
    # Another team's key is in none of it.
    assert alerts_check(budget_limits_for(team_world["other"], TODAY)) == []


def test_a_webhook_gets_the_alert_signed(team_world, receiver):
    team, key = team_world["team"], team_world["key"]
    hook = receiver()
    webhook = AlertWebhook.objects.create(team=team, url=hook.url)
    AlertWebhook.objects.create(team=team_world["other"].team, url=hook.url + "/beta")
    Budget.objects.create(
        team=team,
        scope="member",
        user=team_world["mia"],
        unit="tokens",
        amount=100,
        alert_thresholds=[50],
    )
    spend(key, tokens=70)
    [alert] = alerts_check(budget_limits_for(key, TODAY))
    assert deliveries_run_due() is None  # delivered: nothing pending
    [got] = hook.received  # the other team's webhook got nothing
    headers, body = got["headers"], got["body"]
    # What a receiver does: recompute the HMAC of "<timestamp>.<body>" and compare.
    timestamp = headers["X-Orchard-Timestamp"]
    expected = hmac.new(
        webhook.secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256
    ).hexdigest()
    assert hmac.compare_digest(headers["X-Orchard-Signature"], f"sha256={expected}")
    assert abs(int(timestamp) - time.time()) < 300
    assert headers["X-Orchard-Signature"] == signature(webhook.secret, int(timestamp), body)
    payload = json.loads(body)
    assert payload["type"] == "budget.threshold_reached" and payload["id"] == f"alert_{alert.pk}"
    assert payload["team"] == {"id": team.pk, "name": "alpha"}
    assert payload["threshold"] == 50 and payload["used"] == 70
    assert payload["budget"]["scope"] == "member" and payload["budget"]["member"] == "mia"
    assert payload["budget"]["limit"] == 100 and payload["budget"]["unit"] == "tokens"
    delivery = WebhookDelivery.objects.get(webhook=webhook)
    assert delivery.status == "delivered" and delivery.attempts == 1
    assert delivery.log[0]["status_code"] == 200


def test_a_failing_webhook_is_retried_with_backoff_and_every_attempt_logged(
    team_world, receiver, fast_retries
):
    team, key = team_world["team"], team_world["key"]
    flaky = receiver([500, 503, 200])
    dead = receiver([500])
    AlertWebhook.objects.create(team=team, url=flaky.url)
    AlertWebhook.objects.create(team=None, url=dead.url)  # global: every team's alerts
    AlertWebhook.objects.create(team=team, url="http://127.0.0.1:1/nothing-listens")
    Budget.objects.create(team=team, unit="tokens", amount=10, alert_thresholds=[100])
    spend(key, tokens=10)
    alerts_check(budget_limits_for(key, TODAY))
    first_wait = deliveries_run_due()
    assert 0 < first_wait <= 0.05  # every first attempt failed or was refused: a retry is due
    assert until(lambda: deliveries_run_due() is None)
    flaky_row, dead_row, refused_row = WebhookDelivery.objects.order_by("webhook_id")
    assert flaky_row.status == "delivered" and flaky_row.attempts == 3
    assert [e["status_code"] for e in flaky_row.log] == [500, 503, 200]
    assert len(flaky.received) == 3
    # Each attempt is signed afresh, over the same body.
    assert len({r["body"] for r in flaky.received}) == 1
    assert dead_row.status == "failed" and dead_row.attempts == 3
    assert dead_row.last_status_code == 500 and "HTTP 500" in dead_row.last_error
    assert refused_row.status == "failed" and refused_row.last_status_code is None
    assert "Connection refused" in refused_row.last_error or "Errno" in refused_row.last_error
    times = [datetime.datetime.fromisoformat(e["at"]) for e in flaky_row.log]
    assert times == sorted(times)


def test_the_worker_sends_alerts_in_the_background_once(team_world, receiver):
    team, key = team_world["team"], team_world["key"]
    hook = receiver()
    AlertWebhook.objects.create(team=team, url=hook.url)
    Budget.objects.create(team=team, unit="tokens", amount=100, alert_thresholds=[50])
    spend(key, tokens=50)
    budgets = budget_limits_for(key, TODAY)
    for _ in range(20):  # a burst of finished requests
        spent(budgets)
    assert alert_worker.idle(timeout=20)
    assert len(mail.outbox) == 1 and len(hook.received) == 1
    assert BudgetAlert.objects.count() == 1


def test_a_broken_alert_path_never_reaches_the_request(team_world, monkeypatch, caplog):
    """The settlement's only call is `spent`: it neither raises nor waits, whatever the worker
    meets."""
    from accounts.alerts import checks

    def broken(*args, **kwargs):
        raise RuntimeError("the mail server is on fire")

    monkeypatch.setattr(checks, "budget_used", broken)
    key = team_world["key"]
    Budget.objects.create(team=team_world["team"], unit="tokens", amount=1)
    spent(budget_limits_for(key, TODAY))  # returns at once
    assert alert_worker.idle(timeout=20)
    assert "budget alerts: a check or a delivery failed" in caplog.text
    assert BudgetAlert.objects.count() == 0
