"""Prompts render (and texts encode) in tokenizer processes: the same token ids as rendering
here, errors that are the caller's come back as theirs, and a job past its deadline is stopped
for real: its process is gone (its CPU free) before the call raises, Jinja loops and the
tokenizers library's one long Rust call alike."""

import os
import time

import pytest

from engine.models.loader import load_tokenizer
from engine.protocol import InvalidRequestError, PromptInput
from engine.text.rendering import PromptRenderer, render
from tests.fixtures.tiny_models import tokenizer_dir

MESSAGES = ({"role": "user", "content": "Hello there"},)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tokenizer_dir("qwen3"))[0]


@pytest.fixture(scope="module")
def renderer():
    renderer = PromptRenderer(processes=2)
    yield renderer
    renderer.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_renders_in_a_process_match_rendering_here(renderer, tokenizer):
    chat = PromptInput(messages=MESSAGES, chat_template_kwargs={"enable_thinking": False})
    text = PromptInput(text="The orchard in spring")
    assert await renderer.render(tokenizer, chat) == render(tokenizer, chat)
    assert await renderer.render(tokenizer, text) == render(tokenizer, text)
    pids = renderer.processes.pids
    assert len(pids) == 1  # one job at a time needs one process, which stays
    # Token ids need no process at all.
    ids = await renderer.render(tokenizer, PromptInput(token_ids=(5, 6)))
    assert ids.token_ids == (5, 6) and renderer.processes.pids == pids
    # The caller's mistakes come back as theirs.
    with pytest.raises(InvalidRequestError) as caught:
        await renderer.render(
            tokenizer, PromptInput(messages=MESSAGES, chat_template_kwargs={"tools": []})
        )
    assert caught.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidRequestError) as caught:
        await renderer.encode(tokenizer._tokenizer.backend_tokenizer, [1, 2])
    assert caught.value.param == "input"
    assert renderer.processes.pids == pids and renderer.processes.num_running == 0


async def test_a_template_past_its_deadline_is_stopped_with_its_process(renderer):
    # The template is the admin's, the conversation the caller's: three nested loops over 400
    # messages are 64 million iterations, far past any reasonable render.
    slow_tokenizer = load_tokenizer(tokenizer_dir("qwen3"))[0]
    loop = "{% for VAR in messages %}"
    slow = loop.replace("VAR", "a") + loop.replace("VAR", "b") + loop.replace("VAR", "c")
    slow_tokenizer.chat_template = slow + "x" + "{% endfor %}" * 3
    messages = tuple({"role": "user", "content": str(i)} for i in range(400))
    await renderer.render(slow_tokenizer, PromptInput(text="warm"))  # a process holding it
    (pid,) = renderer.processes.pids
    started = time.monotonic()
    with pytest.raises(InvalidRequestError) as caught:
        await renderer.render(slow_tokenizer, PromptInput(messages=messages), timeout_s=0.5)
    assert time.monotonic() - started < 2
    assert caught.value.param == "messages" and "0.5 s" in str(caught.value)
    assert not alive(pid) and renderer.processes.num_running == 0
    assert renderer.processes.pids == []


async def test_a_long_encode_past_its_deadline_is_stopped_with_its_process(renderer, tokenizer):
    """A thread could not do this: the encode is one Rust call of a few seconds."""
    backend = tokenizer._tokenizer.backend_tokenizer
    assert await renderer.encode(backend, ["Stocks fell."]) == [backend.encode("Stocks fell.").ids]
    (pid,) = renderer.processes.pids
    text = "The quick brown fox jumps over the lazy dog. " * 80_000  # 3.6 MB: seconds to encode
    started = time.monotonic()
    with pytest.raises(InvalidRequestError) as caught:
        await renderer.encode(backend, [text], timeout_s=0.3)
    assert time.monotonic() - started < 1.5
    assert caught.value.param == "input"
    assert not alive(pid) and renderer.processes.num_running == 0
    # The next job starts a fresh process.
    assert await renderer.encode(backend, ["Stocks fell."]) == [backend.encode("Stocks fell.").ids]
    assert renderer.processes.pids != [pid]
