"""Readiness for a load balancer or an orchestrator (GET /readyz): can this web process serve?

Cheap, and never loads a model: one registry query (which also proves the database and its
schema), a Redis PING when REDIS_URL is set, and what the engine already knows of its models
(local) or its workers' last heartbeats (remote). Only the default model counts: another one
whose load failed is left out of /v1/models, and taking every web process out of rotation for
it would stop the models that work; one registered while the process runs loads on its first
request, which a process kept out of rotation would never get."""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field

import redis
from asgiref.sync import sync_to_async
from django.conf import settings

from inference.models import ModelEntry
from inference.services.engines import get_engine_client

CHECK_TIMEOUT_S = 2.0
OK = "ok"
STATE_WORDS = {
    "loading": "still loading",
    "failed": "its load failed",
    "stopped": "its engine died",
}


@dataclass(frozen=True)
class Readiness:
    """Each check's result: OK or why it failed (a sentence naming no host, path or secret)."""

    checks: dict[str, str] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return all(result == OK for result in self.checks.values())


async def readiness() -> Readiness:
    checks = {}
    models: list[tuple[str, bool]] | None = None
    try:
        models = await _within(sync_to_async(_enabled_models)())
        checks["database"] = OK
    except Exception as exc:
        checks["database"] = f"unreachable ({type(exc).__name__})"
    if settings.REDIS_URL:
        try:
            await _within(sync_to_async(_ping_redis, thread_sensitive=False)())
            checks["redis"] = OK
        except Exception as exc:
            checks["redis"] = f"unreachable ({type(exc).__name__})"
    if settings.ORCHARD_ENGINE == "remote":
        checks["engine"] = await _remote_workers()
    else:
        checks["engine"] = _local_models(models)
    return Readiness(checks)


async def _within(awaitable):
    return await asyncio.wait_for(awaitable, CHECK_TIMEOUT_S)


def _enabled_models() -> list[tuple[str, bool]]:
    return list(ModelEntry.objects.filter(enabled=True).values_list("name", "is_default"))


@functools.cache
def _redis_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(
        url, socket_timeout=CHECK_TIMEOUT_S, socket_connect_timeout=CHECK_TIMEOUT_S
    )


def _ping_redis() -> None:
    _redis_client(settings.REDIS_URL).ping()


def _local_models(models: list[tuple[str, bool]] | None) -> str:
    """This process's engine: its default model serves, or has not been asked to load (it
    loads on its first request). While it loads (at start) the process is not ready, nor when
    its load failed or its engine died."""
    if models is None:
        return "unknown (the registry could not be read)"
    default = next((name for name, is_default in models if is_default), None)
    if default is None:
        return OK
    state = get_engine_client().model_status(default).state
    if state in ("serving", "not_loaded"):
        return OK
    return f"the default model is not serving ({STATE_WORDS.get(state, state)})"


async def _remote_workers() -> str:
    """At least one engine worker beats and is not draining."""
    client = get_engine_client()
    try:
        beats = await _within(sync_to_async(client.workers, thread_sensitive=False)())
    except Exception as exc:
        return f"the workers' heartbeats could not be read ({type(exc).__name__})"
    if not any(not beat.draining for beat in beats):
        return "no live engine worker"
    return OK
