"""Where the web side gets its EngineClient: the in-process worker by default."""

import atexit

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from engine.client import EngineClient

_client: EngineClient | None = None


def get_engine_client() -> EngineClient:
    global _client
    if _client is None:
        if settings.ORCHARD_ENGINE != "local":
            raise ImproperlyConfigured(
                f"ORCHARD_ENGINE={settings.ORCHARD_ENGINE!r} is not supported yet; use 'local'."
            )
        from engine.local import LocalEngineClient

        _client = LocalEngineClient()
        # Stop with the web process: abort what is in flight and join the engine threads, so no
        # thread is killed in the middle of an MLX call.
        atexit.register(_client.worker.shutdown, 10)
    return _client
