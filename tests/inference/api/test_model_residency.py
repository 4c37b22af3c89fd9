"""Models in one memory budget, over real HTTP with the official clients: a server whose budget
holds one model loads the default at start and the other on its first request; while the loaded
model is busy, the other's requests get a 503 with Retry-After in each route's shape (never an
over-committed machine); an idle model unloads after its time and /metrics shows each state."""

import re
import time

import anthropic
import httpx
import openai
import pytest

from engine.cache.host import files_bytes
from inference.services.registry import model_register
from tests.fixtures.daphne import free_port, server_env, start_daphne, stop_daphne

MIB = 1 << 20
METRICS_TOKEN = "residency-metrics"


def model_states(http: httpx.Client) -> dict[str, str]:
    text = http.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).text
    found = re.findall(r'orchard_model_state\{model="([^"]+)",state="([^"]+)"\} 1\.0', text)
    return dict(found)


@pytest.mark.django_db(transaction=True)
def test_a_budget_for_one_model_serves_two_in_turn(make_key, tiny_model_path, tmp_path):
    model_register(name="tiny-a", path=tiny_model_path, make_default=True)
    model_register(name="tiny-b", path=tiny_model_path)
    key = make_key()
    # Room for one model's weights and caches, not two.
    budget = files_bytes(tiny_model_path) + 400 * MIB
    env = {
        **server_env(),
        "ORCHARD_MEMORY_BUDGET": str(budget),
        "ORCHARD_MODEL_CACHE_SHARE": "1",
        "ORCHARD_MODEL_IDLE_SECONDS": "2",
        "ORCHARD_METRICS_TOKEN": METRICS_TOKEN,
    }
    port = free_port()
    server = start_daphne(port=port, env=env, log_path=tmp_path / "server.log")
    url = f"http://127.0.0.1:{port}"
    chat = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    messages = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    try:
        with httpx.Client(base_url=url, timeout=60) as http:
            deadline = time.monotonic() + 60
            while model_states(http).get("tiny-a") != "loaded" and time.monotonic() < deadline:
                time.sleep(0.2)
            assert model_states(http) == {"tiny-a": "loaded", "tiny-b": "unloaded"}

            body = {
                "model": "tiny-a",
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 3000,
                "stream": True,
                "ignore_eos": True,
            }
            headers = {"Authorization": f"Bearer {key}"}
            with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as busy:
                lines = busy.iter_lines()
                for _ in range(5):
                    next(lines)
                # tiny-a is generating: no room for tiny-b, in either route's shape.
                with pytest.raises(openai.APIStatusError) as refused:
                    chat.chat.completions.create(
                        model="tiny-b", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
                    )
                assert refused.value.status_code == 503
                assert refused.value.response.headers["retry-after"] == "10"
                error = refused.value.body
                assert error["code"] == "model_capacity_exceeded"
                assert "memory budget has no room" in error["message"]
                with pytest.raises(anthropic.APIStatusError) as refused:
                    messages.messages.create(
                        model="tiny-b",
                        max_tokens=4,
                        messages=[{"role": "user", "content": "Hi"}],
                    )
                assert refused.value.status_code == 503
                assert refused.value.body["error"]["type"] == "overloaded_error"
                assert refused.value.response.headers["retry-after"] == "10"
            # The stream is closed: tiny-a is idle, and unloads after its idle time.
            deadline = time.monotonic() + 30
            while model_states(http).get("tiny-a") != "unloaded" and time.monotonic() < deadline:
                time.sleep(0.5)
            assert model_states(http)["tiny-a"] == "unloaded"

            # tiny-b loads on its first request, which waits for the load.
            reply = chat.chat.completions.create(
                model="tiny-b", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            assert reply.choices[0].finish_reason == "length"
            assert model_states(http) == {"tiny-a": "unloaded", "tiny-b": "loaded"}
            listed = {m.id for m in chat.models.list()}
            assert listed == {"tiny-a", "tiny-b"}  # an unloaded model is still offered
    finally:
        stop_daphne(server)
