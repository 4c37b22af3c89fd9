"""Image prompts in the engine (engine/models/vision.py), on a tiny SmolVLM and a tiny Qwen2.5-VL
(whose positions follow its images' grids: engine/models/mrope.py), each with the real Qwen3
tokenizer and a real processor configuration (tests/fixtures/tiny_vision.py).

The loader serves the language model as mlx-lm's, on the encoder's own arrays; an image request
prefills from its input embeddings (the images' features at their placeholders) in chunks and
decodes in the continuous batch beside text requests with greedy output and logprobs identical
to alone; the prefix cache keys image positions by the image's content (a repeated image is a
hit, another image at the same place is not); a preempted image request resumes token for
token; requests with images a model cannot read are refused before they run. On Qwen2.5-VL the
engine's greedy tokens are the ones mlx-vlm's own model gives at the positions its
`get_rope_index` assigns (images along their grids, the text after them shifted).
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import mlx.core as mx
import pytest

import engine.core.runner as runner_module
from engine.core.batched import BatchedEngine
from engine.core.simple import SimpleEngine
from engine.models import mrope
from engine.models.loader import LoadedModel, load_model
from engine.models.vision import KEY_BASE, VisionModelError
from engine.protocol import GenerationRequest, InvalidRequestError, PromptImage, ServiceClass
from tests.engine.conftest import drive, greedy, manual_engine, run_batched
from tests.engine.test_prefix_identity import assert_same, tokens
from tests.fixtures.tiny_vision import (
    IMAGE_TOKEN,
    build_tiny_gemma_vision_model,
    build_tiny_llava_model,
    build_tiny_qwen_vision_model,
    build_tiny_vision_model,
    image_bytes,
)

MAX_TOKENS = 8
RED, BLUE, GREEN = image_bytes("red"), image_bytes("navy", mark=6), image_bytes("green", (20, 64))


BUILDERS = {
    "smolvlm": build_tiny_vision_model,
    "qwen2_5_vl": build_tiny_qwen_vision_model,
    "llava": build_tiny_llava_model,
    "llava-qwen2": lambda: build_tiny_llava_model(decoder="qwen2"),
    "qwen3_vl": lambda: build_tiny_qwen_vision_model(version="3"),
    "gemma3": build_tiny_gemma_vision_model,
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def tiny_vlm(request) -> LoadedModel:
    return load_model(BUILDERS[request.param](), name="tiny-vlm")


@pytest.fixture(scope="module", params=["2.5", "2", "3"])
def tiny_qwen_vlm(request) -> LoadedModel:
    return load_model(build_tiny_qwen_vision_model(version=request.param), name="tiny-qwen-vlm")


def image_mark(loaded: LoadedModel) -> str:
    """What the model's chat template writes for one image."""
    if loaded.vision.mrope:  # Qwen-VL
        return f"<|vision_start|>{IMAGE_TOKEN}<|vision_end|>"
    return loaded.vision.image_token  # Gemma 3: its start-of-image token


