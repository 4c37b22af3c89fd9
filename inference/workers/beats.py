"""Worker heartbeats in Redis: what each worker serves, its load and its cache use.

A beat is a small JSON document under `{namespace}:worker:{id}` with a time to live, listed in
the set `{namespace}:workers`; the models' `ModelInfo` or `EmbeddingInfo` (larger, and fixed
while a spec serves) sit under `{namespace}:info:{id}:{model}`. Readers judge liveness by
their own clock: a worker whose beat number has not moved for the timeout is dead, whatever the
clocks of the machines say. Beats are state, not messages, so they live in plain keys rather
than on the channel layer (whose messages expire and can be dropped).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import redis
import redis.asyncio

from engine import (
    EmbeddingInfo,
    EngineStats,
    ModelCapacityError,
    ModelInfo,
    ModelSpec,
    ModelStatus,
)


@dataclass
class ModelBeat:
    """One model on one worker: `state` as ModelStatus has it (serving, loading, failed,
    stopped); `spec` the serving spec (else the loading one); `version` names the info key's
    content (changes when another spec starts serving)."""

    name: str
    state: str
    spec: dict[str, Any] | None = None
    loading: dict[str, Any] | None = None
    error: str | None = None
    failed_at: float | None = None
    failed_spec: dict[str, Any] | None = None
    stats: dict[str, Any] | None = None
    version: str = ""
    restarts: int = 0
    # Its place in the worker's memory budget (ModelStatus has the same).
    failure_code: str | None = None
    memory_bytes: int = 0
    last_used: float | None = None
    pinned: bool = False
    # Open choices per web process (reply channel): a web process subtracts its own from
    # `load` and adds what it has in flight now, so a burst it sends between beats is counted.
    by_reply: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of_status(cls, status: ModelStatus) -> ModelBeat:
        """What the worker's `status` says of the model, as it travels (specs as dicts)."""
        return cls(
            name=status.name,
            state=status.state,
            spec=status.serving.to_dict() if status.serving else None,
            loading=status.loading.to_dict() if status.loading else None,
            error=status.error,
            failed_at=status.failed_at,
            failed_spec=status.failed_spec.to_dict() if status.failed_spec else None,
            stats=status.stats.to_dict() if status.stats else None,
            restarts=status.restarts,
            failure_code=status.failure_code,
            memory_bytes=status.memory_bytes,
            last_used=status.last_used,
            pinned=status.pinned,
        )

    @property
    def load(self) -> int:
        stats = self.stats or {}
        return int(stats.get("num_waiting", 0)) + int(stats.get("num_running", 0))

    def tenant_load(self, tenant: str) -> int:
        """A fair-share tenant's requests waiting and rows running here (its last beat)."""
        counts = ((self.stats or {}).get("tenants") or {}).get(tenant) or {}
        return int(counts.get("waiting", 0)) + int(counts.get("running", 0))

    def engine_stats(self) -> EngineStats | None:
        if not self.stats:
            return None
        return EngineStats.from_dict(self.stats)

    def model_spec(self) -> ModelSpec | None:
        return ModelSpec.from_dict(self.spec) if self.spec else None


@dataclass
class WorkerBeat:
    worker_id: str
    host: str
    pid: int
    started_at: float  # Unix time, for people
    at: float = 0.0  # Unix time of this beat (a hint: liveness goes by `seq` moving)
    seq: int = 0
    run_id: str = ""  # this process's run (a restart under the same worker id is another)
    draining: bool = False
    # Request ids this worker holds, per web process (reply channel): a web process ends the
    # ones it waits for that the worker no longer has (their last events were lost).
    open_requests: dict[str, list[str]] = field(default_factory=dict)
    model_filter: list[str] | None = None  # --models, None: every enabled model
    models: dict[str, ModelBeat] = field(default_factory=dict)
    # The worker's memory budget (None: none) and the bytes its models hold in it.
    memory_max_bytes: int | None = None
    memory_used_bytes: int = 0

    def memory_free(self) -> float:
        if self.memory_max_bytes is None:
            return math.inf
        return self.memory_max_bytes - self.memory_used_bytes

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerBeat:
        data = json.loads(text)
        models = {name: ModelBeat(**beat) for name, beat in data.pop("models", {}).items()}
        return cls(**data, models=models)


