"""The prefix cache's disk tier end to end, with the official client: a server that stops keeps
its prefix cache on disk (ORCHARD_HOME/prefix-cache), and the next server reads a team's shared
prefix back from it (`cached_tokens`, the same reply as a cold cache gives), never another
team's; /metrics shows the disk tier."""

import re
import uuid

import httpx
import openai
import pytest

from inference.services.registry import model_register
from tests.fixtures.daphne import free_port, server_env, start_daphne, stop_daphne

METRICS_TOKEN = "disk-tier-metrics"


def metric(text: str, name: str) -> float:
    found = re.search(rf'^{name}\{{model="disk-model"\}} ([0-9.e+]+)$', text, re.M)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


@pytest.mark.slow
@pytest.mark.django_db(transaction=True)
def test_a_restarted_server_reads_a_teams_prefix_back_from_disk(
    make_key, tiny_model_path, tmp_path
):
    model_register(name="disk-model", path=tiny_model_path, make_default=True)
    ours, theirs = make_key("alice", "team-a"), make_key("bob", "team-b")
    env = {
        **server_env(),
        "ORCHARD_HOME": str(tmp_path / "home"),
        "ORCHARD_PREFIX_DISK_BYTES": "1GiB",
        "ORCHARD_METRICS_TOKEN": METRICS_TOKEN,
    }
    system = f"{uuid.uuid4().hex}: you are an assistant. " + "Answer briefly and well. " * 20

    def ask(url: str, key: str, question: str):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        reply = client.chat.completions.create(
            model="disk-model", messages=messages, temperature=0, max_tokens=6
        )
        return reply.choices[0].message.content, reply.usage

    def serve(name: str):
        port = free_port()
        log = tmp_path / f"{name}.log"
        return start_daphne(port=port, env=env, log_path=log), f"http://127.0.0.1:{port}"

    server, url = serve("first")
    try:
        _, first = ask(url, ours, "Name a fruit.")
    finally:
        stop_daphne(server)  # the engine ends: its prefix cache goes to disk
    assert first.prompt_tokens_details.cached_tokens < 10  # the template's head at most
    assert list((tmp_path / "home" / "prefix-cache").rglob("*.kv"))

    server, url = serve("second")
    try:
        text, warm = ask(url, ours, "Name a tree.")
        # The other team's identical request finds nothing of ours: computed cold.
        cold_text, cold = ask(url, theirs, "Name a tree.")
        with httpx.Client(base_url=url, timeout=30) as http:
            scraped = http.get("/metrics", headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    finally:
        stop_daphne(server)
    shared = warm.prompt_tokens - 8  # all of the system prompt, not the question
    assert warm.prompt_tokens_details.cached_tokens >= shared
    assert cold.prompt_tokens_details.cached_tokens < 10
    assert text == cold_text
    assert metric(scraped.text, "orchard_prefix_cache_disk_hits_total") == 1
    assert metric(scraped.text, "orchard_prefix_cache_disk_hit_tokens_total") >= shared
    assert metric(scraped.text, "orchard_prefix_cache_disk_entries") > 0
    assert metric(scraped.text, "orchard_prefix_cache_disk_read_errors_total") == 0
