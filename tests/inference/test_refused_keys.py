"""Keys over their rpm answered in front of Django while their refusal is held
(inference/refused_keys.py, inference/services/held_refusals.py): over real HTTP with two teams,
and the hold's own rules."""

import time
from types import SimpleNamespace

import httpx

from accounts.limits import RateLimitExceeded
from inference.services import held_refusals
from inference.services.held_refusals import RefusedKeys
from tests.inference.conftest import TINY, refused_count

MESSAGES = [{"role": "user", "content": "Hi"}]


def test_a_flooding_key_is_refused_before_django_and_another_team_is_answered(
    live_server_url, make_key, tiny_models
):
    flooding, other = make_key(rpm=1), make_key("bob", "team-b", rpm=100)
    body = {"model": TINY, "messages": MESSAGES, "max_tokens": 1}
    with httpx.Client(base_url=live_server_url, timeout=60) as http:
        auth = {"Authorization": f"Bearer {flooding}"}
        assert http.post("/v1/chat/completions", json=body, headers=auth).status_code == 200
        refused = [http.post("/v1/chat/completions", json=body, headers=auth) for _ in range(8)]
        assert {r.status_code for r in refused} == {429}
        # Held ones are answered a quarter of a second late: most of them here.
        assert sum(r.elapsed.total_seconds() >= 0.24 for r in refused) >= 4
        first = refused[0].json()["error"]  # the limiter's own refusal
        assert first["code"] == "rate_limit_exceeded"
        for response in refused:
            error = response.json()["error"]
            assert error.pop("message").startswith("Rate limit reached for requests per minute")
            assert error == {k: v for k, v in first.items() if k != "message"}
            assert int(response.headers["retry-after"]) >= 1
            assert response.headers["x-ratelimit-limit-requests"] == "1"
            assert response.headers["x-request-id"].startswith("req_")
        # The hold reads the key where the route's view would: OpenAI's routes take no x-api-key.
        unauthenticated = http.post(
            "/v1/chat/completions", json=body, headers={"x-api-key": flooding}
        )
        assert unauthenticated.status_code == 401
        # Held per route: /v1/models (no rpm of its own) still answers the flooding key.
        assert http.get("/v1/models", headers=auth).status_code == 200
        # Anthropic's route answers in Anthropic's shape, held or not.
        anthropic = {"x-api-key": flooding, "anthropic-version": "2023-06-01"}
        messages = {"model": TINY, "messages": MESSAGES, "max_tokens": 1}
        for _ in range(2):
            response = http.post("/v1/messages", json=messages, headers=anthropic)
            assert response.status_code == 429
            assert response.json()["type"] == "error"
            assert response.json()["error"]["type"] == "rate_limit_error"
        answered = http.post(
            "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {other}"}
        )
        assert answered.status_code == 200
    assert refused_count(10) == 10  # every refusal counted, held or not


def refusal(limit: str = "requests", retry_ms: int = 30_000) -> RateLimitExceeded:
    return RateLimitExceeded(
        "over", code="rate_limit_exceeded", limit=limit, headers={"retry-after-ms": str(retry_ms)}
    )


RAW = "sk-orch-" + "a" * 40


def key():
    from accounts import keys

    return SimpleNamespace(digest=keys.digest(RAW))


def test_a_hold_ends_after_its_time_or_the_windows_retry_whichever_is_first():
    held = RefusedKeys(hold_s=0.2)
    held.remember(key(), refusal(), path="/v1/chat/completions", endpoint="chat.completions")
    refusal_, endpoint = held.held(RAW, "/v1/chat/completions")
    assert endpoint == "chat.completions" and refusal_.message == "over"
    assert held.held(RAW, "/v1/completions") is None  # only where it was refused
    assert held.held("sk-orch-" + "b" * 40, "/v1/chat/completions") is None
    time.sleep(0.25)
    assert held.held(RAW, "/v1/chat/completions") is None
    held.remember(key(), refusal(retry_ms=50), path="/v1/completions", endpoint="completions")
    assert held.held(RAW, "/v1/completions") is not None
    time.sleep(0.1)
    assert held.held(RAW, "/v1/completions") is None  # the window let the key in again


def test_a_hold_ending_before_the_window_lets_one_probe_through(monkeypatch):
    monkeypatch.setattr(held_refusals, "PROBE_S", 0.2)
    held = RefusedKeys(hold_s=0.1)
    path = "/v1/chat/completions"
    held.remember(key(), refusal(), path=path, endpoint="chat.completions")
    time.sleep(0.15)
    # The hold is over: one request goes through to Django and the limiter...
    assert held.held(RAW, path) is None
    # ...while the key's other requests are still answered in front of Django.
    assert all(held.held(RAW, path) is not None for _ in range(5))
    # The probe refused again renews the hold.
    held.remember(key(), refusal(), path=path, endpoint="chat.completions")
    assert held.held(RAW, path) is not None
    time.sleep(0.15)
    assert held.held(RAW, path) is None  # the next probe
    # The probe let in (a raised limit) ends the hold at once.
    held.admitted(key())
    assert held.held(RAW, path) is None and held.held(RAW, path) is None
    # A probe with no verdict within PROBE_S ends it too.
    held.remember(key(), refusal(), path=path, endpoint="chat.completions")
    time.sleep(0.15)
    assert held.held(RAW, path) is None and held.held(RAW, path) is not None
    time.sleep(0.25)
    assert held.held(RAW, path) is None and held.held(RAW, path) is None


def test_only_rpm_refusals_are_held():
    held = RefusedKeys()
    for limit in ("tokens", "parallel", "budget"):
        held.remember(key(), refusal(limit), path="/v1/completions", endpoint="completions")
        assert held.held(RAW, "/v1/completions") is None
