"""Team and member budgets, in tokens and in money, at the real HTTP API: 32 concurrent requests
from several keys never finish past a budget; the refusals are 429s in each route's own shape
naming the budget that ran out; each usage row records its cost at the model's price; another
member and another team go on untouched; an alert crossing reaches a webhook, signed."""

import asyncio
import datetime
import hashlib
import hmac
import json
import threading
import time
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import openai
import pytest
from django.utils import timezone

from accounts.models import AlertWebhook, Budget
from accounts.services import api_key_create, team_membership_ensure, user_get_or_create
from inference.models import ModelEntry, ModelPrice, UsageRecord
from inference.services.prices import Price
from tests.inference.conftest import TINY, alerts_settled

BODY = {
    "model": TINY,
    "messages": [{"role": "user", "content": "Hi"}],
    "max_tokens": 8,
    "temperature": 0,
    "ignore_eos": True,
}


def member_key(username: str, team: str) -> tuple[str, object]:
    user = user_get_or_create(username=username)
    team_obj, _ = team_membership_ensure(user=user, team_name=team)
    _, raw = api_key_create(user=user, team=team_obj)
    return raw, team_obj


def burst(url: str, keys: list[str], n: int = 32) -> list[httpx.Response]:
    """`n` chat requests at once, the keys taking turns."""

    async def run():
        async with httpx.AsyncClient(
            base_url=url, timeout=120, limits=httpx.Limits(max_connections=n + 4)
        ) as client:
            return await asyncio.gather(
                *(
                    client.post(
                        "/v1/chat/completions",
                        json=BODY,
                        headers={"Authorization": f"Bearer {keys[i % len(keys)]}"},
                    )
                    for i in range(n)
                )
            )

    return asyncio.run(run())


def one_request_tokens(url: str, key: str) -> int:
    reply = httpx.post(
        f"{url}/v1/chat/completions",
        json=BODY,
        headers={"Authorization": f"Bearer {key}"},
        timeout=120,
    )
    assert reply.status_code == 200, reply.text
    return reply.json()["usage"]["total_tokens"]


def test_a_team_token_budget_holds_under_32_concurrent_requests(live_server_url, tiny_models):
    mia, team = member_key("mia", "alpha")
    carl, _ = member_key("carl", "alpha")
    stranger, _ = member_key("sam", "beta")
    per_request = one_request_tokens(live_server_url, stranger)  # what each request uses
    Budget.objects.create(team=team, scope="team", unit="tokens", amount=10 * per_request + 5)
    replies = burst(live_server_url, [mia, carl])
    statuses = [r.status_code for r in replies]
    assert set(statuses) == {200, 429}
    refusal = next(r for r in replies if r.status_code == 429).json()["error"]
    assert refusal["type"] == "insufficient_quota" and refusal["code"] == "insufficient_quota"
    assert refusal["message"].startswith("This team's monthly token budget is exhausted")
    assert "team alpha" in refusal["message"]
    used = sum(
        r.total_tokens
        for r in UsageRecord.objects.filter(team=team, status=UsageRecord.Status.COMPLETED)
    )
    assert used <= 10 * per_request + 5  # never past the budget
    assert used == 10 * per_request  # and short of it by less than one request
    assert statuses.count(200) == 10
    # Team beta's key is not touched by alpha's budget.
    assert one_request_tokens(live_server_url, stranger) == per_request
    assert alerts_settled(2) == 2  # the team budget's 50 and 80 % alerts (10 requests of 10.x)


