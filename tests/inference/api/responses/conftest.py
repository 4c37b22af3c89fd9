"""The /v1/responses tests' model, key and client, on the scripted daphne (`scripted_url`,
tests/inference/conftest.py)."""

import openai
import pytest

from inference.services.registry import model_register
from tests.fixtures.tiny_models import build_tiny_model
from tests.inference.api.responses.scripted import MODEL


@pytest.fixture
def registered(transactional_db):
    model_register(name=MODEL, path=build_tiny_model(model_type="qwen3", tokenizer="qwen3"))


@pytest.fixture
def raw_key(make_key, registered) -> str:
    return make_key()


@pytest.fixture
def client(scripted_url, raw_key) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{scripted_url}/v1", api_key=raw_key, max_retries=0)
