"""The errors the engine reports to its callers (each with the `code` the API answers with)."""


def describe(exc: BaseException) -> str:
    """An exception as one line for a request's error or a log: its type and message."""
    return f"{type(exc).__name__}: {exc}"


class EngineError(Exception):
    """Base class for errors the engine reports to its callers."""

    code = "engine_error"


class InvalidRequestError(EngineError, ValueError):
    """User input the engine cannot accept; `param` names the offending request field and
    `code` is set only where OpenAI has a specific one (e.g. context_length_exceeded)."""

    code = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        if code:
            self.code = code


class EngineOverloadedError(EngineError):
    """The model's waiting queue is full; the API answers 503."""

    code = "engine_overloaded"


class ModelNotLoadedError(EngineError):
    code = "model_not_loaded"


class ModelUnavailableError(EngineError):
    """No engine serves the model now (no engine worker has it); the API answers 503 with
    this message, which names no path or host."""

    code = "model_unavailable"


class ModelCapacityError(ModelUnavailableError):
    """The model is not loaded and the memory budget has no room for it, even after unloading
    every idle model that is not pinned; the API answers 503 with Retry-After."""

    code = "model_capacity_exceeded"

    def __init__(self, message: str, *, retry_after_s: int = 10):
        super().__init__(message)
        self.retry_after_s = retry_after_s


class ModelLoadError(EngineError):
    """The model could not be loaded (the message says why); the API answers 503."""

    code = "model_load_failed"


class EmbeddingLoadError(ModelLoadError):
    """An embedding model could not be loaded (the message says why)."""
