"""The default model, imported from its GGUF, answers sensibly through the real server."""

import pytest

from inference.services.registry import model_register

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_default_model_knows_paris(client, smollm2_path):
    model_register(name="smollm2-135m-instruct", path=smollm2_path, make_default=True)
    answer = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, temperature=0, max_tokens=30
    )
    assert "Paris" in answer.choices[0].message.content
    stream = client.chat.completions.create(
        model="smollm2-135m-instruct", messages=QUESTION, temperature=0, max_tokens=30, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == answer.choices[0].message.content
