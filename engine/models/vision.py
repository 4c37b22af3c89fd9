"""Vision-language models: images into the language model's input embeddings.

mlx-vlm (PyPI, the field's MLX library for vision-language models) loads a model folder whole:
its vision tower, the projector, its own copy of the language model, and the processor (image
preprocessing and the prompt's image tokens). Orchard serves the language model as mlx-lm's,
built from the same weights (shared, not copied), so an image request decodes in the same
continuous batch, caches and kernels as any text request; from mlx-vlm it keeps the encoder:
`VisionEncoder.embed` turns a prompt's token ids and its images into input embeddings, each
image's placeholder tokens carrying that image's features. The runner feeds a request's prefill
chunks those embeddings (engine/core/runner.py); its last prompt token, a text token, joins the
decode batch by id.

Supported: SmolVLM and Idefics3 (`smolvlm`, `idefics3`: a Llama decoder, plain positions), LLaVA
(`llava`: a CLIP-style tower and a Llama or Qwen2 decoder, plain positions), Qwen2-VL and
Qwen2.5-VL (`qwen2_vl`, `qwen2_5_vl`: a Qwen2 decoder whose rotary positions follow each image's
grid, engine/models/mrope.py), Qwen3-VL (`qwen3_vl`: a Qwen3 decoder, the same positions, and
the tower's features added to its first layers' output), and Gemma 3 (`gemma3`: a Gemma 3
decoder, plain positions; its template writes a start-of-image token per image, which the
processor expands). Other mlx-vlm architectures fail the load with a sentence saying which are
supported.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine.models import mrope
from engine.protocol import InvalidRequestError, RenderedPrompt

# mlx-vlm's text decoders Orchard maps onto an mlx-lm model (model_type -> mlx-lm module; for
# LLaVA, whichever of its decoders the text config names).
TEXT_MODELS = {
    "smolvlm": "llama",
    "idefics3": "llama",
    "qwen2_vl": "qwen2",
    "qwen2_5_vl": "qwen2",
    "qwen3_vl": "qwen3",
    "gemma3": "gemma3_text",
    "llava": ("llama", "qwen2"),
}
# Head sizes MLX's fused attention takes on a GPU (it then never materialises the scores).
FUSED_HEAD_DIMS = (64, 80, 128)
# The processor's outputs an encoder reads besides the token ids.
PIXEL_INPUTS = ("pixel_values", "pixel_attention_mask", "image_grid_thw", "image_sizes")


class VisionModelError(ValueError):
    """A model folder Orchard cannot serve as a vision-language model (the load fails)."""


def is_vision_model(config: dict[str, Any]) -> bool:
    return isinstance(config.get("vision_config"), dict)


def read_config(path: Path) -> dict[str, Any]:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}


@dataclass
class VisionEncoder:
    """A loaded model's vision half: mlx-vlm's model (its tower and projector; its language
    model's arrays are the served model's) and processor."""

    model: nn.Module
    processor: Any
    image_token_id: int
    # The token a chat template writes for one image, which the processor expands (around) the
    # image's placeholders (Gemma 3: its start-of-image token); None: the placeholder itself.
    mark_id: int | None = None
    mark: str | None = None
    # Whether the language model's positions follow the images' grids (M-RoPE): then a
    # prompt with images carries its positions (`positions`) into its prefill and decode.
    mrope: bool = False

    def activation_bytes(self, image_tokens: Sequence[int]) -> int:
        """About the most memory the vision tower's forward over images of `image_tokens`
        placeholder tokens each holds at once: a layer's hidden states and MLP over the images'
        patches, and its attention scores (heads × patches², float32) where MLX's attention
        holds them (on the CPU, and on a GPU for head sizes its fused kernel does not take).
        The memory budget counts it for an image request until its tower has run
        (engine/core/scheduler.py); a request needing more than the budget is refused."""
        vision = self.model.config.vision_config
        heads = getattr(vision, "num_attention_heads", None) or vision.num_heads
        merge = getattr(vision, "spatial_merge_size", None)
        if merge:  # Qwen-VL: one placeholder per merge × merge patches, attending per image
            groups = [tokens * merge * merge for tokens in image_tokens]
        else:  # SmolVLM, LLaVA: tiles of the tower's size, each attending within itself
            patches = (vision.image_size // vision.patch_size) ** 2
            shuffle = getattr(self.model.config, "scale_factor", 1)  # SmolVLM: pixel shuffle
            per_tile = max(1, patches // (shuffle**2))
            tiles = sum(-(-tokens // per_tile) for tokens in image_tokens)
            groups = [patches] * tiles
        width = getattr(vision, "embed_dim", None) or vision.hidden_size  # Qwen2-VL: embed_dim
        mlp = getattr(vision, "intermediate_size", None) or int(width * vision.mlp_ratio)
        states = sum(groups) * (2 * width + mlp)
        if mx.default_device() != mx.cpu and width // heads in FUSED_HEAD_DIMS:
            return 4 * states  # the GPU's fused attention never holds the scores
        # Qwen's tower attends image by image (at most one image's scores at once); SmolVLM's
        # and LLaVA's run every tile of the request as one batch.
        scores = heads * max(groups, default=0) ** 2 * (1 if merge else len(groups))
        return 4 * (states + scores)

    def prepare(self, request: Any) -> None:
        """An image request (engine/core/request.py) as the engine keeps it: its prefix-cache
        key ids (each image's placeholders keyed by the image's digest) and the memory its
        vision tower's forward holds while it prefills."""
        images = request.spec.images
        counts = [image.num_tokens for image in images]
        request.image_key_ids = cache_key_ids(
            request.spec.prompt_token_ids,
            counts,
            [image.digest for image in images],
            self.image_token_id,
        )
        request.prefill_bytes = self.activation_bytes(counts)

    def start_prefill(self, request: Any, start: int, embed_tokens: Any) -> None:
        """A request (engine/core/request.py) with images, prefilling from `start`: its input
        embeddings (its images' features at their placeholders; the tokens it had generated,
        resumed after a preemption, by the served model's `embed_tokens`) unless a prefix hit
        covered every image (the rest is text, fed by id, and the tower does not run); and on
        an M-RoPE model its layout and decode shift."""
        images = [image.data for image in request.spec.images]
        prompt = request.spec.prompt_token_ids
        where = None
        if any(t >= KEY_BASE for t in request.prompt_token_ids[start:]):
            embeddings, where = self.embed(prompt, images)
            if request.resumed_token_ids:
                generated = embed_tokens(mx.array(request.resumed_token_ids)[None])
                embeddings = mx.concatenate(
                    [embeddings, generated.astype(embeddings.dtype)], axis=1
                )
            request.embeddings = embeddings
        elif self.mrope:
            where = self.positions(prompt, images)
        if where is not None:
            layout, request.rope_delta = where
            request.layout = layout.extended(request.num_prefill_tokens, request.rope_delta)

    @property
    def image_token(self) -> str:
        """The text that stands for one image in a prompt before `expand`."""
        return self.mark or self.processor.image_token

    @property
    def image_mark_id(self) -> int:
        """The token id of `image_token`."""
        return self.image_token_id if self.mark_id is None else self.mark_id

    def expand(self, text: str, images: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """The token ids of `text`, whose image tokens (one per image, in order) become each
        image's placeholder tokens (how many: the processor's, for that image's size); and
        how many placeholder tokens each image has."""
        pictures = _pictures(images)
        out = self.processor(text=[text], images=[pictures] if pictures else None)
        counts = [self._placeholders([picture]) for picture in pictures]
        return [int(t) for t in out["input_ids"][0]], counts

    def expand_ids(
        self, token_ids: Sequence[int], images: Sequence[bytes]
    ) -> tuple[list[int], list[int]]:
        """A rendered prompt's ids, whose image tokens (the template's one per image part, in
        order) become each image's placeholder tokens; and how many each image has.
        ValueError when the prompt does not hold one image token per image."""
        marks = [i for i, t in enumerate(token_ids) if t == self.image_mark_id]
        if len(marks) != len(images):
            raise ValueError(
                f"the rendered prompt holds {len(marks)} image tokens for {len(images)} "
                "image(s) (is the image token in the text?)"
            )
        out, counts, start = [], [], 0
        # (Processors differ in which keywords reach the tokenizer, so the tokenizer's own
        # leading special token, if it adds one, is taken off here.)
        bos = getattr(self.processor.tokenizer, "bos_token_id", None)
        for mark, picture in zip(marks, _pictures(images), strict=True):
            text = self.processor(text=[self.image_token], images=[[picture]])
            ids = [int(t) for t in text["input_ids"][0]]
            if ids and bos is not None and ids[0] == bos != self.image_mark_id:
                ids = ids[1:]
            out += [*token_ids[start:mark], *ids]
            counts.append(sum(t == self.image_token_id for t in ids))
            start = mark + 1
        return [*out, *token_ids[start:]], counts

    def _placeholders(self, pictures: list) -> int:
        inputs = self.processor(text=[self.image_token * len(pictures)], images=[pictures])
        return sum(int(t) == self.image_token_id for t in inputs["input_ids"][0])

    def embed(
        self, token_ids: Sequence[int], images: Sequence[bytes]
    ) -> tuple[mx.array, tuple[mrope.Layout, int] | None]:
        """Input embeddings (1, len(token_ids), hidden) of a prompt whose placeholder tokens are
        its images' (`expand`'s), and on an M-RoPE model its layout and decode shift (as
        `positions`, with Qwen3-VL's deepstack features); ValueError when the counts disagree."""
        inputs = self.processor(text=[self.image_token * len(images)], images=[_pictures(images)])
        expected = sum(int(t) == self.image_token_id for t in inputs["input_ids"][0])
        found = sum(t == self.image_token_id for t in token_ids)
        if found != expected:
            raise ValueError(
                f"the prompt has {found} image placeholder tokens where its "
                f"{len(images)} image(s) need {expected}"
            )
        pixels = {key: mx.array(inputs[key]) for key in PIXEL_INPUTS if inputs.get(key) is not None}
        if "mask" in inspect.signature(self.model.get_input_embeddings).parameters:
            pixels["mask"] = mx.ones((1, len(token_ids)), dtype=mx.int32)  # (Gemma 3's)
        features = self.model.get_input_embeddings(mx.array(list(token_ids))[None], **pixels)
        if not self.mrope:
            return features.inputs_embeds, None
        stacked = getattr(features, "deepstack_visual_embeds", None) or ()
        visual = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        return features.inputs_embeds, _layout(
            features.position_ids, features.rope_deltas, visual, stacked
        )

    def positions(
        self, token_ids: Sequence[int], images: Sequence[bytes]
    ) -> tuple[mrope.Layout, int] | None:
        """On an M-RoPE model, a prompt's layout: its positions (3, len(token_ids)): time,
        height and width (equal for text), each image's along its grid; and the shift of every
        token after the prompt (its position minus its index). None on other models. (Without
        the vision tower: no deepstack features, for a prompt whose images are all cached.)"""
        if not self.mrope:
            return None
        pictures = _pictures(images)
        grid = self.processor.image_processor(images=pictures)["image_grid_thw"]
        table, delta = self.model.language_model.get_rope_index(
            mx.array(list(token_ids))[None], mx.array(grid)
        )
        return _layout(table, delta, (), ())


def _layout(
    position_ids: mx.array, deltas: mx.array, visual: Sequence[int], stacked: Sequence[mx.array]
) -> tuple[mrope.Layout, int]:
    table = position_ids[:, 0, :].astype(mx.int32)
    layout = mrope.Layout(table, tuple(visual) if stacked else (), tuple(stacked))
    delta = int(deltas.reshape(-1)[0].item())
    if delta == 0:  # every image of two or more placeholders shifts what follows it
        raise ValueError(
            "the prompt's images are not where the model's positions expect them (each image's "
            "placeholders follow a vision start token in its chat template)"
        )
    return layout, delta


# Prefix-cache keys of image positions: ids above any vocabulary's (token ids are below 2**31),
# drawn from the image's digest and the position in it, so equal keys mean the same image.
KEY_BASE = 1 << 31


def cache_key_ids(
    token_ids: Sequence[int], counts: Sequence[int], digests: Sequence[str], image_token_id: int
) -> tuple[int, ...]:
    """`token_ids` with each image's placeholder tokens (the first `counts[0]` placeholders are
    the first image's, and so on) as ids keyed by that image's digest: the prefix cache then
    matches a prompt's images by content, where every placeholder has the same token id."""
    keys = list(token_ids)
    owners = [
        (digest, j) for digest, count in zip(digests, counts, strict=True) for j in range(count)
    ]
    placeholders = (i for i, t in enumerate(token_ids) if t == image_token_id)
    for i, (digest, j) in zip(placeholders, owners, strict=True):
        hashed = hashlib.blake2b(f"{digest}:{j}".encode(), digest_size=4).digest()
        keys[i] = KEY_BASE + (int.from_bytes(hashed, "little") % KEY_BASE)
    return tuple(keys)


async def expand_rendered(
    vision: VisionEncoder | None, rendered: RenderedPrompt, images: Sequence[bytes]
) -> RenderedPrompt:
    """A rendered chat prompt with its images' placeholder tokens (`expand_ids`, on a thread:
    the processor resizes the images); InvalidRequestError when the model takes no images or
    the prompt does not hold one image token per image."""
    if vision is None:
        raise InvalidRequestError("This model takes no images.", param="messages")
    try:
        ids, counts = await asyncio.to_thread(vision.expand_ids, rendered.token_ids, images)
    except ValueError as exc:
        raise InvalidRequestError(
            f"The images could not be placed: {exc}.", param="messages"
        ) from None
    return dataclasses.replace(rendered, token_ids=tuple(ids), image_tokens=tuple(counts))


def check_images(request: Any, vision: VisionEncoder | None, memory: Any = None) -> None:
    """InvalidRequestError unless `request`'s images are this model's to read: a vision model,
    the prompt's placeholder tokens the images' own (their `num_tokens`, summed), and, with
    the engine's `memory` budget, a vision tower forward that fits in it."""
    if vision is None:
        raise InvalidRequestError("This model takes no images.", param="messages")
    placeholders = sum(t == vision.image_token_id for t in request.prompt_token_ids)
    claimed = sum(image.num_tokens for image in request.images)
    if placeholders != claimed or any(image.num_tokens < 1 for image in request.images):
        raise InvalidRequestError(
            f"The prompt has {placeholders} image placeholder tokens; its "
            f"{len(request.images)} image(s) claim {claimed}.",
            param="messages",
        )
    need = vision.activation_bytes([image.num_tokens for image in request.images])
    if memory is not None and need > memory.max_bytes:
        raise InvalidRequestError(
            f"The images need about {need / 2**30:.1f} GiB for the model's vision encoder, "
            f"more than this model's {memory.max_bytes / 2**30:.1f} GiB memory budget: send "
            "fewer or smaller images.",
            param="messages",
            code="image_too_large",
        )


def _pictures(images: Sequence[bytes]) -> list:
    from PIL import Image

    pictures = []
    for index, data in enumerate(images):
        try:
            picture = Image.open(io.BytesIO(data))
            picture.load()  # the first frame of an animation
            pictures.append(picture.convert("RGB"))
        except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
            raise ValueError(f"image {index + 1} could not be decoded ({exc})") from None
    return pictures


def text_module(config: dict[str, Any]) -> str:
    """The mlx-lm module that serves a vision model's language model; VisionModelError (saying
    which are supported) for one Orchard cannot serve. Checked by the loader and by pulls."""
    model_type = config.get("model_type")
    if model_type not in TEXT_MODELS:
        raise VisionModelError(
            f"vision-language models of type {model_type!r} are not supported yet; "
            f"supported: {', '.join(sorted(TEXT_MODELS))}"
        )
    decoder = TEXT_MODELS[model_type]
    if isinstance(decoder, tuple):
        named = (config.get("text_config") or {}).get("model_type", "llama")
        if named not in decoder:
            raise VisionModelError(
                f"{model_type} models with a {named!r} language model are not supported yet; "
                f"supported: {', '.join(decoder)}"
            )
        decoder = named
    return decoder


def load_vision_model(path: Path, config: dict[str, Any]) -> tuple[nn.Module, VisionEncoder]:
    """The served (mlx-lm) language model and the vision encoder of a vision model folder."""
    model_type = config.get("model_type")
    decoder = text_module(config)
    from mlx_vlm import load as vlm_load

    vlm, processor = vlm_load(str(path))
    text = _text_model(vlm, config, decoder)
    token_id = config.get("image_token_id", config.get("image_token_index"))
    if token_id is None:
        token_id = processor.tokenizer.convert_tokens_to_ids(processor.image_token)
    uses_mrope = model_type in mrope.MROPE_MODELS
    if uses_mrope:
        mrope.install(text, vlm)
    encoder = VisionEncoder(vlm, processor, int(token_id), mrope=uses_mrope)
    if model_type == "gemma3":  # its template writes the start-of-image token per image
        encoder.mark = processor.boi_token
        encoder.mark_id = int(processor.tokenizer.convert_tokens_to_ids(processor.boi_token))
    return text, encoder


def _text_model(vlm: nn.Module, config: dict[str, Any], module_name: str) -> nn.Module:
    """mlx-lm's model for mlx-vlm's language model, holding the same arrays."""
    import importlib

    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    language = vlm.language_model
    # (The text decoder's settings: SmolVLM's language model keeps them as `config`, Qwen's as
    # `args`, its `config` being the whole model's.)
    settings = next(
        c for c in (getattr(language, "args", None), language.config) if hasattr(c, "hidden_size")
    )
    text_config = {
        **{k: v for k, v in vars(settings).items() if not k.startswith("_")},
        "model_type": module_name,
        # Idefics3's decoder always has its own output projection.
        "tie_word_embeddings": not hasattr(language, "lm_head"),
    }
    if "mrope_section" in (text_config.get("rope_scaling") or {}):
        text_config["rope_scaling"] = None  # plain rope for text; M-RoPE: engine/models/mrope.py
    model = module.Model(module.ModelArgs.from_dict(text_config))
    weights = {
        name if name.startswith(("lm_head.", "model.")) else f"model.{name}": array
        for name, array in tree_flatten(language.parameters())
    }
    quantization = config.get("quantization")
    if quantization:  # quantized layers where the weights have scales, as mlx-lm loads them
        nn.quantize(
            model,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda name, module: (
                hasattr(module, "to_quantized") and f"{name}.scales" in weights
            ),
        )
    model.load_weights(list(weights.items()))
    model.eval()
    return model
