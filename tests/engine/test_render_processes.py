"""Prompts render (and texts encode) in tokenizer processes: the same token ids as rendering
here, errors that are the caller's come back as theirs, and a job past its deadline is stopped
for real: its process is gone (its CPU free) before the call raises, Jinja loops and the
tokenizers library's one long Rust call alike. Once a tokenizer is used, the pool warms: every
process starts and holds it, so a job that arrives while others run starts no process; a job
with a long input runs in processes of Linux's idle scheduling class, apart."""

import asyncio
import os
import subprocess
import sys
import time

import pytest

from engine.models.loader import load_tokenizer
from engine.protocol import InvalidRequestError, PromptInput
from engine.text.process_worker import LOW_WALL_FACTOR, cpu_seconds
from engine.text.processes import PoolSize
from engine.text.rendering import LONG_INPUT_CHARS, PromptRenderer, render
from tests.fixtures.tiny_models import tokenizer_dir

MESSAGES = ({"role": "user", "content": "Hello there"},)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tokenizer_dir("qwen3"))[0]


@pytest.fixture(scope="module")
def renderer():
    renderer = PromptRenderer(PoolSize(processes=2))
    yield renderer
    renderer.close()


def idle_class(pid: int) -> bool:
    return hasattr(os, "SCHED_IDLE") and os.sched_getscheduler(pid) == os.SCHED_IDLE


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
        pids = [pid for pid in renderer.processes.pids if not idle_class(pid)]
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


def slow_template_tokenizer():
    """A tokenizer whose template loops over the messages three levels deep: the admin's
    template, the caller's conversation, seconds of work for a few hundred short messages."""
    slow = load_tokenizer(tokenizer_dir("qwen3"))[0]
    loop = "{% for VAR in messages %}"
    nested = loop.replace("VAR", "a") + loop.replace("VAR", "b") + loop.replace("VAR", "c")
    slow.chat_template = nested + "x" + "{% endfor %}" * 3
    return slow


async def test_a_job_beside_a_busy_warm_process_starts_no_process(renderer, tokenizer):
    backend = tokenizer._tokenizer.backend_tokenizer
    slow = slow_template_tokenizer()
    await renderer.render(slow, PromptInput(text="warm"))
    pids = warmed(renderer)
    messages = tuple({"role": "user", "content": str(i)} for i in range(160))  # 4M loops
    busy = asyncio.ensure_future(
        renderer.render(slow, PromptInput(messages=messages), timeout_s=120)
    )
    while renderer.processes.num_running == 0:  # noqa: ASYNC110 (a count in another thread)
        await asyncio.sleep(0.01)
    assert await renderer.encode(backend, ["Stocks fell."]) == [backend.encode("Stocks fell.").ids]
    assert renderer.processes.num_running == 1  # the slow one still works beside it
    await busy
    assert sorted(renderer.processes.pids) == pids


