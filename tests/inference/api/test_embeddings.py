"""/v1/embeddings with the official `openai` client over real HTTP, on the default embedding
model (all-MiniLM-L6-v2 from its PyPI package): dimension, normalisation, equality with an
independent NumPy BERT, similarity, token-id input, usage, limits and errors, and a client that
leaves mid-request (its forwards stop, it is billed what ran)."""

import http.client
import json
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from django.conf import settings
from tokenizers import Tokenizer

from engine.models.embeddings import default_embedding_folder
from inference.models import ModelEntry, UsageRecord
from inference.services.registry import model_register
from tests.fixtures.bert_reference import ReferenceBert
from tests.inference.api.test_chat import finished_row
from tests.inference.api.test_limits import refused_count
from tests.inference.conftest import TINY

EMBED = "all-minilm-l6-v2"
TEXTS = ["A man is playing a guitar.", "Someone is playing an instrument.", "Stocks fell today."]


@pytest.fixture(scope="session")
def embedding_folder() -> Path:
    return default_embedding_folder(Path(settings.ORCHARD_HOME) / "cache" / "test-models")


@pytest.fixture
def embedding_model(transactional_db, embedding_folder, tiny_models):
    return model_register(name=EMBED, path=embedding_folder, kind=ModelEntry.Kind.EMBEDDING)


@pytest.fixture
def embed_client(live_server_url, make_key, embedding_model) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=make_key(), max_retries=0)


def test_vectors_have_the_dimension_are_normalised_and_match_a_reference(
    embed_client, embedding_folder
):
    response = embed_client.embeddings.create(model=EMBED, input=TEXTS)  # the SDK asks base64
    vectors = np.array([item.embedding for item in response.data])
    assert vectors.shape == (3, 384) and [item.index for item in response.data] == [0, 1, 2]
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    reference = ReferenceBert(embedding_folder)
    tokens = [[101, *ids, 102] for ids in word_ids(TEXTS)]
    for row, ids in enumerate(tokens):
        assert np.abs(vectors[row] - reference.embed(ids)).max() < 1e-4
    assert vectors[0] @ vectors[1] > vectors[0] @ vectors[2] + 0.3
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, tokens))
    assert response.model == EMBED
    row = finished_row(UsageRecord.objects.get(endpoint="embeddings").request_id)
    assert (row.status, row.prompt_tokens, row.completion_tokens) == (
        "completed",
        response.usage.prompt_tokens,
        0,
    )


def word_ids(texts):
    """The texts' token ids without [CLS] and [SEP], from the model's own tokenizer file."""
    folder = default_embedding_folder(Path(settings.ORCHARD_HOME) / "cache" / "test-models")
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads to 128 for sentence-transformers' batches
    return [tokenizer.encode(text).ids[1:-1] for text in texts]


def test_float_and_base64_token_ids_and_strings_agree(embed_client, live_server_url):
    floats = embed_client.embeddings.create(model=EMBED, input=TEXTS[0], encoding_format="float")
    b64 = embed_client.embeddings.create(model=EMBED, input=TEXTS[0])
    ids = [101, *word_ids(TEXTS[:1])[0], 102]
    by_ids = embed_client.embeddings.create(model=EMBED, input=ids, encoding_format="float")
    nested = embed_client.embeddings.create(
        model=EMBED, input=[ids, ids[:3]], encoding_format="float"
    )
    first = np.array(floats.data[0].embedding)
    assert np.abs(first - np.array(b64.data[0].embedding)).max() == 0.0
    assert np.abs(first - np.array(by_ids.data[0].embedding)).max() < 1e-6
    assert np.abs(first - np.array(nested.data[0].embedding)).max() < 1e-6
    assert len(nested.data) == 2 and nested.usage.prompt_tokens == len(ids) + 3
    same = embed_client.embeddings.create(model=EMBED, input=TEXTS[0], dimensions=384)
    assert len(same.data[0].embedding) == 384


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [1, "a"]}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [30522]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": " ".join(["word"] * 300)}, "input"),
        ({"input": ["x"] * 2049}, "input"),
        ({"input": "hi", "dimensions": 100}, "dimensions"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "model": TINY}, "model"),
        ({"input": "hi", "model": "nope"}, "model"),
    ],
)
def test_bad_input_is_a_clear_error(live_server_url, make_key, embedding_model, body, param):
    response = httpx.post(
        f"{live_server_url}/v1/embeddings",
        json={"model": EMBED, **body},
        headers={"Authorization": f"Bearer {make_key()}"},
        timeout=30,
    )
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param


def test_an_embedding_model_is_not_a_chat_model(embed_client):
    with pytest.raises(openai.BadRequestError) as caught:
        embed_client.chat.completions.create(
            model=EMBED, messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.body["param"] == "model"
    assert EMBED in {model.id for model in embed_client.models.list()}


def test_limits_apply(live_server_url, make_key, embedding_model):
    client = openai.OpenAI(
        base_url=f"{live_server_url}/v1", api_key=make_key("e", "e-team", rpm=1), max_retries=0
    )
    client.embeddings.create(model=EMBED, input="one")
    with pytest.raises(openai.RateLimitError):
        client.embeddings.create(model=EMBED, input="two")
    statuses = sorted(
        UsageRecord.objects.filter(endpoint="embeddings").values_list("status", flat=True)
    )
    assert statuses == ["completed"]
    assert refused_count() == 1  # counted in the roll-up, without a row


def post_and_keep_open(base_url: str, body: dict, key: str) -> http.client.HTTPConnection:
    """POST /v1/embeddings without reading the answer: closing the connection is the client
    leaving."""
    url = httpx.URL(base_url)
    connection = http.client.HTTPConnection(url.host, url.port, timeout=60)
    headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
    connection.request("POST", "/v1/embeddings", body=json.dumps(body), headers=headers)
    return connection


def test_a_client_that_leaves_stops_its_forwards_and_is_billed_what_ran(
    live_server_url, make_key, embedding_model
):
    """Team A's 2048 inputs are 32 forwards' worth. Team B's small request, sent once A's job is
    in the engine, takes its turn after A's first forward; when B has its answer, A leaves. The
    engine stops A between forwards, and A's row bills the tokens computed: some, not all."""
    large = [[101, 2000 + i % 500, 102] for i in range(2048)]
    key_a, key_b = make_key("ann", "team-a"), make_key("bob", "team-b")
    leaving = post_and_keep_open(live_server_url, {"model": EMBED, "input": large}, key_a)
    try:
        deadline = time.monotonic() + 60
        while not (row := UsageRecord.objects.filter(team__name="team-a").first()):
            assert time.monotonic() < deadline, "team A's request never reached the engine"
            time.sleep(0.02)  # its row opens just before its job goes to the engine
        small = httpx.post(
            f"{live_server_url}/v1/embeddings",
            json={"model": EMBED, "input": "A man is playing a guitar."},
            headers={"Authorization": f"Bearer {key_b}"},
            timeout=60,
        )
        assert small.status_code == 200, small.text
    finally:
        leaving.close()
    row = finished_row(row.request_id, timeout=30)
    assert (row.status, row.error_code) == ("cancelled", "client_disconnected")
    assert row.reserved_tokens == 3 * len(large)
    assert 0 < row.prompt_tokens < 3 * len(large)
