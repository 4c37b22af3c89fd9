"""The one exception every refused image raises. Its message is written for the caller (the views
put it in a 400 in each API's shape); its `code` is stable, for clients and tests to tell the
reasons apart without reading sentences."""

FETCH_DISABLED = "image_fetch_disabled"
INVALID_URL = "invalid_image_url"
UNSUPPORTED_SCHEME = "unsupported_image_url_scheme"
INVALID_DATA = "invalid_image_data"
UNRESOLVABLE_HOST = "image_host_not_found"
BLOCKED_ADDRESS = "image_address_not_allowed"
TOO_MANY_REDIRECTS = "image_too_many_redirects"
FETCH_FAILED = "image_fetch_failed"
FETCH_TIMEOUT = "image_fetch_timeout"
NOT_AN_IMAGE_TYPE = "not_an_image_type"
TOO_LARGE = "image_too_large"
TOO_MANY_PIXELS = "image_too_many_pixels"
UNSUPPORTED_FORMAT = "unsupported_image_format"


class ImageError(ValueError):
    """An image input refused; `code` is one of this module's constants."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
