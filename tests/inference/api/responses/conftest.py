"""The /v1/responses tests' server (the scripted daphne, started once for the package), model,
key and client."""

import openai
import pytest

from inference.services.registry import model_register
from tests.fixtures.daphne import stop_daphne
from tests.fixtures.tiny_models import build_tiny_model
from tests.inference.api.responses.scripted import MODEL, start_scripted


@pytest.fixture(scope="package")
def scripted_url(django_db_setup, tmp_path_factory):
    process, url = start_scripted(tmp_path_factory.mktemp("responses"))
    yield url
    stop_daphne(process)


@pytest.fixture
def registered(transactional_db):
    model_register(name=MODEL, path=build_tiny_model(model_type="qwen3", tokenizer="qwen3"))


@pytest.fixture
def raw_key(make_key, registered) -> str:
    return make_key()


@pytest.fixture
def client(scripted_url, raw_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{scripted_url}/v1", api_key=raw_key, max_retries=0)
