"""LocalEngineClient end to end on a tiny model: loading, prompts, sampling options, errors; an
embedding model served beside it."""

import asyncio
import json
from dataclasses import replace

import numpy as np
import pytest

from engine.local import LocalEngineClient
from engine.protocol import (
    InvalidRequestError,
    ModelNotLoadedError,
    ModelSpec,
    PromptInput,
    PromptRoom,
    SamplingParams,
)
from engine.worker import EngineWorker
from inference.services.structured import json_schema_grammar
from tests.engine.conftest import eventually, greedy, make_request
from tests.fixtures.tiny_models import build_tiny_model


@pytest.fixture
async def client(tiny_llama):
    loaded = replace(tiny_llama, info=replace(tiny_llama.info, context_length=64))
    client = LocalEngineClient(EngineWorker(loader=lambda spec: loaded))
    await client.ensure_model(ModelSpec(name="tiny", path="unused"))
    yield client
    await client.shutdown()


async def test_ensure_model_loads_the_folder_and_shutdown_stops_it():
    client = LocalEngineClient()
    path = build_tiny_model(model_type="llama", tokenizer="qwen3")
    spec = ModelSpec(name="tiny", path=str(path), context_length=64)
    info = await client.ensure_model(spec)
    assert info.context_length == 64 and info.vocab_size == 151669
    assert await client.ensure_model(spec) == info  # already loaded: the same engine
    engine = client.worker.get("tiny")
    await client.unload_model("tiny")
    assert not engine._thread.is_alive()
    with pytest.raises(ModelNotLoadedError):
        await run(client, SamplingParams())
    await client.shutdown()


async def run(client, params, prompt=(1000, 2000, 3000)):
    return [o async for o in client.generate(make_request("r", prompt, params))]


async def test_a_prompt_without_room_is_refused_where_it_is_tokenized(client, monkeypatch):
    chat = PromptInput(messages=({"role": "user", "content": "apple " * 200},))
    ids = (await client.render_prompt("tiny", chat)).token_ids
    outcomes = []
    run = client.renderer.processes.run

    async def watched(*args, **kwargs):
        try:
            result = await run(*args, **kwargs)
        except InvalidRequestError:
            outcomes.append("refused")
            raise
        outcomes.append(type(result).__name__)
        return result

    monkeypatch.setattr(client.renderer.processes, "run", watched)
    room = PromptRoom(context_length=len(ids) + 4, completion=5, param="messages")
    with pytest.raises(InvalidRequestError) as caught:
        await client.render_prompt("tiny", chat, room=room)
    # The process refused it: no ids came back to be checked here.
    assert outcomes == ["refused"]
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "messages"
    assert str(caught.value) == (
        f"This model's maximum context length is {len(ids) + 4} tokens. However, you requested "
        f"{len(ids) + 5} tokens ({len(ids)} in the messages, 5 in the completion). Please reduce "
        "the length of the messages or completion."
    )
    # With room for the completion, the same ids as without a room.
    fits = PromptRoom(context_length=len(ids) + 4, completion=4, param="messages")
    assert (await client.render_prompt("tiny", chat, room=fits)).token_ids == ids
    assert outcomes == ["refused", "RenderedPrompt"]


async def test_render_prompt_and_detokenize(client):
    chat = PromptInput(
        messages=({"role": "user", "content": "Hi"},),
        chat_template_kwargs={"enable_thinking": False},
    )
    ids = (await client.render_prompt("tiny", chat)).token_ids
    assert (await client.detokenize("tiny", list(ids))).endswith(
        "assistant\n<think>\n\n</think>\n\n"
    )
    assert (await client.render_prompt("tiny", PromptInput(token_ids=(5, 6)))).token_ids == (5, 6)
    text_ids = (await client.render_prompt("tiny", PromptInput(text="Hello world"))).token_ids
    assert await client.detokenize("tiny", list(text_ids)) == "Hello world"
    with pytest.raises(ModelNotLoadedError):
        await client.render_prompt("other", PromptInput(text="x"))


async def test_stream_text_is_the_detokenized_tokens(client):
    outputs = await run(client, greedy(12, ignore_eos=True))
    tokens = [t for o in outputs for t in o.token_ids]
    assert len(tokens) == 12 and outputs[-1].finish_reason == "length"
    assert outputs[-1].num_prompt_tokens == 3
    assert "".join(o.text for o in outputs) == await client.detokenize("tiny", tokens)


async def test_stop_string_is_never_emitted(client):
    full = "".join(o.text for o in await run(client, greedy(12, ignore_eos=True)))
    stop = full[5:8]
    outputs = await run(client, greedy(12, ignore_eos=True, stop=(stop,)))
    assert outputs[-1].finish_reason == "stop"
    assert "".join(o.text for o in outputs) == full[: full.index(stop)]


