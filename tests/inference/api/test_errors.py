"""OpenAI error bodies and status codes from every /v1 failure, never HTML or a bare 500."""

import asyncio
import contextlib

import httpx
import openai
import pytest

from accounts.services import api_key_find, api_key_revoke
from tests.inference.conftest import TINY

MESSAGES = [{"role": "user", "content": "Hi"}]


def assert_openai_error(response: httpx.Response, status: int, *, param=None, code=None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["x-request-id"].startswith("req_")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.fixture
def post(live_server_url, api_key):
    def post(path: str, body=None, *, content=None, key=api_key, headers=None):
        all_headers = {"Authorization": f"Bearer {key}", **(headers or {})}
        if content is not None:
            all_headers["Content-Type"] = "application/json"
        return httpx.post(
            f"{live_server_url}/v1/{path}",
            json=body,
            content=content,
            headers=all_headers,
            timeout=30,
        )

    return post


def test_missing_and_bad_keys_get_401(live_server_url, tiny_models):
    response = httpx.get(f"{live_server_url}/v1/models")
    assert_openai_error(response, 401, code="invalid_api_key")
    for header in ("Bearer nope", "Bearer sk-orch-" + "a" * 40, "Basic abc", "Bearer"):
        response = httpx.get(f"{live_server_url}/v1/models", headers={"Authorization": header})
        assert_openai_error(response, 401, code="invalid_api_key")


def test_revoked_key_is_refused_on_the_next_request(client, api_key):
    assert client.models.list().data
    api_key_revoke(api_key=api_key_find(key_or_prefix=api_key))
    with pytest.raises(openai.AuthenticationError) as caught:
        client.models.list()
    assert caught.value.status_code == 401


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert caught.value.code == "model_not_found"
    assert caught.value.body["param"] == "model"


def test_model_outside_the_keys_scope_is_404(live_server_url, make_key, tiny_models):
    key = make_key(username="bob", team="team-b", models=["some-other-model"])
    client = openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model=TINY, messages=MESSAGES)
    assert caught.value.code == "model_not_found"
    assert [m.id for m in client.models.list().data] == []


def test_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TINY, messages=MESSAGES, max_tokens=10_000_000)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.body["param"] == "messages"
    long = [{"role": "user", "content": "apple " * 5000}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=TINY, messages=long)
    # Refused where it was tokenized, in validation's words.
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.body["param"] == "messages"
    assert "in the messages, 1 in the completion)" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=TINY, prompt="apple " * 5000, max_tokens=7)
    assert caught.value.code == "context_length_exceeded"
    assert caught.value.body["param"] == "prompt"
    assert "in the prompt, 7 in the completion)" in caught.value.message


def test_malformed_json_and_non_object_bodies(post, tiny_models):
    assert_openai_error(post("chat/completions", content=b"{not json"), 400)
    assert_openai_error(post("chat/completions", content=b"[1, 2]"), 400)


@pytest.mark.parametrize(
    ("field", "value", "param"),
    [
        ("temperature", 5, "temperature"),
        ("temperature", "hot", "temperature"),
        ("top_p", 1.5, "top_p"),
        ("n", 0, "n"),
        ("max_tokens", 0, "max_tokens"),
        ("top_logprobs", 50, "top_logprobs"),
        ("stream", "yes", "stream"),
        ("stop", ["a", "b", "c", "d", "e"], "stop"),
        ("messages", [], "messages"),
        ("messages", [{"role": "wizard", "content": "x"}], "messages[0].role"),
        ("response_format", {"type": "xml"}, "response_format"),
        ("max_completion_tokens", 0, "max_completion_tokens"),
        ("max_completion_tokens", -5, "max_completion_tokens"),
        ("top_p", -0.1, "top_p"),
        ("min_tokens", 10**9, "min_tokens"),
        ("seed", 2**70, "seed"),
        ("logit_bias", {"1": 500}, "logit_bias"),
        ("logit_bias", {"one": 1}, "logit_bias"),
        ("stop", ["x" * 1001], "stop"),
        ("stop_token_ids", list(range(257)), "stop_token_ids"),
        ("chat_template_kwargs", {"chat_template": "{{ 1 }}"}, "chat_template_kwargs"),
        ("chat_template_kwargs", {"tokenize": True}, "chat_template_kwargs"),
        ("model", 5, "model"),
    ],
)
def test_invalid_values_name_the_param(post, tiny_models, field, value, param):
    body = {"model": TINY, "messages": MESSAGES, field: value}
    assert_openai_error(post("chat/completions", body), 400, param=param)


def test_content_parts_the_model_cannot_read_are_a_clear_400(post, tiny_models):
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    body = {"model": TINY, "messages": [{"role": "user", "content": [audio]}]}
    error = assert_openai_error(
        post("chat/completions", body), 400, param="messages[0].content[0].type"
    )
    assert "only text and image_url" in error["message"]
    # An image, to a model that takes text only: refused before anything is fetched.
    image = {"type": "image_url", "image_url": {"url": "http://example.invalid/x.png"}}
    body = {"model": TINY, "messages": [{"role": "user", "content": [image]}]}
    error = assert_openai_error(
        post("chat/completions", body), 400, param="messages[0].content[0].image_url.url"
    )
    assert error["code"] == "image_input_not_supported" and TINY in error["message"]


def test_unknown_fields_are_ignored(post, tiny_models):
    body = {
        "model": TINY,
        "messages": MESSAGES,
        "max_tokens": 2,
        "frobnicate": True,
        "metadata": {"x": 1},
    }
    assert post("chat/completions", body).status_code == 200


