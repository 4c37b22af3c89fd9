"""GET /healthz and /readyz over real HTTP (no key, no session), and each readiness check
failing on its own: the database, Redis, the default model, the remote workers."""

import httpx
import openai
import pytest
from django.db import connections

from inference.services import health
from inference.services.registry import model_register


def test_healthz_answers_without_a_key_or_a_session(live_server_url):
    response = httpx.get(f"{live_server_url}/healthz")
    assert response.status_code == 200 and response.json() == {"status": "ok"}
    assert "set-cookie" not in response.headers and "csrftoken" not in response.text
    assert httpx.post(f"{live_server_url}/healthz").status_code == 405


def test_readyz_says_which_check_fails(live_server_url, make_key, tiny_models, tmp_path):
    ready = httpx.get(f"{live_server_url}/readyz")
    assert ready.status_code == 200
    assert ready.json() == {"status": "ok", "checks": {"database": "ok", "engine": "ok"}}

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    model_register(name="broken-default", path=broken, make_default=True)
    assert httpx.get(f"{live_server_url}/readyz").status_code == 200  # loads on first use
    client = openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=make_key(), max_retries=0)
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model="broken-default", prompt="Hi", max_tokens=1)
    unready = httpx.get(f"{live_server_url}/readyz")
    assert unready.status_code == 503
    assert unready.json() == {
        "status": "unavailable",
        "checks": {
            "database": "ok",
            "engine": "the default model is not serving (its load failed)",
        },
    }


class Workers:
    def __init__(self, beats):
        self.beats = beats

    def workers(self):
        return self.beats


class Beat:
    def __init__(self, draining: bool):
        self.draining = draining


@pytest.mark.django_db(transaction=True)
async def test_redis_the_database_and_remote_workers_each_fail_on_their_own(
    settings, monkeypatch, sync_thread_db
):
    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there
    settings.ORCHARD_ENGINE = "remote"
    client = Workers([Beat(draining=True)])
    monkeypatch.setattr(health, "get_engine_client", lambda: client)
    result = await health.readiness()
    assert not result.ready
    assert result.checks == {
        "database": "ok",
        "redis": "unreachable (ConnectionError)",
        "engine": "no live engine worker",
    }
    client.beats.append(Beat(draining=False))
    assert (await health.readiness()).checks["engine"] == "ok"

    monkeypatch.setitem(connections["default"].settings_dict, "NAME", "/nonexistent/dir/db")
    await health.sync_to_async(connections.close_all)()
    assert (await health.readiness()).checks["database"] == "unreachable (OperationalError)"