def image_request(
    loaded: LoadedModel, rid: str, text: str, images: list[bytes], tier: str | None = None
) -> GenerationRequest:
    prompt = (
        f"<|im_start|>user\n{text}{image_mark(loaded) * len(images)} What is this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids, counts = loaded.vision.expand(prompt, images)
    service = ServiceClass(tenant=rid, tier=tier) if tier else ServiceClass()
    return GenerationRequest(
        rid,
        "tiny",
        tuple(ids),
        greedy(MAX_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=5),
        service=service,
        images=tuple(map(PromptImage.of, images, counts)),
    )


def text_request(loaded: LoadedModel, rid: str, length: int, seed: int) -> GenerationRequest:
    params = greedy(MAX_TOKENS, ignore_eos=True, logprobs=True, top_logprobs=5)
    return GenerationRequest(
        rid, "tiny", tuple(tokens(loaded.info.vocab_size, length, seed)), params
    )


def reference_logits(vision, ids: mx.array, embeddings: mx.array, layout) -> mx.array:
    """mlx-vlm's own language model over a whole prompt at `layout`'s positions (and with
    its deepstack features, on Qwen3-VL)."""
    extra = {}
    if layout.deepstack:
        mask = mx.zeros(ids.shape, dtype=mx.bool_)
        mask[0, mx.array(layout.visual)] = True
        extra = {"visual_pos_masks": mask, "deepstack_visual_embeds": list(layout.deepstack)}
    out = vision.model.language_model(
        ids, inputs_embeds=embeddings, position_ids=layout.table[:, None, :], **extra
    )
    return out.logits


def test_the_loader_serves_mlx_lms_language_model_on_the_encoders_arrays(tiny_vlm):
    assert tiny_vlm.info.input_kinds == ("text", "image")
    vision = tiny_vlm.vision
    decoder = getattr(vision.model.config.text_config, "model_type", "llama")
    modules = {"qwen3_vl_text": "qwen3", "qwen2_5_vl": "qwen2", "gemma3_text": "gemma3_text"}
    expected = modules.get(decoder, "qwen2" if decoder == "qwen2" else "llama")
    assert type(tiny_vlm.model).__module__ == f"mlx_lm.models.{expected}"
    ours = tiny_vlm.model.model.embed_tokens.weight
    theirs = vision.model.language_model
    assert ours is getattr(theirs, "model", theirs).embed_tokens.weight  # shared, not copied
    request = image_request(tiny_vlm, "a", "Look:", [RED])
    count = request.images[0].num_tokens
    assert sum(t == vision.image_token_id for t in request.prompt_token_ids) == count
    # Qwen2.5: 56x84 px in 28 px cells (Qwen3: 64x96 in 32); SmolVLM: 4 after its pixel
    # shuffle; LLaVA: 16 patches.
    counts = {"qwen2_5_vl": 6, "qwen3_vl": 6, "smolvlm": 4, "llava": 16, "gemma3": 4}
    assert count == counts[vision.model.config.model_type]
    # A rendered prompt's marks (what the template writes per image) expand the same way.
    rendered = tiny_vlm.tokenizer.encode(f"Look: {image_mark(tiny_vlm)}", add_special_tokens=False)
    expanded, counts_seen = vision.expand_ids(rendered, [RED])
    assert counts_seen == [count] and expanded.count(vision.image_token_id) == count
    embeddings, where = vision.embed(request.prompt_token_ids, [RED])
    ids = mx.array(request.prompt_token_ids)[None]
    layout = None
    if vision.mrope:
        layout, delta = where
        table = layout.table
        assert delta < 0 and (table[0] != table[1]).any().item()  # positions along the grid
        again, shift = vision.positions(request.prompt_token_ids, [RED])  # without the tower
        assert shift == delta and mx.array_equal(again.table, table).item()
        expected = reference_logits(vision, ids, embeddings, layout)
    else:
        assert where is None
        # (A copy each: Gemma's models scale their input embeddings in place.)
        expected = theirs(ids, inputs_embeds=mx.array(embeddings)).logits
    with mrope.prompt(tiny_vlm.model, layout):
        mine = tiny_vlm.model(ids, input_embeddings=mx.array(embeddings))
    assert mx.allclose(mine, expected, rtol=1e-4, atol=1e-4).item()


def test_image_requests_batch_with_text_requests_as_they_run_alone(tiny_vlm):
    requests = [
        image_request(tiny_vlm, "red", "Look at this:", [RED]),
        text_request(tiny_vlm, "text-short", 7, seed=1),
        image_request(tiny_vlm, "two", "Compare", [BLUE, GREEN]),
        text_request(tiny_vlm, "text-long", 40, seed=2),
        image_request(tiny_vlm, "blue", "And this one?", [BLUE]),
    ]
    alone = {r.request_id: run_batched(tiny_vlm, [r]) for r in requests}
    # Chunks of 6 tokens cut through the images' placeholders; requests join mid-stream.
    together = run_batched(tiny_vlm, requests, join_at=[0, 0, 1, 2, 5], max_num_batched_tokens=6)
    for r in requests:
        assert_same(together, r.request_id, alone[r.request_id], r.request_id)
    # The image reaches the output: the same text with another image answers otherwise.
    red = image_request(tiny_vlm, "r", "Look at this:", [RED])
    blue = image_request(tiny_vlm, "b", "Look at this:", [BLUE])
    outputs = run_batched(tiny_vlm, [red, blue])
    first = [outputs.events[(rid, 0)][0].logprobs[0].top_logprobs for rid in ("r", "b")]
    assert [(t.token_id, t.logprob) for t in first[0]] != [
        (t.token_id, t.logprob) for t in first[1]
    ]


def test_the_prefix_cache_keys_images_by_their_content(tiny_vlm, monkeypatch):
    engine = manual_engine(tiny_vlm, BatchedEngine)
    encoded = []
    embed = type(tiny_vlm.vision).embed
    monkeypatch.setattr(
        type(tiny_vlm.vision), "embed", lambda self, *a: encoded.append(1) or embed(self, *a)
    )
    cold = drive(engine, [image_request(tiny_vlm, "cold", "Look at this:", [RED])])
    assert len(encoded) == 1
    warm = drive(engine, [image_request(tiny_vlm, "warm", "Look at this:", [RED])])
    if engine.prefix_cache is None:  # Gemma 3: sliding windows, no prefix cache for any prompt
        assert warm.cached("warm") == 0 and len(encoded) == 2
        assert_same(warm, "warm", cold, "cold")
        return
    assert len(encoded) == 1  # the hit covers the image: no encoder
    other = drive(engine, [image_request(tiny_vlm, "other", "Look at this:", [BLUE])])
    prompt = image_request(tiny_vlm, "x", "Look at this:", [RED]).prompt_token_ids
    first_image = prompt.index(tiny_vlm.vision.image_token_id)
    assert warm.cached("warm") == len(prompt) - 1  # the image included
    assert other.cached("other") == first_image  # the text before the image only
    assert_same(warm, "warm", cold, "cold")
    fresh = run_batched(tiny_vlm, [image_request(tiny_vlm, "fresh", "Look at this:", [BLUE])])
    assert_same(other, "other", fresh, "fresh")
    request = engine.make_request(image_request(tiny_vlm, "k", "Look at this:", [RED]), print)
    keys = request.prompt_token_ids
    # Its vision tower's forward counts in the memory budget while it prefills.
    count = request.spec.images[0].num_tokens
    assert request.prefill_bytes == tiny_vlm.vision.activation_bytes([count]) > 0
    assert all(k >= KEY_BASE for k in keys[first_image : first_image + count])
    assert len(set(keys[first_image : first_image + count])) == count


def test_a_preempted_image_request_resumes_token_for_token(tiny_vlm):
    flex = [
        image_request(tiny_vlm, "f0", "Look:", [RED], tier="flex"),
        image_request(tiny_vlm, "f1", "And:", [GREEN], tier="flex"),
    ]
    urgent = text_request(tiny_vlm, "p", 6, seed=3)
    urgent = dataclasses.replace(urgent, service=ServiceClass(tenant="B", tier="priority"))
    spec = {"max_num_seqs": 2, "tier_min_share": 0.0}
    alone = {
        r.request_id: run_batched(
            tiny_vlm, [dataclasses.replace(r, service=ServiceClass())], **spec
        )
        for r in [*flex, urgent]
    }
    engine = manual_engine(tiny_vlm, BatchedEngine, **spec)
    together = drive(engine, [*flex, urgent], join_at=[0, 0, 4])
    assert engine.scheduler.num_preemptions >= 1
    for r in [*flex, urgent]:
        assert_same(together, r.request_id, alone[r.request_id], r.request_id)


def test_requests_with_images_a_model_cannot_read_are_refused(tiny_vlm, tiny_llama):
    request = image_request(tiny_vlm, "a", "Look:", [RED])
    text_engine = manual_engine(tiny_llama, BatchedEngine)
    with pytest.raises(InvalidRequestError, match="takes no images"):
        text_engine.check(request)
    with pytest.raises(InvalidRequestError, match="takes no images"):
        manual_engine(tiny_vlm, SimpleEngine).check(request)
    engine = manual_engine(tiny_vlm, BatchedEngine)
    lying = dataclasses.replace(
        request, images=(dataclasses.replace(request.images[0], num_tokens=3),)
    )
    with pytest.raises(InvalidRequestError, match="placeholder"):
        engine.check(lying)
    extra = dataclasses.replace(request, images=(*request.images, PromptImage.of(BLUE, 2)))
    with pytest.raises(InvalidRequestError, match="placeholder"):
        engine.check(extra)
    # Images travel to remote workers with their requests.
    assert GenerationRequest.from_dict(json.loads(json.dumps(request.to_dict()))) == request


def test_a_vision_architecture_orchard_cannot_serve_fails_its_load(tmp_path):
    folder = shutil.copytree(build_tiny_vision_model(), tmp_path / "paligemma")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "paligemma"}))
    supported = "gemma3, idefics3, llava, qwen2_5_vl, qwen2_vl, qwen3_vl, smolvlm"
    with pytest.raises(VisionModelError, match=f"not supported yet; supported: {supported}"):
        load_model(folder)


