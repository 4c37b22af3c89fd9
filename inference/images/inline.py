"""Images sent inside the request: data URLs (OpenAI's `image_url`, Responses' `input_image`) and
bare base64 with a media type (Anthropic's `source.type: "base64"`).

Their size is known before decoding (three bytes per four base64 characters), so an oversize one
is refused without being decoded. Only base64 data URLs are images here: the percent-encoded
form carries text formats (SVG) that are not accepted anyway.
"""

from __future__ import annotations

import base64
import binascii
import re

from inference.images.errors import INVALID_DATA, ImageError
from inference.images.formats import ImageInput, bytes_check, image_check, media_type_check
from inference.images.policy import ImagePolicy

# data:[<media type>][;<parameter>=<value>]*;base64,<data> (RFC 2397; the scheme in any case).
DATA_URL = re.compile(r"data:([^,;]*)((?:;[^,;]*)*),", re.IGNORECASE)
# What base64 clients sometimes wrap lines with (MIME's 76-character lines).
LINE_BREAKS = str.maketrans("", "", " \t\r\n")


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def image_from_data_url(url: str, *, policy: ImagePolicy | None = None) -> ImageInput:
    """The image a `data:image/...;base64,...` URL carries, checked; ImageError otherwise."""
    policy = policy or ImagePolicy.from_settings()
    match = DATA_URL.match(url)
    if match is None:
        raise ImageError(
            INVALID_DATA,
            "The image data URL is malformed: expected data:image/<type>;base64,<data>.",
        )
    media_type, parameters = match.group(1), match.group(2)
    media_type_check(media_type)
    if "base64" not in (p.strip().lower() for p in parameters.split(";")):
        raise ImageError(
            INVALID_DATA,
            "The image data URL must be base64-encoded (data:image/<type>;base64,...).",
        )
    return _decoded(url[match.end() :], media_type, policy)


def image_from_base64(
    data: str, *, media_type: str, policy: ImagePolicy | None = None
) -> ImageInput:
    """The image base64 `data` holds, declared as `media_type`, checked; ImageError otherwise."""
    policy = policy or ImagePolicy.from_settings()
    media_type_check(media_type)
    return _decoded(data, media_type, policy)


def _decoded(text: str, media_type: str, policy: ImagePolicy) -> ImageInput:
    text = text.translate(LINE_BREAKS)
    bytes_check(len(text) * 3 // 4 - text[-2:].count("="), policy)
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(INVALID_DATA, "The image data is not valid base64.") from None
    if not data:
        raise ImageError(INVALID_DATA, "The image data is empty.")
    return image_check(data, declared_type=media_type, policy=policy)
