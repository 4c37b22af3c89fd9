"""The one way /v1 produces errors: OpenAI's body `{"error": {message, type, param, code}}`."""

from django.http import JsonResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """Raised anywhere under a /v1 view; rendered by `error_response`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ERROR_TYPES.get(status, "invalid_request_error")
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def error_response(error: APIError) -> JsonResponse:
    response = JsonResponse(error.body(), status=error.status)
    for name, value in error.headers.items():
        response[name] = value
    return response


# Anthropic's error types by status, for the /v1/messages routes.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
ANTHROPIC_PREFIX = "/v1/messages"


def anthropic_error_body(error: APIError) -> dict:
    kind = ANTHROPIC_ERROR_TYPES.get(error.status, "api_error")
    return {"type": "error", "error": {"type": kind, "message": error.message}}


def error_response_for(path: str, error: APIError) -> JsonResponse:
    """The error in the shape of the route's API: Anthropic's on /v1/messages, else OpenAI's."""
    if not path.startswith(ANTHROPIC_PREFIX):
        return error_response(error)
    response = JsonResponse(anthropic_error_body(error), status=error.status)
    for name, value in error.headers.items():
        response[name] = value
    return response


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model '{model}' does not exist or you do not have access to it.",
        param="model",
        code="model_not_found",
    )
