"""The engine workers as a web process sees them, from their beats (beats.py).

Liveness goes by the web process's own clock: a worker whose beat has not moved for `timeout_s`
is lost (it leaves routing; the client ends what it held there). Routing: a request goes to a
live, non-draining worker serving its model, the one with the least load (its last beat's queue
and running work from other web processes, plus what this process has there now), unless its
prompt continues one that ran on another worker that is not much busier (prefix affinity: that
worker's prefix cache holds the conversation so far); preferring workers on the registry's
current spec. Placement: the workers read the registry themselves; a web process waiting for a
model nudges them and refuses the request when no worker shows the model after a grace.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from engine import (
    EmbeddingInfo,
    ModelCapacityError,
    ModelInfo,
    ModelLoadError,
    ModelNotLoadedError,
    ModelSpec,
    ModelUnavailableError,
)
from inference.workers.beats import BeatStore, WorkerBeat
from inference.workers.ordering import PrefixAffinity

# A web process asks the workers to re-read the registry at most this often per model.
NUDGE_EVERY_S = 5.0
# A remembered worker (prefix affinity) is kept while it has at most this many more requests
# than the least loaded.
AFFINITY_SLACK = 2
# After asking the workers to look at the registry, how long a model nobody serves may take to
# show up as loading somewhere before the request is refused.
PLACEMENT_GRACE_S = 3.0
CAPACITY = ModelCapacityError.code
# Clocks of the web and worker hosts may differ by this much (a load failure's time is the
# worker's, the request to load the web process's).
CLOCK_SLACK_S = 2.0


@dataclass
class Worker:
    beat: WorkerBeat
    seen_seq: int
    seen_at: float  # time.monotonic() when its beat number last moved
    confirmed: bool  # its beat is fresh (seen moving, or recent by the wall clock)


class Fleet:
    """The live workers by id, their models' info, and where work for a model goes.
    `nudge_workers` asks every worker to re-read the registry now."""

    def __init__(
        self,
        store: BeatStore,
        *,
        nudge_workers: Callable[[], Awaitable[None]],
        load_on: Callable[[str, ModelSpec], Awaitable[None]] | None = None,
        heartbeat_s: float,
        timeout_s: float,
        refresh_s: float,
        load_wait_s: float,
    ):
        self.store = store
        self.nudge_workers = nudge_workers
        self.load_on = load_on  # asks one worker to load a model it offers
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.refresh_s = refresh_s
        self.load_wait_s = load_wait_s
        self.workers: dict[str, Worker] = {}
        self.snapshot: tuple[float, list[WorkerBeat]] = (0.0, [])  # for other threads
        self.wanted: dict[str, ModelSpec] = {}  # the registry's spec per name, as last asked
        self.affinity = PrefixAffinity()
        self._infos: dict[tuple[str, str], tuple[str, ModelInfo | EmbeddingInfo]] = {}
        self._nudged: dict[str, float] = {}

    # Beats
    def update(self, beats: list[WorkerBeat], now: float) -> list[Worker]:
        """Take the workers' latest beats; return the workers lost since the last (beat gone or
        stalled, or restarted under the same id: their requests died), now out of routing."""
        wall = time.time()
        lost, seen = [], set()
        for beat in beats:
            seen.add(beat.worker_id)
            known = self.workers.get(beat.worker_id)
            if known is not None and known.beat.run_id != beat.run_id:
                lost.append(self._forget(beat.worker_id))
                known = None
            if known is None:
                fresh = abs(wall - beat.at) < self.timeout_s
                self.workers[beat.worker_id] = Worker(beat, beat.seq, now, confirmed=fresh)
            elif beat.seq != known.seen_seq:
                known.beat, known.seen_seq, known.seen_at, known.confirmed = (
                    beat,
                    beat.seq,
                    now,
                    True,
                )
        for worker_id, known in list(self.workers.items()):
            if worker_id not in seen or now - known.seen_at > self.timeout_s:
                lost.append(self._forget(worker_id))
        self.snapshot = (now, [w.beat for w in self.workers.values() if w.confirmed])
        return lost

    def _forget(self, worker_id: str) -> Worker:
        for key in [k for k in self._infos if k[0] == worker_id]:
            del self._infos[key]
        return self.workers.pop(worker_id)

    def beats(self) -> list[WorkerBeat]:
        """The live workers' last beats (any thread)."""
        at, beats = self.snapshot
        if time.monotonic() - at < 2 * self.refresh_s + 1:
            return list(beats)
        wall = time.time()
        return [b for b in self.store.read_all_sync() if abs(wall - b.at) < self.timeout_s]

    def live(self) -> list[Worker]:
        return [w for w in self.workers.values() if w.confirmed]

    def serving(self, model: str) -> list[Worker]:
        return [
            w
            for w in self.live()
            if not w.beat.draining
            and (beat := w.beat.models.get(model)) is not None
            and beat.state == "serving"
        ]

    # Routing
    def route(
        self,
        model: str,
        exclude: set[str],
        prompt: tuple[int, ...],
        *,
        reply: str | None,
        in_flight: Callable[[str, str], int],
        scope: str = "",
        tenant: str | None = None,
    ) -> Worker | None:
        """The worker for new work on `model` (None: no worker serves it); `in_flight` counts
        what this process (reply channel `reply`) has on a worker for a model now; `prompt` and
        its cache `scope` find the worker whose prefix cache may hold it. With the request's
        fair-share `tenant` (engine/core/fairness.py), the tenant's own work on a worker
        counts twice: each worker's scheduler serves the tenants holding least first, so a
        team's request waits mostly behind its own team's work there."""
        candidates = [w for w in self.serving(model) if w.beat.worker_id not in exclude]
        wanted = self.wanted.get(model)
        if wanted is not None:
            matching = [w for w in candidates if w.beat.models[model].spec == wanted.to_dict()]
            candidates = matching or candidates
        if not candidates:
            return None

        def load(worker: Worker) -> tuple[int, float]:
            beat = worker.beat.models[model]
            others = max(0, beat.load - beat.by_reply.get(reply, 0))
            own = beat.tenant_load(tenant) if tenant is not None else 0
            return others + own + in_flight(worker.beat.worker_id, model), random.random()

        loads = {w.beat.worker_id: load(w) for w in candidates}
        best = min(candidates, key=lambda w: loads[w.beat.worker_id])
        # A prompt that continues one this process sent goes where that one ran (its prefix
        # cache holds it), unless that worker is busier than the least loaded by more than
        # AFFINITY_SLACK requests.
        by_id = {w.beat.worker_id: w for w in candidates}
        worker_id = self.affinity.lookup(model, prompt, scope)
        if (
            worker_id in by_id
            and loads[worker_id][0] <= loads[best.beat.worker_id][0] + AFFINITY_SLACK
        ):
            return by_id[worker_id]
        return best

    async def any_serving(self, model: str) -> tuple[Worker, ModelInfo]:
        """A worker serving `model` (on the registry's spec where one is) and its info."""
        workers = self.serving(model)
        wanted = self.wanted.get(model)
        if wanted is not None:
            workers.sort(key=lambda w: w.beat.models[model].spec != wanted.to_dict())
        for worker in workers:
            info = await self.info(worker, model)
            if info is not None:
                return worker, info
        raise ModelNotLoadedError(f"The model {model!r} is not loaded.")

    async def info(self, worker: Worker, model: str) -> ModelInfo | EmbeddingInfo | None:
        version = worker.beat.models[model].version
        key = (worker.beat.worker_id, model)
        cached = self._infos.get(key)
        if cached is not None and cached[0] == version:
            return cached[1]
        found = await self.store.read_info(worker.beat.worker_id, model)
        if found is None or found[0] != version:
            return None
        self._infos[key] = found
        return found[1]

    # Placement
    async def wait_for(self, spec: ModelSpec, *, exact: bool) -> ModelInfo | EmbeddingInfo:
        """The info of a worker serving `spec` (with `exact`, that very spec; else any of its
        kind under the name), once one does."""
        deadline = time.monotonic() + self.load_wait_s
        nudged_at: float | None = None
        # Since when no live worker has listed the model as loading: a worker that is out of
        # routing for a moment (its beats late while it loads a tokenizer, say) restarts the
        # clock when it comes back, so two short gaps do not add up to a refusal.
        absent_since: float | None = None
        wanted = spec.to_dict()
        asked: dict[str, float] = {}  # worker id -> when it was asked to load the model
        while True:
            serving = [
                w
                for w in self.serving(spec.name)
                if w.beat.models[spec.name].spec["kind"] == spec.kind
            ]
            matching = [w for w in serving if w.beat.models[spec.name].spec == wanted]
            if serving and not matching and nudged_at is None:
                await self.nudge(spec.name)  # the workers load the new spec beside the old
                nudged_at = time.monotonic()
            group = matching if exact else (matching or serving)
            infos = [info for w in group if (info := await self.info(w, spec.name)) is not None]
            if infos:
                # The tightest memory budget; an embedding model's info has none.
                return min(infos, key=lambda i: getattr(i, "max_request_tokens", None) or math.inf)
            beats = [b for w in self.live() if (b := w.beat.models.get(spec.name)) is not None]
            if any(b.state == "loading" for b in beats) or serving:
                absent_since = None
            elif await self._load_on_offering(spec, asked):
                absent_since = None  # a worker that offers it was asked to load it
            else:
                failed = [b for b in beats if b.error and b.failure_code != CAPACITY]
                if failed:
                    raise ModelLoadError(failed[0].error)
                full = [b for b in beats if b.failure_code == CAPACITY]
                if full:
                    raise ModelCapacityError(full[0].error or "No room for the model.")
                now = time.monotonic()
                if absent_since is None:
                    absent_since = now
                if nudged_at is None:
                    await self.nudge(spec.name)
                    nudged_at = now
                grace = max(PLACEMENT_GRACE_S, 3 * self.heartbeat_s)
                if now - max(absent_since, nudged_at) > grace:
                    raise ModelUnavailableError(
                        f"No engine worker serves the model '{spec.name}' now; an administrator "
                        "must start one (`manage.py runengine`)."
                    )
            if time.monotonic() > deadline:
                raise ModelLoadError(f"The model {spec.name!r} is still loading.")
            await asyncio.sleep(self.refresh_s / 2)

    async def _load_on_offering(self, spec: ModelSpec, asked: dict[str, float]) -> bool:
        """Ask the worker with the most free memory among those that offer `spec` without
        having it loaded (the registry enables it for them; it did not fit at their start, or
        idled out) to load it; True while such a worker is asked or still to be asked. One that
        answers with no room is passed over for the next."""
        if self.load_on is None:
            return False
        offering = []
        for worker in self.live():
            beat = worker.beat.models.get(spec.name)
            if worker.beat.draining or beat is None or beat.state != "not_loaded":
                continue
            at = asked.get(worker.beat.worker_id)
            if at is None:
                offering.append(worker)
                continue
            refused = beat.failure_code == CAPACITY and (beat.failed_at or 0) >= at - CLOCK_SLACK_S
            if not refused:
                return True  # asked, and no answer yet
        if not offering:
            return False
        best = max(offering, key=lambda w: w.beat.memory_free())
        asked[best.beat.worker_id] = time.time()
        await self.load_on(best.beat.worker_id, spec)
        return True

    async def nudge(self, model: str = "") -> None:
        now = time.monotonic()
        if now - self._nudged.get(model, -math.inf) < NUDGE_EVERY_S:
            return
        self._nudged[model] = now
        await self.nudge_workers()
