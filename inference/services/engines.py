"""Where the web side gets its EngineClient (the in-process worker by default, or the remote
client of `runengine` workers), and how the engines follow the registry."""

import atexit
import logging
from collections.abc import Callable

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from engine import EngineClient, ModelSpec

logger = logging.getLogger(__name__)
_client: EngineClient | None = None
# Called at process exit once the engines have stopped (`after_engines_stop`), and before they
# stop (`before_engines_stop`).
_after_stop: list[Callable[[], None]] = []
_before_stop: list[Callable[[], None]] = []


def after_engines_stop(callback: Callable[[], None]) -> None:
    """Run `callback` at process exit, after the engine client has stopped (its threads
    joined): e.g. finishing the usage rows of requests the shutdown cut off."""
    _after_stop.append(callback)


def before_engines_stop(callback: Callable[[], None]) -> None:
    """Run `callback` at process exit, before the engine client stops: e.g. stopping the batch
    runner, whose lines would otherwise fail as the engines go away. (A process that never made
    its engine client runs it at exit all the same.)"""
    if not _before_stop:
        atexit.register(_stopping)
    _before_stop.append(callback)


def _stopping() -> None:
    while _before_stop:
        callback = _before_stop.pop()
        try:
            callback()
        except Exception:
            logger.exception("a before-stop callback failed")


def get_engine_client() -> EngineClient:
    global _client
    if _client is None:
        if settings.ORCHARD_ENGINE == "remote":
            _client = remote_client()
        elif settings.ORCHARD_ENGINE == "local":
            from engine import LocalEngineClient

            _client = LocalEngineClient(engine_worker(), render=tokenizer_pool())
        else:
            raise ImproperlyConfigured(f"Unknown ORCHARD_ENGINE {settings.ORCHARD_ENGINE!r}.")
        # Stop with the web process: abort what is in flight and join the engine threads, so no
        # thread is killed in the middle of an MLX call; then run the after-stop callbacks
        # (atexit runs the last registered first).
        atexit.register(_stopped)
        atexit.register(_client.close, 10)
        atexit.register(_stopping)  # registered last: runs first
    return _client


def tokenizer_pool():
    """The size of a pool of tokenizer processes (renders, tokenizing, preflight checks)."""
    from engine import PoolSize

    return PoolSize(
        processes=settings.ORCHARD_PREPARE_WORKERS,
        tokenizers=settings.ORCHARD_TOKENIZERS_PER_PROCESS,
        idle_s=settings.ORCHARD_TOKENIZER_IDLE_SECONDS,
    )


def engine_worker():
    """An EngineWorker with the settings' memory budget, idle time and prefix-cache disk tier
    (the in-process engine and each `runengine` worker have one)."""
    from engine import EngineWorker, PrefixDiskConfig, host_memory

    disk = settings.ORCHARD_PREFIX_DISK_BYTES
    return EngineWorker(
        memory=host_memory(
            share=settings.ORCHARD_MEMORY_BUDGET_SHARE,
            max_bytes=settings.ORCHARD_MEMORY_BUDGET_BYTES,
            cache_share=settings.ORCHARD_MODEL_CACHE_SHARE,
        ),
        idle_unload_s=settings.ORCHARD_MODEL_IDLE_SECONDS,
        prefix_disk=PrefixDiskConfig(settings.ORCHARD_PREFIX_DISK_DIR, disk) if disk else None,
    )


def _stopped() -> None:
    for callback in _after_stop:
        try:
            callback()
        except Exception:
            logger.exception("an after-stop callback failed")


def remote_client() -> EngineClient:
    from inference.workers.beats import BeatStore
    from inference.workers.client import RemoteEngineClient

    return RemoteEngineClient(
        store=BeatStore(settings.REDIS_URL, settings.ORCHARD_WORKER_NAMESPACE),
        namespace=settings.ORCHARD_WORKER_NAMESPACE,
        heartbeat_s=settings.ORCHARD_WORKER_HEARTBEAT_SECONDS,
        timeout_s=settings.ORCHARD_WORKER_TIMEOUT_SECONDS,
        load_wait_s=settings.ORCHARD_MODEL_LOAD_WAIT_SECONDS,
        render=tokenizer_pool(),
    )


def enabled_specs() -> list[ModelSpec]:
    """The registry's enabled models, chat and embedding, as engine specs."""
    from inference.models import ModelEntry
    from inference.services.registry import model_spec

    # Pinned models first, then the default: at start they load first while there is room.
    entries = (
        ModelEntry.objects.filter(enabled=True)
        .select_related("draft_model")
        .order_by("-pinned", "-is_default", "name")
    )
    return [model_spec(entry) for entry in entries]


def registered_names() -> list[str]:
    """The enabled models' names (what /metrics reports the state of)."""
    from inference.models import ModelEntry

    return list(ModelEntry.objects.filter(enabled=True).values_list("name", flat=True))


def registry_changed() -> None:
    """After an admin change to the registry: the engines follow it (new and changed models
    load beside what serves, disabled ones stop once their requests finish), without a
    restart and without making any request wait. In-process engines that never started
    (a management command, a process that served nothing yet) have nothing to follow: they
    read the registry when they start."""
    if _client is None and settings.ORCHARD_ENGINE == "local":
        return
    try:
        specs = enabled_specs()
        get_engine_client().place_models(specs, load_new=settings.ORCHARD_PRELOAD_MODELS)
    except Exception:
        logger.exception("the engines could not follow the registry change")


def preload_models() -> None:
    """Start loading the enabled models that fit in the memory budget at web-process start
    (pinned ones first, then the default), without waiting: the server listens at once, and a
    request that arrives first waits for its model's load; the others load on their first
    request. A model that cannot load is logged and answers 503 on its requests. Remote workers
    place the registry's models themselves."""
    if settings.ORCHARD_ENGINE == "remote":
        return
    try:
        specs = enabled_specs()
    except Exception:
        logger.warning("model preload skipped: the database is not ready (run migrate)")
        return
    get_engine_client().place_models(specs, load_new=True)