def test_oversized_body_is_refused_before_parsing(post, tiny_models, settings):
    huge = b'{"model": "x", "messages": [], "pad": "' + b"a" * (9 * 1024 * 1024) + b'"}'
    assert_openai_error(post("chat/completions", content=huge), 413)


def test_unknown_path_and_wrong_method_are_json(live_server_url, api_key):
    headers = {"Authorization": f"Bearer {api_key}"}
    assert_openai_error(httpx.get(f"{live_server_url}/v1/nope", headers=headers), 404)
    response = httpx.get(f"{live_server_url}/v1/chat/completions", headers=headers)
    assert_openai_error(response, 405)


def test_completions_logprobs_errors_name_logprobs(post, tiny_models):
    body = {"model": TINY, "prompt": "x", "logprobs": 9, "max_tokens": 1}
    assert_openai_error(post("completions", body), 400, param="logprobs")
    body = {"model": TINY, "prompt": "x", "best_of": 0, "max_tokens": 1}
    assert_openai_error(post("completions", body), 400, param="best_of")


def test_a_call_may_ask_for_at_most_128_completions(post, tiny_models):
    body = {"model": TINY, "prompt": [[1]] * 9, "n": 16, "max_tokens": 1}
    error = assert_openai_error(post("completions", body), 400, param="prompt")
    assert "128" in error["message"]
    body = {"model": TINY, "prompt": [[1]] * 8, "n": 16, "max_tokens": 1}
    assert post("completions", body).status_code == 200


def test_out_of_range_numbers_anywhere_in_the_body_are_a_400(post, tiny_models):
    body = b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "Hi"}], '
    body += b'"chat_template_kwargs": {"x": 1e400}}'
    assert_openai_error(post("chat/completions", content=body), 400)
    nul = {"model": "tiny\u0000chat", "messages": MESSAGES}
    assert_openai_error(post("chat/completions", nul), 400, param="model")


def test_top_p_zero_is_greedy(client):
    greedy = client.chat.completions.create(
        model=TINY, messages=MESSAGES, max_tokens=8, temperature=0
    )
    nucleus = client.chat.completions.create(
        model=TINY, messages=MESSAGES, max_tokens=8, temperature=1.0, top_p=0
    )
    assert nucleus.choices[0].message.content == greedy.choices[0].message.content


def test_completions_suffix_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=TINY, prompt="def f():", suffix="return 1")
    assert caught.value.body["param"] == "suffix"


def test_overloaded_model_answers_503(live_server_url, api_key, make_key, tiny_model_path):
    from django.contrib.auth import get_user_model

    from inference.models import ModelEntry
    from inference.services.registry import model_register

    model_register(name="tiny-one-slot", path=tiny_model_path)
    ModelEntry.objects.filter(name="tiny-one-slot").update(max_num_seqs=1, max_waiting=1)
    staff = {"Authorization": f"Bearer {make_key(username='ops', team='ops')}"}
    get_user_model().objects.filter(username="ops").update(is_staff=True)
    gauge = 'orchard_engine_waiting_requests{model="tiny-one-slot"}'
    body = {
        "model": "tiny-one-slot",
        "messages": MESSAGES,
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }

    async def scenario() -> httpx.Response:
        async with httpx.AsyncClient(
            base_url=live_server_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
        ) as client:
            # An earlier try's requests (aborted as their client closed) are gone first.
            busy = [
                f'{name}{{model="tiny-one-slot"}} '
                for name in ("orchard_engine_waiting_requests", "orchard_engine_running_sequences")
            ]
            for _ in range(600):
                metrics = (await client.get("/metrics", headers=staff)).text.splitlines()
                if not any(m.startswith(b) and m != b + "0.0" for m in metrics for b in busy):
                    break
                await asyncio.sleep(0.05)
            # The running request holds the one row for as long as the context allows (a fast
            # machine generates 2,000 tokens before the third request below is admitted).
            longest = {**body, "max_tokens": 4000}
            async with client.stream("POST", "/v1/chat/completions", json=longest) as running:
                assert running.status_code == 200
                # The second request waits in the model's one-place queue (the engine's gauge
                # says when)...
                queued = asyncio.create_task(client.post("/v1/chat/completions", json=body))
                async with asyncio.timeout(30):
                    while f"{gauge} 1.0" not in (await client.get("/metrics", headers=staff)).text:
                        assert not queued.done()
                        await asyncio.sleep(0.02)
                # ...so a third one finds the queue full (answered at once). On a loaded
                # machine the running request may reach its end first: the queued one then
                # runs, the third waits in the queue, and the scenario is tried again.
                try:
                    third = await client.post("/v1/chat/completions", json=body, timeout=15)
                except httpx.ReadTimeout:
                    third = None
                queued.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await queued
                return third

    for _ in range(3):
        third = asyncio.run(scenario())
        if third is not None:
            break
    assert third is not None, "the running request ended before the third was answered, 3 times"
    assert_openai_error(third, 503, code="engine_overloaded")


def test_wrong_method_keeps_the_allow_header(live_server_url, api_key):
    headers = {"Authorization": f"Bearer {api_key}"}
    response = httpx.get(f"{live_server_url}/v1/chat/completions", headers=headers)
    assert_openai_error(response, 405)
    assert response.headers["allow"] == "POST"


def test_out_of_vocabulary_token_ids_are_a_400_without_a_fake_code(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=TINY, prompt=[99_999_999], max_tokens=2)
    assert caught.value.code is None
