"""Images sent inside requests (data URLs, Anthropic's base64 blocks) and the checks every image
passes (inference/images/formats.py): the real format from the bytes, the declared type only as
far as "image", sizes in bytes and pixels, decompression bombs refused from their header."""

import base64
import hashlib
import time

import pytest

from inference.images import ImageError, ImagePolicy, image_from_base64, image_from_data_url
from inference.images import errors as codes
from tests.inference.images.server import (
    BOMB,
    JPEG,
    PNG,
    jpeg_declaring,
    picture,
    png_declaring,
)

POLICY = ImagePolicy()


def encoded(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{encoded(data)}"


def refusal(call, *args, **kwargs) -> ImageError:
    with pytest.raises(ImageError) as caught:
        call(*args, **kwargs)
    return caught.value


@pytest.mark.parametrize(
    ("image_format", "media_type"),
    [("PNG", "image/png"), ("JPEG", "image/jpeg"), ("GIF", "image/gif"), ("WEBP", "image/webp")],
)
def test_each_accepted_format_arrives_as_sent(image_format, media_type):
    data = picture(image_format, 40, 30)
    image = image_from_data_url(data_url(data, media_type), policy=POLICY)
    assert (image.data, image.format, image.media_type) == (data, image_format, media_type)
    assert (image.width, image.height) == (40, 30)
    assert image.sha256 == hashlib.sha256(data).hexdigest()
    assert "data=" not in repr(image)  # megabytes of it would fill a log line


def test_the_bytes_decide_the_format_whatever_image_type_is_declared():
    image = image_from_base64(encoded(JPEG), media_type="image/png", policy=POLICY)
    assert (image.format, image.media_type) == ("JPEG", "image/jpeg")
    image = image_from_data_url(data_url(PNG, "image/webp"), policy=POLICY)
    assert image.media_type == "image/png"


def test_data_url_spellings_clients_send():
    assert image_from_data_url(f"DATA:image/png;BASE64,{encoded(PNG)}", policy=POLICY).data == PNG
    with_name = f"data:image/png;name=red.png;base64,{encoded(PNG)}"
    assert image_from_data_url(with_name, policy=POLICY).data == PNG
    text = encoded(PNG)
    wrapped = "\r\n".join(text[i : i + 76] for i in range(0, len(text), 76))  # MIME lines
    assert image_from_base64(wrapped, media_type="image/png", policy=POLICY).data == PNG


@pytest.mark.parametrize(
    ("url", "code"),
    [
        (f"data:text/plain;base64,{encoded(PNG)}", codes.NOT_AN_IMAGE_TYPE),
        (f"data:;base64,{encoded(PNG)}", codes.NOT_AN_IMAGE_TYPE),
        ("data:image/svg+xml,<svg xmlns='http://www.w3.org/2000/svg'/>", codes.INVALID_DATA),
        (f"data:image/png;base64{encoded(PNG)}", codes.INVALID_DATA),
        ("data:image/png;base64,iVBORw0K!!!", codes.INVALID_DATA),
        ("data:image/png;base64,iVBORw0KGgo", codes.INVALID_DATA),  # bad padding
        ("data:image/png;base64,", codes.INVALID_DATA),
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", codes.UNSUPPORTED_FORMAT),  # "hello world"
        (data_url(picture("BMP")), codes.UNSUPPORTED_FORMAT),
        (data_url(picture("TIFF")), codes.UNSUPPORTED_FORMAT),
        (data_url(PNG[:40]), codes.UNSUPPORTED_FORMAT),  # cut off inside its header
    ],
)
def test_what_a_data_url_may_not_be(url, code):
    assert refusal(image_from_data_url, url, policy=POLICY).code == code


def test_a_base64_block_must_declare_an_image_type():
    error = refusal(image_from_base64, encoded(PNG), media_type="application/pdf", policy=POLICY)
    assert error.code == codes.NOT_AN_IMAGE_TYPE
    assert "application/pdf" in error.message


def test_an_oversize_image_is_refused_before_it_is_decoded():
    policy = ImagePolicy(max_bytes=1000)
    # Not even valid base64: had it been decoded first, the refusal would say so instead.
    error = refusal(image_from_base64, "!" * 1400, media_type="image/png", policy=policy)
    assert error.code == codes.TOO_LARGE
    exact = ImagePolicy(max_bytes=len(PNG))
    assert image_from_data_url(data_url(PNG), policy=exact).data == PNG
    under = ImagePolicy(max_bytes=len(PNG) - 1)
    assert refusal(image_from_data_url, data_url(PNG), policy=under).code == codes.TOO_LARGE


@pytest.mark.parametrize(
    ("data", "shown"),
    [
        (png_declaring(7000, 7000), "7000×7000"),  # past the 40 MP default, under Pillow's own
        (jpeg_declaring(65000, 65000), None),  # past Pillow's own guard too
        (BOMB, None),
    ],
)
def test_a_decompression_bomb_is_refused_from_its_header(data, shown):
    started = time.monotonic()
    error = refusal(image_from_data_url, data_url(data), policy=POLICY)
    assert error.code == codes.TOO_MANY_PIXELS
    assert time.monotonic() - started < 1.0
    assert len(data) < 1000
    if shown:
        assert shown in error.message


def test_the_pixel_limit_is_inclusive():
    assert image_from_data_url(data_url(PNG), policy=ImagePolicy(max_pixels=64 * 48)).width == 64
    error = refusal(image_from_data_url, data_url(PNG), policy=ImagePolicy(max_pixels=64 * 48 - 1))
    assert error.code == codes.TOO_MANY_PIXELS
    assert "64×48" in error.message