class BeatStore:
    """Read and write beats (async for the worker and the web process's loop, sync for the
    admin's threads)."""

    def __init__(self, url: str, namespace: str):
        self.url = url
        self.namespace = namespace
        self._async: redis.asyncio.Redis | None = None
        self._sync: redis.Redis | None = None

    # Keys
    def _key(self, worker_id: str) -> str:
        return f"{self.namespace}:worker:{worker_id}"

    def _info_key(self, worker_id: str, model: str) -> str:
        return f"{self.namespace}:info:{worker_id}:{model}"

    @property
    def _set(self) -> str:
        return f"{self.namespace}:workers"

    def _aredis(self) -> redis.asyncio.Redis:
        if self._async is None:
            self._async = redis.asyncio.Redis.from_url(self.url, socket_timeout=5)
        return self._async

    def _redis(self) -> redis.Redis:
        if self._sync is None:
            self._sync = redis.Redis.from_url(self.url, socket_timeout=5)
        return self._sync

    # Writing (the worker)
    async def publish(self, beat: WorkerBeat, ttl_s: float) -> None:
        client = self._aredis()
        async with client.pipeline(transaction=False) as pipe:
            pipe.set(self._key(beat.worker_id), beat.to_json(), px=max(1, int(ttl_s * 1000)))
            pipe.sadd(self._set, beat.worker_id)
            await pipe.execute()

    async def publish_info(
        self,
        worker_id: str,
        version: str,
        spec: ModelSpec,
        info: ModelInfo | EmbeddingInfo,
        ttl_s: float,
    ) -> None:
        data = json.dumps({"version": version, "spec": spec.to_dict(), "info": info.to_dict()})
        await self._aredis().set(self._info_key(worker_id, spec.name), data, px=int(ttl_s * 1000))

    async def refresh_info(self, worker_id: str, models: list[str], ttl_s: float) -> None:
        if not models:
            return
        async with self._aredis().pipeline(transaction=False) as pipe:
            for name in models:
                pipe.pexpire(self._info_key(worker_id, name), int(ttl_s * 1000))
            await pipe.execute()

    async def remove(self, worker_id: str, models: list[str]) -> None:
        client = self._aredis()
        await client.delete(self._key(worker_id), *(self._info_key(worker_id, m) for m in models))
        await client.srem(self._set, worker_id)

    # Reading (web processes)
    async def read_all(self) -> list[WorkerBeat]:
        client = self._aredis()
        ids = sorted(i.decode() for i in await client.smembers(self._set))
        if not ids:
            return []
        values = await client.mget([self._key(i) for i in ids])
        return await self._parse(ids, values, client.srem)

    def read_all_sync(self) -> list[WorkerBeat]:
        client = self._redis()
        ids = sorted(i.decode() for i in client.smembers(self._set))
        if not ids:
            return []
        values = client.mget([self._key(i) for i in ids])
        gone = [i for i, v in zip(ids, values, strict=True) if v is None]
        if gone:
            client.srem(self._set, *gone)
        return [WorkerBeat.from_json(v) for v in values if v is not None]

    async def _parse(self, ids, values, srem) -> list[WorkerBeat]:
        gone = [i for i, v in zip(ids, values, strict=True) if v is None]
        if gone:
            await srem(self._set, *gone)  # expired beats: those workers are gone
        return [WorkerBeat.from_json(v) for v in values if v is not None]

    async def read_info(
        self, worker_id: str, model: str
    ) -> tuple[str, ModelInfo | EmbeddingInfo] | None:
        raw = await self._aredis().get(self._info_key(worker_id, model))
        if raw is None:
            return None
        data = json.loads(raw)
        kind = EmbeddingInfo if data["spec"]["kind"] == "embedding" else ModelInfo
        return data["version"], kind.from_dict(data["info"])

    async def aclose(self) -> None:
        if self._async is not None:
            await self._async.aclose()
            self._async = None

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()
            self._sync = None


def sum_stats(name: str, beats: list[ModelBeat]) -> EngineStats | None:
    """One model's stats summed over the workers serving it."""
    stats = [s for b in beats if (s := b.engine_stats()) is not None]
    if not stats:
        return None
    total = {
        f.name: sum(getattr(s, f.name) for s in stats)
        for f in dataclasses.fields(EngineStats)
        if f.name not in ("model", "prefix_cache", "step_time_ms", "tenants")
    }
    cache: dict[str, int] = {}
    tenants: dict[str, dict[str, int]] = {}
    for s in stats:
        for key, value in s.prefix_cache.items():
            cache[key] = cache.get(key, 0) + value
        for tenant, counts in s.tenants.items():
            summed = tenants.setdefault(tenant, {})
            for key, value in counts.items():
                summed[key] = summed.get(key, 0) + value
    step = max(s.step_time_ms for s in stats)
    return EngineStats(model=name, **total, step_time_ms=step, prefix_cache=cache, tenants=tenants)


def model_status(name: str, workers: list[WorkerBeat]) -> ModelStatus:
    """Where a model stands over the live workers' beats (ModelStatus's states, plus
    "draining" when only draining workers serve it), its stats summed over those serving."""
    beats = [(w, b) for w in workers if (b := w.models.get(name)) is not None]
    serving = [b for w, b in beats if b.state == "serving" and not w.draining]
    loading = [b for _, b in beats if b.loading]
    failed = [b for _, b in beats if b.error]
    draining = [b for w, b in beats if b.state == "serving" and w.draining]
    unloaded = [b for _, b in beats if b.state == "not_loaded"]
    if serving:
        state = "serving"
    elif draining:
        state = "draining"
    elif loading:
        state = "loading"
    elif failed and not all(b.failure_code == ModelCapacityError.code for b in failed):
        state = "failed"
    elif unloaded or not beats:
        state = "not_loaded"  # offered by workers that load it on its first request
    else:
        state = "stopped"
    return ModelStatus(
        name=name,
        state=state,
        serving=serving[0].model_spec() if serving else None,
        loading=ModelSpec.from_dict(loading[0].loading) if loading else None,
        error=failed[0].error if failed else None,
        failed_at=failed[0].failed_at if failed else None,
        failed_spec=ModelSpec.from_dict(failed[0].failed_spec)
        if failed and failed[0].failed_spec
        else None,
        failure_code=failed[0].failure_code if failed else None,
        stats=sum_stats(name, [b for b in serving]),
        restarts=sum(b.restarts for _, b in beats),
        memory_bytes=sum(b.memory_bytes for _, b in beats),
        last_used=max((b.last_used for _, b in beats if b.last_used), default=None),
        pinned=any(b.pinned for _, b in beats),
    )
