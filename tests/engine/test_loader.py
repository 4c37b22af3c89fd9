"""The loader returns what it loaded on every path; chat templates get tools and kwargs."""

import pytest
import transformers

import engine.loader as loader
from tests.fixtures.tiny_models import build_tiny_model, tokenizer_dir

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
    ids = loader.apply_chat_template(loaded.tokenizer, MESSAGES)
    assert "<|im_start|>assistant" in loaded.tokenizer.decode(ids)


def test_chat_template_kwargs_reach_the_template(monkeypatch):
    tokenizer, _ = loader.load_tokenizer(tokenizer_dir("qwen3"))
    seen = {}
    original = transformers.PreTrainedTokenizerBase.apply_chat_template

    def spy(self, *args, **kwargs):
        seen.update(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "apply_chat_template", spy)
    ids = loader.apply_chat_template(
        tokenizer, MESSAGES, chat_template_kwargs={"enable_thinking": False}
    )
    assert seen["enable_thinking"] is False
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = tokenizer.decode(loader.apply_chat_template(tokenizer, MESSAGES))
    assert thinking.endswith("<|im_start|>assistant\n")


def test_tools_reach_the_template():
    tokenizer, _ = loader.load_tokenizer(tokenizer_dir("qwen3"))
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}},
    }
    text = tokenizer.decode(loader.apply_chat_template(tokenizer, MESSAGES, tools=[tool]))
    assert "<tools>" in text and "get_weather" in text
