"""Where the web side gets its EngineClient: the in-process worker by default."""

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
    return _client
