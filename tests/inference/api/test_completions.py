"""POST /v1/completions: string, list and token-id prompts, echo, streaming, logprobs."""

import openai
import pytest

from tests.inference.conftest import TINY

GREEDY = {"temperature": 0, "max_tokens": 6, "extra_body": {"ignore_eos": True}}


def test_string_prompt(client):
    completion = client.completions.create(model=TINY, prompt="The apple", **GREEDY)
    assert completion.object == "text_completion"
    assert completion.choices[0].text
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 6


def test_list_of_prompts_gives_a_choice_each_in_order(client):
    prompts = ["The apple", "A pear is"]
    both = client.completions.create(model=TINY, prompt=prompts, **GREEDY)
    assert [c.index for c in both.choices] == [0, 1]
    for index, prompt in enumerate(prompts):
        alone = client.completions.create(model=TINY, prompt=prompt, **GREEDY)
        assert both.choices[index].text == alone.choices[0].text
    assert both.usage.completion_tokens == 12


def test_token_id_prompt_equals_text_prompt(client):
    text = client.completions.create(model=TINY, prompt="The apple", **GREEDY)
    from transformers import PreTrainedTokenizerFast

    from tests.fixtures.tiny_models import tokenizer_dir

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir("qwen3")))
    ids = tokenizer.encode("The apple")
    by_ids = client.completions.create(model=TINY, prompt=ids, **GREEDY)
    assert by_ids.choices[0].text == text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


def test_echo_prepends_the_prompt(client):
    plain = client.completions.create(model=TINY, prompt="The apple", **GREEDY)
    echoed = client.completions.create(model=TINY, prompt="The apple", echo=True, **GREEDY)
    assert echoed.choices[0].text == "The apple" + plain.choices[0].text


def test_stream_equals_non_stream(client):
    whole = client.completions.create(model=TINY, prompt="The apple", **GREEDY)
    chunks = list(client.completions.create(model=TINY, prompt="The apple", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_logprobs(client):
    completion = client.completions.create(model=TINY, prompt="The apple", logprobs=2, **GREEDY)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == 6
    assert len(logprobs.token_logprobs) == 6
    assert all(len(top) <= 2 and top for top in logprobs.top_logprobs)
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_empty_prompt_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=TINY, prompt=[], max_tokens=2)
    assert caught.value.body["param"] == "prompt"


def test_registry_default_max_tokens_applies_and_16_otherwise(client):
    from inference.models import ModelEntry

    extra = {"extra_body": {"ignore_eos": True}}
    assert (
        client.completions.create(model=TINY, prompt="The apple", **extra).usage.completion_tokens
        == 16
    )
    ModelEntry.objects.filter(name=TINY).update(default_max_tokens=3)
    assert (
        client.completions.create(model=TINY, prompt="The apple", **extra).usage.completion_tokens
        == 3
    )


def test_streamed_logprobs_equal_non_streamed_and_offsets_follow_the_echo(client):
    kwargs = {"model": TINY, "prompt": "The apple", "logprobs": 1, "echo": False, **GREEDY}
    whole = client.completions.create(**kwargs).choices[0].logprobs
    chunks = list(client.completions.create(stream=True, **kwargs))
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    offsets = [
        o
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for o in c.choices[0].logprobs.text_offset
    ]
    assert tokens == whole.tokens
    assert offsets == whole.text_offset
    assert whole.text_offset[0] == 0
    assert whole.text_offset == sorted(whole.text_offset)
