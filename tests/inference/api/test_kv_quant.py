"""The running batch's KV memory through the openai SDK over HTTP. A model registered with a
quantized KV cache (`kv_cache_bits`): it streams and answers, the same reply alone and beside
other requests, and a group size its heads cannot take fails its load with a 503, not a
request's worker. Length cohorts (engine/cache/cohorts.py): one team's long conversation beside
another team's short ones changes no reply."""

import concurrent.futures

import openai
import pytest

from inference.models import ModelEntry
from inference.services.registry import model_register
from tests.fixtures.tiny_models import build_tiny_model
from tests.inference.conftest import TINY

QUANTIZED = "tiny-kv8"
MISFIT = "tiny-kv-misfit"


@pytest.fixture
def wide_heads_path() -> str:
    """A tiny model whose 32-dimensional heads groups of 32 divide (the suite's have 16)."""
    return str(build_tiny_model(model_type="llama", tokenizer="qwen3", overrides={"head_dim": 32}))


def test_a_quantized_kv_cache_serves_streams_and_batches(live_server_url, wide_heads_path, client):
    model_register(name=QUANTIZED, path=wide_heads_path)
    ModelEntry.objects.filter(name=QUANTIZED).update(kv_cache_bits=8, kv_cache_group_size=32)
    ask = {"temperature": 0, "max_tokens": 16, "extra_body": {"ignore_eos": True}}

    def reply(text: str) -> str:
        messages = [{"role": "user", "content": text}]
        answer = client.chat.completions.create(model=QUANTIZED, messages=messages, **ask)
        assert answer.usage.completion_tokens == 16
        return answer.choices[0].message.content

    texts = [f"Describe the number {n} in a few words." for n in range(4)]
    alone = [reply(text) for text in texts]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(reply, texts))
    assert together == alone
    stream = client.chat.completions.create(
        model=QUANTIZED,
        messages=[{"role": "user", "content": texts[0]}],
        stream=True,
        **ask,
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == alone[0]


def test_a_group_the_heads_cannot_take_fails_the_load_not_a_request(
    live_server_url, tiny_model_path, client
):
    model_register(name=MISFIT, path=tiny_model_path)  # 16-dimensional heads
    ModelEntry.objects.filter(name=MISFIT).update(kv_cache_bits=4, kv_cache_group_size=32)
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(
            model=MISFIT, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
    assert refused.value.status_code == 503
    assert refused.value.body["code"] == "model_load_failed"


def test_a_long_conversation_beside_another_teams_short_ones_changes_no_reply(
    live_server_url, make_key, tiny_models
):
    """The long one (about 450 tokens) and the short ones (about 20) are over 256 tokens apart:
    they run in separate length cohorts of the batch, read by attention one cohort at a time."""

    def client_of(user: str, team: str) -> openai.OpenAI:
        key = make_key(user, team)
        return openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=key, max_retries=0)

    team_a, team_b = client_of("alice", "team-a"), client_of("bob", "team-b")
    ask = {"model": TINY, "temperature": 0, "max_tokens": 24, "extra_body": {"ignore_eos": True}}
    long_text = "Summarise this list: " + ", ".join(f"item {i}" for i in range(150))
    shorts = [f"Name a colour, number {n}." for n in range(3)]

    def long_reply() -> str:
        stream = team_a.chat.completions.create(
            messages=[{"role": "user", "content": long_text}], stream=True, **ask
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    def short_reply(text: str) -> str:
        answer = team_b.chat.completions.create(messages=[{"role": "user", "content": text}], **ask)
        return answer.choices[0].message.content

    alone = [long_reply(), *map(short_reply, shorts)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(long_reply), *(pool.submit(short_reply, t) for t in shorts)]
        together = [future.result() for future in running]
    assert together == alone