def test_a_member_money_budget_holds_and_rows_record_their_cost(live_server_url, tiny_models):
    entry = ModelEntry.objects.get(name=TINY)
    row = ModelPrice.objects.create(
        model=entry,
        effective_from=timezone.now() - datetime.timedelta(minutes=1),
        input_per_million=Decimal("2"),
        output_per_million=Decimal("4"),
    )
    price = Price.of(row)
    mia, team = member_key("mia", "alpha")
    mia_user = user_get_or_create(username="mia")
    mia_second = api_key_create(user=mia_user, team=team)[1]
    carl, _ = member_key("carl", "alpha")
    limit = Decimal("0.0005")  # 500,000 nano-units: about 9 of these requests
    Budget.objects.create(team=team, scope="member", user=mia_user, unit="money", amount=limit)
    replies = burst(live_server_url, [mia, mia_second])
    # Under the burst, requests in flight hold their reservations (tokens × the dearest
    # price); one at a time afterwards, the budget is spent to within one reservation.
    assert {r.status_code for r in replies} == {200, 429}
    while True:
        reply = httpx.post(
            f"{live_server_url}/v1/chat/completions",
            json=BODY,
            headers={"Authorization": f"Bearer {mia}"},
            timeout=120,
        )
        if reply.status_code != 200:
            break
    assert reply.status_code == 429
    refusal = reply.json()["error"]
    assert refusal["message"].startswith("This member's monthly money budget is exhausted")
    assert "member mia in alpha" in refusal["message"] and "USD" in refusal["message"]
    rows = list(UsageRecord.objects.filter(user=mia_user, status="completed"))
    for row in rows:  # each at the model's price
        expected = price.cost(
            prompt_tokens=row.prompt_tokens,
            cached_tokens=row.cached_tokens,
            completion_tokens=row.completion_tokens,
        )
        assert (row.input_cost, row.cached_input_cost, row.output_cost) == (
            expected.input,
            expected.cached_input,
            expected.output,
        )
    spent = sum(row.cost for row in rows)
    assert spent <= 500_000
    # Short of it by less than one request's reservation (its tokens at the dearest price).
    assert 500_000 - spent < rows[0].reserved_tokens * price.token_cost
    # Carl, in the same team, still works.
    assert one_request_tokens(live_server_url, carl) > 0
    assert alerts_settled(2) >= 2  # Mia's budget's 50 and 80 % alerts, at least


def test_budget_refusals_in_openai_and_anthropic_shapes(live_server_url, tiny_models):
    raw, team = member_key("mia", "alpha")
    Budget.objects.create(team=team, scope="team", unit="tokens", amount=0)
    client = openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=raw, max_retries=0)
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model=TINY, messages=BODY["messages"], max_tokens=4)
    assert caught.value.code == "insufficient_quota"
    assert caught.value.body["type"] == "insufficient_quota"
    assert "team's monthly token budget is exhausted" in caught.value.body["message"]
    assert caught.value.response.headers["x-should-retry"] == "false"
    claude = anthropic.Anthropic(base_url=live_server_url, api_key=raw, max_retries=0)
    with pytest.raises(anthropic.RateLimitError) as refused:
        claude.messages.create(
            model=TINY, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "rate_limit_error"
    assert "team's monthly token budget is exhausted" in refused.value.body["error"]["message"]


class Receiver:
    def __init__(self):
        self.received = []
        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append((dict(self.headers), body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/orchard"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_a_request_crossing_a_threshold_sends_a_signed_webhook(live_server_url, tiny_models):
    raw, team = member_key("mia", "alpha")
    receiver = Receiver()
    try:
        hook = AlertWebhook.objects.create(team=team, url=receiver.url)
        per_request = one_request_tokens(live_server_url, member_key("sam", "beta")[0])
        Budget.objects.create(
            team=team, unit="tokens", amount=3 * per_request, alert_thresholds=[50]
        )
        one_request_tokens(live_server_url, raw)  # 33%: nothing
        one_request_tokens(live_server_url, raw)  # 67%: the 50% alert
        deadline = time.monotonic() + 20
        while not receiver.received and time.monotonic() < deadline:
            time.sleep(0.05)
        [(headers, body)] = receiver.received
        signed = headers["X-Orchard-Timestamp"].encode() + b"." + body
        digest = hmac.new(hook.secret.encode(), signed, hashlib.sha256).hexdigest()
        assert headers["X-Orchard-Signature"] == f"sha256={digest}"
        payload = json.loads(body)
        assert payload["threshold"] == 50 and payload["used"] == 2 * per_request
        assert payload["team"]["name"] == "alpha"
    finally:
        receiver.server.shutdown()
        receiver.server.server_close()
