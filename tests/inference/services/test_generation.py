"""The generation service's own policies, without a model: render slots per key, and how the
size of a request the caller did not size is decided."""

import asyncio

from engine.protocol import ModelInfo, SamplingParams
from inference.models import ModelEntry
from inference.services import generation
from inference.services.generation import GenerationCall, _fit_to_context, _sampling
from tests.accounts.conftest import make_limited_key

INFO = ModelInfo(name="m", context_length=4096, vocab_size=1000, eos_token_ids=(0,))


async def test_one_key_renders_at_most_two_prompts_at_once_and_leaves_no_state():
    slot = generation._RenderSlots()
    key, other = make_limited_key(), make_limited_key()
    inside, release = [], asyncio.Event()

    async def render(api_key, tag):
        async with slot(api_key):
            inside.append(tag)
            await release.wait()

    tasks = [asyncio.create_task(render(key, i)) for i in range(3)]
    tasks.append(asyncio.create_task(render(other, "other")))
    await asyncio.sleep(0.05)
    assert sorted(inside, key=str) == [0, 1, "other"]  # the key's third render waits
    release.set()
    await asyncio.gather(*tasks)
    assert len(inside) == 4
    assert slot._slots[asyncio.get_running_loop()] == {}


def test_a_registry_default_max_tokens_is_an_upper_bound_not_a_caller_value():
    entry = ModelEntry(name="m", default_sampling={"max_tokens": 100_000, "temperature": 0.5})
    call = GenerationCall("chat.completions", "m", (), "messages", sampling={"max_tokens": None})
    sampling, limit = _sampling(call, entry)
    assert sampling.max_tokens is None and sampling.temperature == 0.5 and limit == 100_000
    # Capped to what the context leaves, instead of a context_length_exceeded the caller
    # never asked for; the request stays flexible (admission may grant less).
    assert _fit_to_context(sampling, limit, 4000, INFO).max_tokens == 96
    small = ModelEntry(name="m", default_sampling={"max_tokens": 20})
    sampling, limit = _sampling(call, small)
    assert _fit_to_context(sampling, limit, 10, INFO).max_tokens == 20
    # A caller's own max_tokens is theirs: neither capped nor flexible.
    sized = GenerationCall("chat.completions", "m", (), "messages", sampling={"max_tokens": 5000})
    sampling, limit = _sampling(sized, entry)
    assert limit is None and _fit_to_context(sampling, limit, 10, INFO).max_tokens == 5000


def test_the_endpoint_default_applies_when_neither_caller_nor_registry_sizes_it():
    call = GenerationCall("completions", "m", (), "prompt", default_max_tokens=16)
    sampling, limit = _sampling(call, ModelEntry(name="m"))
    assert limit == 16
    assert _fit_to_context(sampling, limit, 4090, INFO).max_tokens == 6
    assert _fit_to_context(sampling, limit, 4096, INFO) == SamplingParams()  # no room: refused
