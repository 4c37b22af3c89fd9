"""Chat templates get tools and template variables, never the server's own arguments (a render
that runs too long is stopped: test_render_processes.py)."""

import pytest
import transformers
from mlx_lm.tokenizer_utils import TokenizerWrapper

from engine.models.loader import load_tokenizer
from engine.protocol import InvalidRequestError
from engine.text import templates
from tests.fixtures.tiny_models import tokenizer_dir

MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tokenizer_dir("qwen3"))[0]


def test_chat_template_kwargs_reach_the_template(tokenizer, monkeypatch):
    seen = {}
    original = transformers.PreTrainedTokenizerBase.apply_chat_template

    def spy(self, *args, **kwargs):
        seen.update(kwargs)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "apply_chat_template", spy)
    ids = templates.apply_chat_template(
        tokenizer, MESSAGES, chat_template_kwargs={"enable_thinking": False}
    )
    assert seen["enable_thinking"] is False
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thinking = tokenizer.decode(templates.apply_chat_template(tokenizer, MESSAGES))
    assert thinking.endswith("<|im_start|>assistant\n")


def test_tools_reach_the_template(tokenizer):
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"type": "object"}},
    }
    text = tokenizer.decode(templates.apply_chat_template(tokenizer, MESSAGES, tools=[tool]))
    assert "<tools>" in text and "get_weather" in text


@pytest.mark.parametrize(
    "key",
    [
        "chat_template",
        "tokenize",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "tokenizer_kwargs",
        "tools",
        "documents",
        "messages",
        "conversation",
        "eos_token",
        "bos_token",
        "not a name",
        "{{ x }}",
    ],
)
def test_server_owned_keys_are_refused_before_the_template_runs(tokenizer, monkeypatch, key):
    def must_not_render(*args, **kwargs):
        raise AssertionError("the template ran")

    monkeypatch.setattr(
        transformers.PreTrainedTokenizerBase, "apply_chat_template", must_not_render
    )
    with pytest.raises(InvalidRequestError) as caught:
        templates.apply_chat_template(
            tokenizer, MESSAGES, chat_template_kwargs={key: "{{ 7 * 7 }}"}
        )
    assert caught.value.param == "chat_template_kwargs"


def test_a_tokenizers_own_special_token_names_and_the_template_globals_are_refused():
    tokenizer = TokenizerWrapper(
        transformers.PreTrainedTokenizerFast.from_pretrained(
            str(tokenizer_dir("qwen3")), extra_special_tokens={"image_token": "<|image_pad|>"}
        )
    )
    for key in ("image_token", "range", "raise_exception", "namespace"):
        with pytest.raises(InvalidRequestError):
            templates.apply_chat_template(tokenizer, MESSAGES, chat_template_kwargs={key: "x"})
    # Template variables still pass, whatever their values.
    templates.apply_chat_template(
        tokenizer, MESSAGES, chat_template_kwargs={"enable_thinking": False, "x": [1, {"a": 2}]}
    )
