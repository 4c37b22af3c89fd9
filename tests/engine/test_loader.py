"""The loader returns what it loaded on every path."""

import pytest

import engine.models.loader as loader
from engine.text.templates import apply_chat_template
from tests.fixtures.tiny_models import build_tiny_model

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def model_path():
    return build_tiny_model(model_type="llama", tokenizer="qwen3")


def test_clean_load_returns_model_tokenizer_and_info(model_path):
    loaded = loader.load_model(model_path, name="tiny")
    assert loaded is not None and loaded.tokenizer_source == "mlx_lm"
    assert loaded.model is not None and loaded.config["model_type"] == "llama"
    assert loaded.info.name == "tiny" and loaded.info.vocab_size == 151669
    assert loaded.info.context_length == 4096 and 151645 in loaded.info.eos_token_ids
    assert loaded.info.supports_tools


def test_falls_back_to_auto_tokenizer(model_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("mlx-lm tokenizer loading is broken")

    monkeypatch.setattr(loader, "mlx_load_tokenizer", broken)
    loaded = loader.load_model(model_path)
    assert loaded.tokenizer_source == "auto_tokenizer"
    assert loaded.tokenizer.encode("Hello") == loader.load_model(model_path).tokenizer.encode(
        "Hello"
    )


def test_falls_back_to_the_tokenizer_file(model_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("broken")

    monkeypatch.setattr(loader, "mlx_load_tokenizer", broken)
    monkeypatch.setattr(loader.AutoTokenizer, "from_pretrained", broken)
    loaded = loader.load_model(model_path)
    assert loaded.tokenizer_source == "tokenizer_file"
    assert 151645 in loaded.info.eos_token_ids
    ids = apply_chat_template(loaded.tokenizer, MESSAGES)
    assert "<|im_start|>assistant" in loaded.tokenizer.decode(ids)
