"""Images in prompts, between the endpoints and the engine.

Every route turns its image inputs into OpenAI's `image_url` parts of user messages (chat as
sent; Responses' `input_image` and Anthropic's image blocks by their converters), which
inference/api/serializers.py normalizes into {"type": "image", "url", "param", "detail"}
parts. Here, for a generation: the model must take images (a 400 naming it otherwise, before
anything is fetched), each image is read and checked once (inference/images: data URLs always,
URLs only where fetching is on, the format, bytes and pixels), and the prompt goes to rendering
with the images' bytes beside messages whose image parts are the template's {"type": "image"}.
An image sent with `detail: "low"` is first scaled down to 512 pixels on its longest side
(fewer image tokens, as OpenAI's low detail); `auto` and `high` leave the resolution to the
model's processor.

Decoding an inline image and scaling one down grow with the image, so they run as the request's
preparation jobs (`run`: `Intake.in_thread`, fair between teams: inference/services/prework.py),
never on the event loop; fetching a URL waits on the network and checks only the image's header.
"""

from __future__ import annotations

import asyncio
import dataclasses
import io
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from django.conf import settings

from engine import ModelInfo, PromptInput
from inference.errors import APIError
from inference.images import ImageError, ImageInput, image_from_data_url, image_from_url
from inference.images.inline import is_data_url

# Runs `fn(*args)` off the event loop: `Intake.in_thread` (a preparation job of the request's team).
Run = Callable[..., Awaitable[Any]]

# The most images one request may carry (each costs the vision encoder a forward).
MAX_IMAGES = 16
# How many of one request's image URLs are fetched at once.
FETCH_CONCURRENCY = 4


def image_parts(prompt: PromptInput) -> list[dict[str, Any]]:
    return [
        part
        for message in prompt.messages or ()
        if isinstance(message.get("content"), list)
        for part in message["content"]
        if part.get("type") == "image"
    ]


async def prompts_with_images(
    prompts: Sequence[PromptInput],
    *,
    info: ModelInfo,
    model: str,
    known: dict[str, ImageInput] | None = None,
    run: Run = asyncio.to_thread,
) -> list[PromptInput]:
    """`prompts` with their images read and checked, ready to render (see the module's doc);
    APIError (400) for a model without image input, too many images or pixels, or an image
    refused. `known`: the request's images read before, by URL (reused; those read now are
    added); `run`: where decoding and scaling run (the request's preparation jobs)."""
    parts = [image_parts(prompt) for prompt in prompts]
    every = [part for found in parts for part in found]
    if not every:
        return list(prompts)
    if "image" not in info.input_kinds:
        raise APIError(
            400,
            f"The model '{model}' takes no images: send text only, or choose a model that "
            "takes images (GET /v1/models lists each model's input kinds).",
            param=every[0]["param"],
            code="image_input_not_supported",
        )
    if len(every) > MAX_IMAGES:
        raise APIError(
            400,
            f"A request may carry at most {MAX_IMAGES} images; this one has {len(every)}.",
            param=every[MAX_IMAGES]["param"],
            code="too_many_images",
        )
    images = await _read(every, {} if known is None else known, run)
    pixels = sum(image.width * image.height for image in images)
    limit = settings.ORCHARD_IMAGE_MAX_REQUEST_PIXELS
    if pixels > limit:
        raise APIError(
            400,
            f"The request's images have {pixels:,} pixels together; a request may carry at "
            f"most {limit:,}: send fewer or smaller images.",
            param=every[0]["param"],
            code="image_too_many_pixels",
        )
    read = iter(
        await asyncio.gather(
            *(
                run(low_detail, image.data)
                if part.get("detail") == "low"
                else _same(image)
                for part, image in zip(every, images, strict=True)
            )
        )
    )
    return [
        dataclasses.replace(
            prompt,
            messages=_template_messages(prompt),
            images=tuple(next(read) for _ in found),
        )
        for prompt, found in zip(prompts, parts, strict=True)
    ]


# OpenAI's `detail: "low"`: the image at most this many pixels on its longest side.
LOW_DETAIL_SIDE = 512


def low_detail(data: bytes) -> bytes:
    """An image (already checked: inference/images) at most `LOW_DETAIL_SIDE` pixels on its
    longest side, as PNG; as it was when it is that small already."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as picture:
        if max(picture.size) <= LOW_DETAIL_SIDE:
            return data
        picture.load()  # (an animation's first frame)
        small = picture.convert("RGB")
        small.thumbnail((LOW_DETAIL_SIDE, LOW_DETAIL_SIDE))
        out = io.BytesIO()
        small.save(out, format="PNG")
        return out.getvalue()


async def _same(image: ImageInput) -> bytes:
    return image.data


async def _read(
    parts: list[dict[str, Any]], known: dict[str, ImageInput], run: Run
) -> list[ImageInput]:
    """Each part's image, read and checked, `FETCH_CONCURRENCY` at a time (or from `known`, by
    URL, where read before; the rest are added to it); a data URL is decoded by `run`. The
    first part (in order) that is refused is the request's 400: the parts before it are
    awaited, those after it stopped."""
    gate = asyncio.Semaphore(FETCH_CONCURRENCY)

    async def read(url: str) -> ImageInput:
        async with gate:
            image = await (
                run(image_from_data_url, url) if is_data_url(url) else image_from_url(url)
            )
        known[url] = image
        return image

    # One read per URL, however many parts carry it.
    tasks = {
        url: asyncio.ensure_future(read(url))
        for url in dict.fromkeys(part["url"] for part in parts)
        if url not in known
    }
    try:
        images = []
        for part in parts:
            try:
                task = tasks.get(part["url"])
                images.append(known[part["url"]] if task is None else await task)
            except ImageError as exc:
                raise APIError(400, exc.message, param=part["param"], code=exc.code) from None
        return images
    finally:
        for task in tasks.values():
            task.cancel()  # (those still running: after a refusal, or the caller gone)
        await asyncio.gather(*tasks.values(), return_exceptions=True)


def _template_messages(prompt: PromptInput) -> tuple[dict[str, Any], ...]:
    """The messages as the chat template sees them: each image part {"type": "image"}."""
    return tuple(
        {
            **message,
            "content": [
                {"type": "image"} if part.get("type") == "image" else part
                for part in message["content"]
            ],
        }
        if isinstance(message.get("content"), list)
        else message
        for message in prompt.messages or ()
    )
