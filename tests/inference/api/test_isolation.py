"""One request never changes another's output or takes the server down (the hardening issue's
first two defects, through the real API with concurrent requests): a one-token prompt admitted
beside longer ones, and token ids outside the vocabulary in every field that takes them."""

import asyncio
import json

import httpx
import pytest

from tests.inference.conftest import TINY

VOCAB = 151669  # the tiny model's (Qwen3 tokenizer) vocabulary
GREEDY = {"model": TINY, "temperature": 0, "max_tokens": 24, "ignore_eos": True}


async def completion_texts(client: httpx.AsyncClient, body: dict) -> list[str]:
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return [choice["text"] for choice in response.json()["choices"]]


async def streamed_text(client: httpx.AsyncClient, body: dict) -> str:
    text = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
        assert stream.status_code == 200
        async for line in stream.aiter_lines():
            if line.startswith("data: {"):
                text += [c["text"] for c in json.loads(line[6:])["choices"]]
    return "".join(text)


@pytest.fixture
def http(live_server_url, api_key):
    def make() -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=live_server_url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
        )

    return make


NEIGHBOURS = [
    {**GREEDY, "prompt": "The orchard in spring"},
    {**GREEDY, "prompt": [[11, 12, 13, 14, 15, 16, 17]], "max_tokens": 30},
]


@pytest.fixture(scope="module")
def alone_texts() -> list[str]:
    """The neighbours' greedy texts, each run alone, measured once for the module: every test
    compares with the same texts, so each also shows that the tests before it changed nothing."""
    return []


async def neighbours_alone(client: httpx.AsyncClient, texts: list[str]) -> list[str]:
    if not texts:
        texts += [await streamed_text(client, body) for body in NEIGHBOURS]
    return texts


def test_a_one_token_prompt_beside_longer_ones_changes_nothing(http, alone_texts):
    mixed = {**GREEDY, "prompt": [[1000, 2000, 3000, 4000], [5000], [6000, 7000, 8000]]}

    async def scenario():
        async with http() as client:
            alone = [
                (await completion_texts(client, {**GREEDY, "prompt": [p]}))[0]
                for p in mixed["prompt"]
            ]
            before = await neighbours_alone(client, alone_texts)
            together, *neighbours = await asyncio.gather(
                completion_texts(client, mixed),
                *(streamed_text(client, body) for body in NEIGHBOURS),
            )
            return alone, before, together, neighbours

    alone, before, together, neighbours = asyncio.run(scenario())
    assert together == alone
    assert neighbours == before


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("stop_token_ids", [VOCAB]),
        ("stop_token_ids", [VOCAB + 10**6]),
        ("stop_token_ids", [-1]),
        ("logit_bias", {str(VOCAB): 5}),
        ("logit_bias", {"-1": 5}),
        ("prompt", [[1, 2, VOCAB]]),
        ("prompt", [2**40]),
    ],
)
def test_token_ids_outside_the_vocabulary_are_a_400_and_hurt_nobody(
    http, alone_texts, field, value
):
    bad = {**GREEDY, "prompt": "Hello", "min_tokens": 4, field: value}

    async def scenario():
        async with http() as client:
            before = await neighbours_alone(client, alone_texts)
            *during, refused = await asyncio.gather(
                *(streamed_text(client, body) for body in NEIGHBOURS),
                client.post("/v1/completions", json=bad),
            )
            after = [await streamed_text(client, body) for body in NEIGHBOURS]
            return before, during, refused, after

    before, during, refused, after = asyncio.run(scenario())
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert during == before and after == before
