"""Large bodies are checked in a preflight process first (inference/api/preflight.py): one the
checks refuse gets the endpoint's own error, in its own shape, without the web process parsing
it (a team's 600 KB schemas must not hold the interpreter every team's requests need); one they
accept comes back checked, and the web process only builds its call from it; a preflight that
fails costs nothing but the detour."""

import asyncio
import json

import anthropic
import httpx
import openai
import pytest
from django.test import RequestFactory

import inference.api.bodies
from engine import PoolSize, TokenizerProcesses
from engine.text.process_worker import WorkerFailed
from inference.api import preflight
from inference.api.chat import chat_call
from inference.api.common import read_body_in
from inference.api.serializers import ChatCompletionSerializer
from inference.errors import APIError
from tests.inference.api.test_metrics import scrape, value
from tests.inference.conftest import TINY

# Past the grammar limit (512 KiB) and the preflight's size (256 KiB).
HUGE = {"type": "object", "properties": {"pick": {"enum": [f"v{i}" for i in range(80_000)]}}}
MESSAGES = [{"role": "user", "content": "Pick one."}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": HUGE}}
GRAMMAR_TOO_BIG = "over the limit of"


def checks(url: str, key: str) -> dict[str, float]:
    samples = scrape(url, key)
    return {
        verdict: value(samples, "orchard_preflight_checks_total", verdict=verdict)
        for verdict in ("refused", "accepted", "failed")
    }


def test_refused_in_the_preflight_with_each_endpoints_own_error(
    live_server_url, api_key, staff_key, client
):
    before = checks(live_server_url, staff_key)
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=TINY, messages=MESSAGES, response_format=FORMAT)
    assert GRAMMAR_TOO_BIG in chat.value.message and chat.value.param == "response_format"
    text = {"format": {"type": "json_schema", "name": "pick", "schema": HUGE}}
    with pytest.raises(openai.BadRequestError) as responses:
        client.responses.create(model=TINY, input="Pick one.", text=text)
    assert GRAMMAR_TOO_BIG in responses.value.message
    assert responses.value.param == "text.format"
    # Anthropic's route answers in Anthropic's shape: a body that is not an object.
    messages = anthropic.Anthropic(base_url=live_server_url, api_key=api_key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as refused:
        messages.post(
            "/v1/messages", cast_to=httpx.Response, body=[{"pad": "x" * 300_000}], options={}
        )
    body = refused.value.response.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "must be a JSON object" in body["error"]["message"]
    # A large body the checks accept goes on to the endpoint: here, past the tiny context.
    with pytest.raises(openai.BadRequestError) as long:
        client.chat.completions.create(
            model=TINY, messages=[{"role": "user", "content": "apple " * 60_000}]
        )
    assert long.value.code == "context_length_exceeded"
    after = checks(live_server_url, staff_key)
    assert after["refused"] - before["refused"] == 3
    assert after["accepted"] - before["accepted"] == 1
    assert after["failed"] == before["failed"]


class Intake:
    """What `read_body_in` uses of the fair gate: jobs run at once (the gate has its tests)."""

    async def prepare(self, work):
        return await work()

    async def in_thread(self, fn, *args):
        return await asyncio.to_thread(fn, *args)


@pytest.fixture
def parsed_here(monkeypatch):
    """The sizes of the bodies this process parsed (a preflight process has its own)."""
    sizes, real = [], inference.api.bodies.parse_json

    def counting(body: bytes):
        sizes.append(len(body))
        return real(body)

    monkeypatch.setattr(inference.api.bodies, "parse_json", counting)
    return sizes


@pytest.fixture
def processes(monkeypatch, settings):
    settings.ORCHARD_PREFLIGHT_TIMEOUT_SECONDS = 30  # however busy the machine
    pool = TokenizerProcesses(PoolSize(processes=1))
    monkeypatch.setattr(preflight, "_processes", lambda: pool)
    yield pool
    pool.close()


def request(body: dict):
    return RequestFactory().post(
        "/v1/chat/completions", data=json.dumps(body), content_type="application/json"
    )


async def read(body: dict):
    return await read_body_in(Intake(), request(body), ChatCompletionSerializer, chat_call)


@pytest.mark.django_db
async def test_a_refused_body_is_never_parsed_by_the_web_process(processes, parsed_here):
    huge = {"model": TINY, "messages": MESSAGES, "response_format": FORMAT}
    with pytest.raises(APIError) as caught:
        await read(huge)
    assert caught.value.status == 400 and GRAMMAR_TOO_BIG in caught.value.message
    assert parsed_here == []
    # The same error as the web process's own read: the preflight is the same check.
    with pytest.raises(APIError) as here:
        inference.api.bodies.check_body_bytes(
            json.dumps(huge).encode(), ChatCompletionSerializer, chat_call
        )
    assert (here.value.message, here.value.param) == (caught.value.message, caught.value.param)
    # A large body the checks accept is not parsed here either: its checked data comes back
    # and only the call is built here (the same data and call as the web process's own read).
    parsed_here.clear()
    long = {"model": TINY, "messages": [{"role": "user", "content": "a\u00e9" * 150_000}]}
    data, call = await read(long)
    assert parsed_here == []
    here, call_here = inference.api.bodies.check_body_bytes(
        json.dumps(long).encode(), ChatCompletionSerializer, chat_call
    )
    assert data == here and call == call_here
    assert call.model == TINY and data["messages"][0]["content"] == "a\u00e9" * 150_000
    # A small one skips the preflight and is read here.
    parsed_here.clear()
    await read({"model": TINY, "messages": MESSAGES})
    assert len(parsed_here) == 1 and parsed_here[0] < 1000


@pytest.mark.django_db
async def test_a_new_preflight_process_sets_django_up_outside_the_checks_budget(
    monkeypatch, parsed_here
):
    # The default budget (0.5 s of CPU) is less than Django's setup: charged to the first
    # check, every check of a new process would fall back to the web process's read.
    pool = TokenizerProcesses(PoolSize(processes=1))
    monkeypatch.setattr(preflight, "_processes", lambda: pool)
    try:
        with pytest.raises(APIError) as caught:
            await read({"model": TINY, "messages": MESSAGES, "response_format": FORMAT})
    finally:
        pool.close()
    assert GRAMMAR_TOO_BIG in caught.value.message and parsed_here == []


@pytest.mark.django_db
async def test_a_failed_preflight_lets_the_web_process_read_the_body(monkeypatch, parsed_here):
    class Broken:
        async def run(self, *args, **kwargs):
            raise WorkerFailed("A tokenizer process ended unexpectedly.")

    monkeypatch.setattr(preflight, "_processes", lambda: Broken())
    with pytest.raises(APIError) as caught:
        await read({"model": TINY, "messages": MESSAGES, "response_format": FORMAT})
    assert GRAMMAR_TOO_BIG in caught.value.message and len(parsed_here) == 1
