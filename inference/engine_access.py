"""Where the web side gets its EngineClient: the in-process worker by default."""

import atexit
import logging
import threading

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from engine.client import EngineClient

logger = logging.getLogger(__name__)
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
        atexit.register(_client.close, 10)
    return _client


def preload_models() -> None:
    """Start loading every enabled model at web-process start, without waiting: the server
    listens at once, and a request that arrives first waits for its model's load. A model that
    cannot load is logged and answers 503 on its requests."""
    from inference.models import ModelEntry
    from inference.services.registry import model_spec

    try:
        entries = list(ModelEntry.objects.filter(enabled=True))
    except Exception:
        logger.warning("model preload skipped: the database is not ready (run migrate)")
        return
    client = get_engine_client()
    for entry in entries:
        logger.info("loading model %s from %s", entry.name, entry.path)
        if entry.kind == ModelEntry.Kind.EMBEDDING:
            threading.Thread(
                target=_load_embedding, args=(client, entry.name, entry.path), daemon=True
            ).start()
        else:
            client.start_loading(model_spec(entry))


def _load_embedding(client, name: str, path: str) -> None:
    try:
        client.embedders.get(name, path)
    except Exception as exc:
        logger.error("embedding model %s could not be loaded: %s", name, exc)
