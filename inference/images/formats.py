"""What an image's bytes really are, read from their header only.

The format is sniffed by Pillow from the bytes, never taken from a declared type: a declared type
only has to say it is an image (`image/...`), and where it names another image format than the
bytes are (a server that labels every picture `image/png`), the bytes win. Pillow is asked for
PNG, JPEG, GIF and WebP only, so no other format's parser ever sees caller-chosen bytes.

`Image.open` reads the header and decodes nothing: the dimensions are checked against the pixel
limit before anything is decoded, so a small file declaring 100000×100000 pixels (a decompression
bomb) costs a header parse. Pillow's own guard (a warning above ~89 megapixels, an error above
twice that) is caught as the same refusal.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass, field
from functools import cached_property

from PIL import Image

from inference.images.errors import (
    NOT_AN_IMAGE_TYPE,
    TOO_LARGE,
    TOO_MANY_PIXELS,
    UNSUPPORTED_FORMAT,
    ImageError,
)
from inference.images.policy import ImagePolicy

# Pillow's format name -> the media type the image is reported with.
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif", "WEBP": "image/webp"}
FORMAT_NAMES = "PNG, JPEG, GIF or WebP"


@dataclass(frozen=True)
class ImageInput:
    """An image that passed every check: its bytes, unchanged, and what they are."""

    data: bytes = field(repr=False)
    media_type: str  # of the real format, whatever was declared
    format: str  # Pillow's name: PNG, JPEG, GIF, WEBP
    width: int
    height: int

    @cached_property
    def sha256(self) -> str:
        """The content's hash (hex), computed where it is first asked for (a cache key), not on
        the event loop that checked the image."""
        return hashlib.sha256(self.data).hexdigest()


def media_type_check(declared: str | None) -> None:
    """A declared type (a Content-Type, a data URL's or a base64 block's media type) must say
    image; which image format it names does not matter (the bytes decide)."""
    media_type = (declared or "").split(";", 1)[0].strip().lower()
    if not media_type.startswith("image/"):
        shown = f"'{media_type[:80]}'" if media_type else "no type"
        raise ImageError(
            NOT_AN_IMAGE_TYPE,
            f"The image was declared as {shown}, not as an image (image/png, image/jpeg, "
            "image/gif or image/webp).",
        )


def bytes_check(size: int, policy: ImagePolicy) -> None:
    if size > policy.max_bytes:
        raise ImageError(
            TOO_LARGE,
            f"The image is larger than {policy.max_bytes:,} bytes, the most Orchard accepts.",
        )


def image_check(data: bytes, *, declared_type: str | None, policy: ImagePolicy) -> ImageInput:
    """`data` as an ImageInput, or ImageError saying why not (size, declared type, format,
    pixels, in that order)."""
    bytes_check(len(data), policy)
    media_type_check(declared_type)
    try:
        with Image.open(io.BytesIO(data), formats=tuple(FORMATS)) as image:
            image_format, (width, height) = image.format, image.size
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(TOO_MANY_PIXELS, _pixels_message(None, policy)) from None
    except (OSError, ValueError, EOFError, SyntaxError):
        # UnidentifiedImageError (an OSError) for bytes that are none of the four formats.
        raise ImageError(
            UNSUPPORTED_FORMAT,
            f"The image data is not a {FORMAT_NAMES} image (the formats Orchard accepts).",
        ) from None
    if width * height > policy.max_pixels:
        raise ImageError(TOO_MANY_PIXELS, _pixels_message((width, height), policy))
    return ImageInput(
        data=data, media_type=FORMATS[image_format], format=image_format, width=width, height=height
    )


def _pixels_message(size: tuple[int, int] | None, policy: ImagePolicy) -> str:
    shown = f"{size[0]}×{size[1]} pixels" if size else "too many pixels"
    return f"The image is {shown}; Orchard accepts at most {policy.max_pixels:,} pixels."