async def test_stop_string_does_not_end_a_stream_before_min_tokens(client):
    full = "".join(o.text for o in await run(client, greedy(12, ignore_eos=True)))
    stop = full[:3]  # completed by the first token or two
    outputs = await run(client, greedy(12, ignore_eos=True, stop=(stop,), min_tokens=6))
    assert len([t for o in outputs for t in o.token_ids]) >= 6
    assert "".join(o.text for o in outputs).startswith(stop)


async def test_a_grammar_constrained_stream_is_one_object(client):
    grammar = json_schema_grammar({"type": "object"}, "response_format")
    outputs = await run(client, greedy(40, grammar=grammar))
    assert isinstance(json.loads("".join(o.text for o in outputs)), dict)
    assert outputs[-1].finish_reason == "stop"


async def test_stop_token_ids_and_logprobs(client):
    tokens = [t for o in await run(client, greedy(6, ignore_eos=True)) for t in o.token_ids]
    stop_at = next((i for i, t in enumerate(tokens) if t not in tokens[:i] and i), 0)
    params = greedy(6, stop_token_ids=(tokens[stop_at],), logprobs=True, top_logprobs=3)
    outputs = await run(client, params)
    assert [t for o in outputs for t in o.token_ids] == tokens[: stop_at + 1]
    assert outputs[-1].finish_reason == "stop"
    first = outputs[0].logprobs[0]
    assert first.token_id == tokens[0] and len(first.top_logprobs) == 3
    assert first.top_logprobs[0].token_id == tokens[0] and first.logprob == pytest.approx(
        first.top_logprobs[0].logprob
    )


async def test_n_choices_each_finish(client):
    outputs = await run(client, SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=5))
    finished = {o.index: o.finish_reason for o in outputs if o.finish_reason}
    assert sorted(finished) == [0, 1, 2]


@pytest.mark.parametrize(
    ("params", "prompt", "param"),
    [
        (SamplingParams(temperature=3.0), (1, 2), "temperature"),
        (SamplingParams(top_logprobs=2), (1, 2), "top_logprobs"),
        (SamplingParams(logit_bias={10**7: 1.0}), (1, 2), "logit_bias"),
        (SamplingParams(ignore_eos=True, stop_token_ids=(10**7,)), (1, 2), "stop_token_ids"),
        (SamplingParams(stop_token_ids=(-1,)), (1, 2), "stop_token_ids"),
        (SamplingParams(max_tokens=2), (1, 10**7), "prompt"),
        (SamplingParams(max_tokens=60), tuple(range(1, 10)), "prompt"),
        (SamplingParams(), (), "prompt"),
    ],
)
async def test_invalid_requests_fail_before_any_output(client, params, prompt, param):
    with pytest.raises(InvalidRequestError) as info:
        await run(client, params, prompt)
    assert info.value.param == param
    if len(prompt) > 5:
        assert info.value.code == "context_length_exceeded"


async def test_stats_report_throughput(client):
    await run(client, greedy(20, ignore_eos=True))
    # The engine records a step after emitting its outputs.
    await eventually(lambda: client.worker.get("tiny").stats().num_steps >= 20)
    (stats,) = await client.stats()
    assert (
        stats.model == "tiny" and stats.num_generated_tokens == 20 and stats.num_prompt_tokens == 3
    )
    assert stats.tokens_per_second > 0 and stats.step_time_ms > 0 and stats.num_steps >= 20


async def test_a_chat_on_a_hybrid_model_comes_with_its_checkpoints(tiny_qwen3_next):
    from engine.worker import EngineWorker

    client = LocalEngineClient(EngineWorker(loader=lambda spec: tiny_qwen3_next))
    try:
        await client.ensure_model(ModelSpec(name="tiny", path="unused"))
        system = {"role": "system", "content": "You answer in one word."}
        turns = [
            system,
            {"role": "user", "content": "Colour of the sky?"},
            {"role": "assistant", "content": "Blue."},
            {"role": "user", "content": "And of grass?"},
        ]
        rendered = await client.render_prompt("tiny", PromptInput(messages=tuple(turns)))
        tokenizer = tiny_qwen3_next.tokenizer
        text = tokenizer.decode(list(rendered.token_ids))
        cut = [tokenizer.decode(list(rendered.token_ids[:c])) for c in rendered.checkpoints]
        assert len(cut) == 2 and all(text.startswith(c) for c in cut)
        # Each ends where the next user turn's text begins.
        assert cut[0].endswith("You answer in one word.<|im_end|>\n<|im_start|>user\n")
        assert cut[1].endswith("Blue.<|im_end|>\n<|im_start|>user\n")
    finally:
        await client.shutdown()