def test_an_mrope_model_decodes_at_the_positions_its_images_give(tiny_qwen_vlm):
    """Greedy tokens of image requests of several grids (each shifting its later positions by
    its own delta), batched with a text request in chunks that cut through the images, are
    mlx-vlm's own model's: whole forwards at the positions its `get_rope_index` assigns, each
    generated token at its index plus the prompt's delta."""
    loaded, vision = tiny_qwen_vlm, tiny_qwen_vlm.vision
    requests = [
        image_request(loaded, "red", "Look at this:", [RED]),
        image_request(loaded, "two", "Compare", [GREEN, BLUE]),
        text_request(loaded, "text", 11, seed=4),
        image_request(loaded, "green", "And this one?", [GREEN]),
    ]
    together = run_batched(loaded, requests, join_at=[0, 0, 1, 3], max_num_batched_tokens=6)
    deltas = set()
    for request in requests:
        images = [image.data for image in request.images]
        ids = list(request.prompt_token_ids)
        if images:
            embeddings, (layout, delta) = vision.embed(ids, images)
        else:
            embeddings = vision.model.language_model.model.embed_tokens(mx.array(ids)[None])
            layout, delta = mrope.Layout(mx.broadcast_to(mx.arange(len(ids)), (3, len(ids)))), 0
        deltas.add(delta)
        expected = []
        for _ in range(MAX_TOKENS):
            logits = reference_logits(vision, mx.array(ids)[None], embeddings, layout)
            token = int(mx.argmax(logits[0, -1]).item())
            expected.append(token)
            ids.append(token)
            step = vision.model.language_model.model.embed_tokens(mx.array([[token]]))
            embeddings = mx.concatenate([embeddings, step], axis=1)
            layout = layout.extended(len(ids), delta)
        assert together.tokens(request.request_id) == expected, request.request_id
    assert len(deltas) >= 3  # 0 for text, and the images' own shifts


