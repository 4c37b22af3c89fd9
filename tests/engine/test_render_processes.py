"""Prompts render (and texts encode) in tokenizer processes: the same token ids as rendering
here, errors that are the caller's come back as theirs, and a job past its deadline is stopped
for real: its process is gone (its CPU free) before the call raises, Jinja loops and the
tokenizers library's one long Rust call alike. Once a tokenizer is used, the pool warms: every
process starts and holds it, at the idle scheduling class, so a job that arrives while others
run starts no process."""

import asyncio
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


def warmed(renderer, size: int = 2) -> list[int]:
    """The pool's processes once its warm-up has started all `size` of them."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pids = renderer.processes.pids
        if len(pids) == size:
            return sorted(pids)
        time.sleep(0.05)
    raise AssertionError(f"the pool did not warm to {size} processes: {renderer.processes.pids}")


async def test_renders_in_a_process_match_rendering_here(renderer, tokenizer):
    chat = PromptInput(messages=MESSAGES, chat_template_kwargs={"enable_thinking": False})
    text = PromptInput(text="The orchard in spring")
    assert await renderer.render(tokenizer, chat) == render(tokenizer, chat)
    assert await renderer.render(tokenizer, text) == render(tokenizer, text)
    pids = warmed(renderer)  # the processes stay
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
    assert sorted(renderer.processes.pids) == pids and renderer.processes.num_running == 0


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's idle scheduling class")
async def test_the_pool_warms_at_the_idle_class_and_a_concurrent_job_starts_no_process(
    renderer, tokenizer
):
    backend = tokenizer._tokenizer.backend_tokenizer
    await renderer.encode(backend, ["warm"])
    pids = warmed(renderer)
    # Below every thread of the engine: a task of this class never delays one that wakes.
    assert all(os.sched_getscheduler(pid) == os.SCHED_IDLE for pid in pids)
    # One process busy with a long encode; the job beside it finds the other one warm.
    text = "The quick brown fox jumps over the lazy dog. " * 40_000  # about 2 s to encode
    long = asyncio.ensure_future(renderer.encode(backend, [text], timeout_s=60))
    while renderer.processes.num_running == 0:  # noqa: ASYNC110 (a count in another thread)
        await asyncio.sleep(0.01)
    assert await renderer.encode(backend, ["Stocks fell."]) == [backend.encode("Stocks fell.").ids]
    assert renderer.processes.num_running == 1  # the long one still works beside it
    assert len((await long)[0]) > 100_000
    assert sorted(renderer.processes.pids) == pids


async def test_a_template_past_its_deadline_is_stopped_with_its_process(renderer):
    # The template is the admin's, the conversation the caller's: three nested loops over 400
    # messages are 64 million iterations, far past any reasonable render.
    slow_tokenizer = load_tokenizer(tokenizer_dir("qwen3"))[0]
    loop = "{% for VAR in messages %}"
    slow = loop.replace("VAR", "a") + loop.replace("VAR", "b") + loop.replace("VAR", "c")
    slow_tokenizer.chat_template = slow + "x" + "{% endfor %}" * 3
    messages = tuple({"role": "user", "content": str(i)} for i in range(400))
    await renderer.render(slow_tokenizer, PromptInput(text="warm"))  # processes holding it
    pids = warmed(renderer)
    started = time.monotonic()
    with pytest.raises(InvalidRequestError) as caught:
        await renderer.render(slow_tokenizer, PromptInput(messages=messages), timeout_s=0.5)
    assert time.monotonic() - started < 2
    assert caught.value.param == "messages" and "0.5 s" in str(caught.value)
    (killed,) = [pid for pid in pids if not alive(pid)]  # its process, and only that one
    assert renderer.processes.pids == [pid for pid in pids if pid != killed]
    assert renderer.processes.num_running == 0


async def test_a_long_encode_past_its_deadline_is_stopped_with_its_process(renderer, tokenizer):
    """A thread could not do this: the encode is one Rust call of a few seconds."""
    backend = tokenizer._tokenizer.backend_tokenizer
    assert await renderer.encode(backend, ["Stocks fell."]) == [backend.encode("Stocks fell.").ids]
    pids = warmed(renderer)
    text = "The quick brown fox jumps over the lazy dog. " * 80_000  # 3.6 MB: seconds to encode
    started = time.monotonic()
    with pytest.raises(InvalidRequestError) as caught:
        await renderer.encode(backend, [text], timeout_s=0.3)
    assert time.monotonic() - started < 1.5
    assert caught.value.param == "input"
    (killed,) = [pid for pid in pids if not alive(pid)]
    assert renderer.processes.num_running == 0
    # The next job warms the pool back to its size: a fresh process replaces the killed one.
    assert await renderer.encode(backend, ["Stocks fell."]) == [backend.encode("Stocks fell.").ids]
    again = warmed(renderer)
    assert killed not in again and len(set(again) & set(pids)) == 1