async def test_a_dense_model_gets_no_checkpoints(client):
    chat = PromptInput(
        messages=({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    )
    assert (await client.render_prompt("tiny", chat)).checkpoints == ()


async def test_a_request_that_can_never_fit_in_memory_is_refused(tiny_llama):
    from engine.worker import EngineWorker

    client = LocalEngineClient(EngineWorker(loader=lambda spec: tiny_llama))
    try:
        await client.ensure_model(ModelSpec(name="tiny", path="unused"))
        per_token = client.worker.get("tiny").layout.kv_bytes_per_token
        # Room for 600 tokens (plus the cache's allocation step of 256).
        spec = ModelSpec(name="tiny", path="unused", memory_budget_bytes=856 * per_token)
        info = await client.ensure_model(spec)
        assert info.max_request_tokens == 600
        with pytest.raises(InvalidRequestError) as caught:
            await run(client, greedy(info.max_request_tokens, n=1))
        assert caught.value.param == "max_tokens" and "memory" in str(caught.value)
        outputs = await run(client, greedy(8, ignore_eos=True))
        assert outputs[-1].finish_reason == "length"
    finally:
        await client.shutdown()


async def test_clearing_the_prefix_cache_frees_its_entries(client):
    prompt = tuple(range(1000, 1050))  # the fixture's model holds 64 tokens
    await run(client, greedy(2), prompt)
    outputs = await run(client, greedy(2), prompt)
    assert outputs[0].num_cached_tokens == len(prompt) - 1
    cache = client.model_status("tiny").stats.prefix_cache
    assert cache["bytes"] > 0 and cache["hits"] == 1
    freed = await asyncio.to_thread(client.clear_prefix_cache, "tiny")
    assert freed == cache["bytes"]
    after = client.model_status("tiny").stats.prefix_cache
    assert after["bytes"] == 0 and after["nodes"] == 0
    outputs = await run(client, greedy(2), prompt)
    assert outputs[0].num_cached_tokens == 0
    assert client.clear_prefix_cache("not-loaded") == 0


async def test_placing_models_follows_the_registry_without_aborting_anyone(client):
    running = asyncio.create_task(run(client, greedy(40, ignore_eos=True)))
    await eventually(lambda: client.worker.get("tiny").stats().num_running == 1)
    serving = client.worker.get("tiny")
    # A changed spec loads beside the serving engine, which finishes its request.
    changed = ModelSpec(name="tiny", path="unused", max_num_seqs=4)
    client.place_models([changed])
    await eventually(lambda: client.model_status("tiny").serving == changed)
    assert client.worker.get("tiny") is not serving
    outputs = await running
    assert outputs[-1].finish_reason == "length" and outputs[-1].num_generated_tokens == 40
    # A name the registry no longer lists stops once its requests have finished.
    running = asyncio.create_task(run(client, greedy(40, ignore_eos=True)))
    await eventually(lambda: client.worker.get("tiny").stats().num_running == 1)
    client.place_models([])
    assert client.model_status("tiny").state == "not_loaded"
    assert (await running)[-1].finish_reason == "length"
    with pytest.raises(ModelNotLoadedError):
        await run(client, greedy(2))
    # load_new=False leaves names nothing serves to their first request.
    client.place_models([changed], load_new=False)
    assert client.worker.names() == []


async def test_embedding_models_are_served_by_the_worker_beside_chat_models(client, minilm_path):
    spec = ModelSpec(name="minilm", path=str(minilm_path), kind="embedding")
    info = await client.embedding_model(spec)
    assert (info.dimensions, info.context_length, info.vocab_size) == (384, 256, 30522)
    assert client.model_status("minilm").state == "serving"
    assert sorted(s.model for s in await client.stats()) == ["minilm", "tiny"]
    ids = await client.tokenize("minilm", ["A man is playing a guitar.", "Stocks fell."])
    vectors = await client.embed("minilm", ids)
    assert vectors.shape == (2, 384) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    # Each kind is asked for by its own calls.
    with pytest.raises(ModelNotLoadedError):
        await client.render_prompt("minilm", PromptInput(text="x"))
    with pytest.raises(ModelNotLoadedError):
        await client.embed("tiny", ids)
    # The registry no longer lists it: retired like a chat model.
    client.place_models([client.model_status("tiny").serving])
    assert client.model_status("minilm").state == "not_loaded"
    with pytest.raises(ModelNotLoadedError):
        await client.embed("minilm", ids)
