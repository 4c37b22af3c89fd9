"""Image prompts in the engine (engine/models/vision.py), on a tiny SmolVLM with the real Qwen3
tokenizer and a real processor configuration (tests/fixtures/tiny_vision.py).

The loader serves the language model as mlx-lm's, on the encoder's own arrays; an image request
prefills from its input embeddings (the images' features at their placeholders) in chunks and
decodes in the continuous batch beside text requests with greedy output and logprobs identical
to alone; the prefix cache keys image positions by the image's content (a repeated image is a
hit, another image at the same place is not); a preempted image request resumes token for
token; requests with images a model cannot read are refused before they run.
"""

from __future__ import annotations

import dataclasses
import json
import shutil

import mlx.core as mx
import pytest

from engine.core.batched import BatchedEngine
from engine.core.simple import SimpleEngine
from engine.models.loader import LoadedModel, load_model
from engine.models.vision import KEY_BASE, VisionModelError
from engine.protocol import GenerationRequest, InvalidRequestError, PromptImage, ServiceClass
from tests.engine.conftest import drive, greedy, manual_engine, run_batched
from tests.engine.test_prefix_identity import assert_same, tokens
from tests.fixtures.tiny_vision import IMAGE_TOKEN, build_tiny_vision_model, image_bytes

MAX_TOKENS = 8
RED, BLUE, GREEN = image_bytes("red"), image_bytes("navy", mark=6), image_bytes("green", (20, 64))


@pytest.fixture(scope="module")
def tiny_vlm() -> LoadedModel:
    return load_model(build_tiny_vision_model(), name="tiny-vlm")


def image_request(
    loaded: LoadedModel, rid: str, text: str, images: list[bytes], tier: str | None = None
) -> GenerationRequest:
    prompt = (
        f"<|im_start|>user\n{text}{IMAGE_TOKEN * len(images)} What is this?<|im_end|>\n"
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


def test_the_loader_serves_mlx_lms_language_model_on_the_encoders_arrays(tiny_vlm):
    assert tiny_vlm.info.input_kinds == ("text", "image")
    assert type(tiny_vlm.model).__module__ == "mlx_lm.models.llama"
    vision = tiny_vlm.vision
    ours = tiny_vlm.model.model.embed_tokens.weight
    assert ours is vision.model.language_model.embed_tokens.weight  # shared, not copied
    request = image_request(tiny_vlm, "a", "Look:", [RED])
    assert sum(t == vision.image_token_id for t in request.prompt_token_ids) == 4
    assert request.images[0].num_tokens == 4
    embeddings = vision.embed(request.prompt_token_ids, [RED])
    ids = mx.array(request.prompt_token_ids)[None]
    theirs = vision.model.language_model(ids, inputs_embeds=embeddings).logits
    mine = tiny_vlm.model(ids, input_embeddings=embeddings)
    assert mx.allclose(mine, theirs, rtol=1e-4, atol=1e-4).item()


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
    assert request.prefill_bytes == tiny_vlm.vision.activation_bytes(1) > 0
    assert all(k >= KEY_BASE for k in keys[first_image : first_image + 4])
    assert len(set(keys[first_image : first_image + 4])) == 4


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
    extra = dataclasses.replace(request, images=(*request.images, PromptImage.of(BLUE, 4)))
    with pytest.raises(InvalidRequestError, match="placeholder"):
        engine.check(extra)
    # Images travel to remote workers with their requests.
    assert GenerationRequest.from_dict(json.loads(json.dumps(request.to_dict()))) == request


def test_a_vision_architecture_orchard_cannot_serve_fails_its_load(tmp_path):
    folder = shutil.copytree(build_tiny_vision_model(), tmp_path / "llava")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "llava"}))
    with pytest.raises(VisionModelError, match="not supported yet; supported: idefics3, smolvlm"):
        load_model(folder)