def test_an_image_the_encoder_fails_on_ends_its_own_request_only(tiny_vlm, monkeypatch):
    requests = [
        image_request(tiny_vlm, "red", "Look at this:", [RED]),
        text_request(tiny_vlm, "text", 9, seed=5),
        image_request(tiny_vlm, "bad", "And this?", [GREEN]),
    ]
    alone = {r.request_id: run_batched(tiny_vlm, [r]) for r in requests[:2]}
    embed = type(tiny_vlm.vision).embed

    def failing(self, token_ids, images):
        if GREEN in images:
            raise MemoryError("the tower ran out of memory")
        return embed(self, token_ids, images)

    monkeypatch.setattr(type(tiny_vlm.vision), "embed", failing)
    engine = manual_engine(tiny_vlm, BatchedEngine)
    together = drive(engine, requests, join_at=[0, 1, 1])
    for rid in ("red", "text"):
        assert_same(together, rid, alone[rid], rid)
    last = together.events[("bad", 0)][-1]
    assert last.finish_reason == "error" and "out of memory" in last.error
    assert not engine.runner._prefill_caches and not engine.scheduler.has_work()


def test_images_the_memory_budget_cannot_hold_are_refused_and_the_tower_counts_until_it_ran(
    tiny_vlm, monkeypatch
):
    engine = manual_engine(tiny_vlm, BatchedEngine)
    spec = image_request(tiny_vlm, "a", "Look:", [RED])
    request = engine.make_request(spec, print)
    tower = request.prefill_bytes
    engine.runner.encode(request)  # the tower runs: its embeddings are what the prefill holds
    layout = request.layout
    held = [layout.table, *layout.deepstack] if layout is not None else []
    assert 0 < request.prefill_bytes == request.embeddings.nbytes + sum(a.nbytes for a in held)
    engine.runner.release(spec.request_id)
    assert tower == tiny_vlm.vision.activation_bytes([spec.images[0].num_tokens])
    monkeypatch.setattr(
        type(tiny_vlm.vision), "activation_bytes", lambda self, tokens: 1 << 50
    )  # a photo whose tower would need a petabyte
    if engine.memory is None:  # Gemma 3: sliding windows, no budget to hold it against
        assert engine.check(spec) > 0
        return
    with pytest.raises(InvalidRequestError, match="memory budget") as refused:
        engine.check(spec)
    assert refused.value.code == "image_too_large"


