"""Image inputs, checked before anything else sees them: the one public face of this package.

The views call `image_from_url` for a URL field (OpenAI's `image_url.url`, Responses'
`input_image.image_url`, Anthropic's `source.type: "url"`), which takes data URLs as well as
http(s) ones, and `image_from_base64` for Anthropic's `source.type: "base64"`. Each returns an
`ImageInput` (the bytes as sent, the real format, the size) or raises `ImageError`, whose
`message` says why for the 400 and whose `code` is one of `inference.images.errors`' constants.

Accepted: PNG, JPEG, GIF and WebP, as the bytes show, whatever type was declared (which must only
say `image/...`), within ORCHARD_IMAGE_MAX_BYTES and ORCHARD_IMAGE_MAX_PIXELS. URLs are fetched
only when ORCHARD_IMAGE_FETCH is on, and then only from public addresses (fetch.py).
"""

from __future__ import annotations

from inference.images.addresses import Resolver
from inference.images.errors import ImageError
from inference.images.fetch import image_fetch
from inference.images.formats import ImageInput
from inference.images.inline import image_from_base64, image_from_data_url, is_data_url
from inference.images.policy import ImagePolicy

__all__ = [
    "ImageError",
    "ImageInput",
    "ImagePolicy",
    "Resolver",
    "image_from_base64",
    "image_from_data_url",
    "image_from_url",
]


async def image_from_url(
    url: str, *, policy: ImagePolicy | None = None, resolve: Resolver | None = None
) -> ImageInput:
    """The image a data URL carries or an http(s) URL serves, checked; ImageError otherwise.
    `resolve` replaces the system's DNS (tests)."""
    if is_data_url(url):
        return image_from_data_url(url, policy=policy)
    return await image_fetch(url, policy=policy, resolve=resolve)