async def test_a_template_past_its_deadline_is_stopped_with_its_process(renderer):
    # Three nested loops over 400 messages are 64 million iterations, far past any render.
    slow_tokenizer = slow_template_tokenizer()
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


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="Linux's idle scheduling class")
async def test_long_inputs_run_in_idle_class_processes_apart_from_the_short_ones(
    renderer, tokenizer
):
    backend = tokenizer._tokenizer.backend_tokenizer
    await renderer.encode(backend, ["warm"])
    warm = warmed(renderer)
    # Short jobs keep the CPU an idle-class task would not get while the engine is busy.
    assert all(os.sched_getscheduler(pid) == os.SCHED_OTHER for pid in warm)
    text = "The quick brown fox jumps over the lazy dog. " * (LONG_INPUT_CHARS // 45 + 1)
    assert await renderer.encode(backend, [text]) == [backend.encode(text).ids]
    (low,) = set(renderer.processes.pids) - set(warm)
    # A task of this class never delays one that wakes: the engine's kernel threads.
    assert os.sched_getscheduler(low) == os.SCHED_IDLE
    chat = PromptInput(messages=({"role": "user", "content": text},))
    assert await renderer.render(tokenizer, chat) == render(tokenizer, chat)
    assert sorted(renderer.processes.pids) == sorted([*warm, low])  # the same long-job process


async def test_a_long_encode_past_its_deadline_is_stopped_with_its_process(renderer, tokenizer):
    """A thread could not do this: the encode is one Rust call of a few seconds."""
    backend = tokenizer._tokenizer.backend_tokenizer
    assert await renderer.encode(backend, ["Stocks fell."]) == [backend.encode("Stocks fell.").ids]
    warm = warmed(renderer)
    (low,) = set(renderer.processes.pids) - set(warm)  # the long inputs' (the test before)
    text = "The quick brown fox jumps over the lazy dog. " * 80_000  # 3.6 MB: seconds to encode
    started = time.monotonic()
    with pytest.raises(InvalidRequestError) as caught:
        await renderer.encode(backend, [text], timeout_s=0.3)
    # 0.3 s of its CPU time: as long in wall time on a machine that leaves it the CPU.
    assert time.monotonic() - started < 0.3 * LOW_WALL_FACTOR + 1
    assert caught.value.param == "input"
    assert not alive(low) and all(alive(pid) for pid in warm)
    assert sorted(renderer.processes.pids) == warm and renderer.processes.num_running == 0


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="Linux's /proc")
def test_an_idle_class_deadline_counts_the_processes_cpu_time():
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
    process = subprocess.Popen([sys.executable, "-c", burn + "input()"], stdin=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while (cpu_seconds(process.pid) or 0) < 0.3 and time.monotonic() < deadline:
            time.sleep(0.02)
        used = cpu_seconds(process.pid)
        assert used is not None and used >= 0.3
        time.sleep(0.3)  # waiting for input: no CPU, however long in wall time
        assert cpu_seconds(process.pid) - used < 0.1
    finally:
        process.kill()
        process.wait()
    assert cpu_seconds(process.pid) is None


def eventually(predicate, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("the condition did not hold in time")
        time.sleep(0.05)


async def test_idle_processes_stop_but_the_last_of_the_short_jobs(tokenizer):
    """A pool left alone gives its memory back: every process idle past `idle_s` stops, the
    long inputs' too, but for one that keeps the short jobs warm; the next job warms it again."""
    renderer = PromptRenderer(PoolSize(processes=2, idle_s=2.0))
    try:
        backend = tokenizer._tokenizer.backend_tokenizer
        await renderer.encode(backend, ["warm"])
        warm = warmed(renderer)
        text = "The quick brown fox jumps over the lazy dog. " * (LONG_INPUT_CHARS // 45 + 1)
        assert await renderer.encode(backend, [text]) == [backend.encode(text).ids]
        (low,) = set(renderer.processes.pids) - set(warm)
        eventually(lambda: len(renderer.processes.pids) == 1)
        (kept,) = renderer.processes.pids
        assert kept in warm and not idle_class(kept)
        # The others leave the pool first, then are killed and reaped.
        eventually(lambda: not any(alive(pid) for pid in {*warm, low} - {kept}))
        await asyncio.sleep(2.5)  # the last one stays however long the pool is idle
        assert renderer.processes.pids == [kept]
        assert await renderer.encode(backend, ["Stocks fell."]) == [
            backend.encode("Stocks fell.").ids
        ]
        assert kept in warmed(renderer)
    finally:
        renderer.close()


async def test_a_process_keeps_at_most_its_tokenizers(tokenizer):
    """Each process holds the last `tokenizers` it was sent, so a web process serving many
    models does not hold every tokenizer in every process; an evicted one is sent again."""
    other = load_tokenizer(tokenizer_dir("llama3_1"))[0]
    renderer = PromptRenderer(PoolSize(processes=1, tokenizers=1))
    try:
        text = PromptInput(text="The orchard in spring")
        for each in (tokenizer, other, tokenizer):
            assert await renderer.render(each, text) == render(each, text)
            (worker,) = renderer.processes._idle
            assert len(worker.tokenizers) == 1
        assert renderer.processes.pids == [worker.pid]  # one process, its tokenizers replaced
    finally:
        renderer.close()