def test_a_prefix_hit_is_let_go_when_an_image_requests_cache_cannot_start(tiny_vlm, monkeypatch):
    engine = manual_engine(tiny_vlm, BatchedEngine)
    drive(engine, [image_request(tiny_vlm, "cold", "Look at this:", [RED])])
    if engine.prefix_cache is None:  # Gemma 3: sliding windows, so nothing cached to hold
        assert engine.layout is None and type(tiny_vlm.model).__module__.endswith("gemma3_text")
        return
    assert engine.prefix_cache.nbytes > 0

    def failing(*args, **kwargs):
        raise MemoryError("no room to copy the cached keys")

    monkeypatch.setattr(runner_module, "start_cache", failing)
    warm = drive(engine, [image_request(tiny_vlm, "warm", "Look at this:", [RED])])
    assert warm.events[("warm", 0)][-1].finish_reason == "error"
    engine.prefix_cache.evict(1 << 40)
    assert engine.prefix_cache.nbytes == 0  # nothing left locked


def test_qwen_images_without_their_vision_start_token_fail_their_request(tiny_qwen_vlm):
    """A template that writes the bare placeholder (no vision start token before it) would put
    every token at one position: the request fails saying so, the others run."""
    prompt = f"<|im_start|>user\nLook: {IMAGE_TOKEN}<|im_end|>\n<|im_start|>assistant\n"
    ids, counts = tiny_qwen_vlm.vision.expand(prompt, [RED])
    bare = GenerationRequest(
        "bare",
        "tiny",
        tuple(ids),
        greedy(MAX_TOKENS, ignore_eos=True),
        images=(PromptImage.of(RED, counts[0]),),
    )
    text = text_request(tiny_qwen_vlm, "text", 9, seed=6)
    out = run_batched(tiny_qwen_vlm, [bare, text])
    last = out.events[("bare", 0)][-1]
    assert last.finish_reason == "error" and "vision start" in last.error
    assert len(out.tokens("text")) == MAX_TOKENS
