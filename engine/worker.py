"""EngineWorker: owns the loaded models, one engine thread per model.

Thread-safe and synchronous; engine/local.py adapts it to asyncio, and a `runengine` process
serves one to the web processes. A model is loaded on its own engine thread, so that thread is
the only one that ever touches the model's MLX arrays. A chat model (`ModelSpec.kind` "chat") is
served by an EngineLoop, an embedding model by an EmbeddingEngine (engine/core/embedding.py):
both follow one lifecycle (start, ready, drain, stop, ended), so loading, replacing, retiring,
restarting and `status` are the same for both. All of them share one memory budget
(engine/cache/host.py): the residency policy (engine/residency.py) decides which idle models make
room for a load, and which unload after their idle time.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable

from engine.cache.disk import PrefixDiskConfig
from engine.cache.host import HostMemory
from engine.core.batched import BatchedEngine
from engine.core.embedding import EmbeddingEngine, EmbeddingJob
from engine.core.loop import EngineLoop
from engine.core.request import Emit
from engine.core.simple import SimpleEngine
from engine.core.turns import ComputeTurns
from engine.futures import mirror, resolved, start_after
from engine.models.embeddings import EmbeddingModel
from engine.models.loader import LoadedModel, load_model
from engine.protocol import (
    EmbeddingInfo,
    EngineStats,
    GenerationRequest,
    ModelCapacityError,
    ModelInfo,
    ModelLoadError,
    ModelNotLoadedError,
    ModelSpec,
    ModelStatus,
    describe,
)
from engine.residency import Residency, wait_for_room
from engine.supervision import LOAD_RETRY_AFTER_S, LoadFailure, Restarts

logger = logging.getLogger(__name__)

ENGINES: dict[str, type[EngineLoop]] = {"batched": BatchedEngine, "simple": SimpleEngine}

Loader = Callable[[ModelSpec], LoadedModel]
EmbeddingLoader = Callable[[ModelSpec], EmbeddingModel]
Engine = EngineLoop | EmbeddingEngine
Info = ModelInfo | EmbeddingInfo


def load_spec(spec: ModelSpec) -> LoadedModel:
    return load_model(spec.path, name=spec.name, context_length=spec.context_length)


def load_embedding_spec(spec: ModelSpec) -> EmbeddingModel:
    return EmbeddingModel(spec.path, name=spec.name)


class EngineWorker:
    """Serve models by name. `loader` turns a chat spec into a LoadedModel, `embedding_loader`
    an embedding spec into an EmbeddingModel (tests pass prebuilt ones).

    A changed spec for a served name loads beside the old engine, which keeps serving until the
    new one is ready; then the new one takes the name and the old one drains (finishes what it
    has in flight, refusing new work) and stops. A spec that fails to load never replaces a
    working engine: the old one keeps serving and the failure is kept for `status`. Nothing here
    waits for an engine thread except `unload` and `shutdown`, so the event loop can call
    `load`, `serve`, `get`, `submit`, `embed` and `abort`.
    """

    def __init__(
        self,
        *,
        loader: Loader = load_spec,
        embedding_loader: EmbeddingLoader = load_embedding_spec,
        engines: dict[str, type[EngineLoop]] | None = None,
        memory: HostMemory | None = None,
        idle_unload_s: float = 0.0,
        prefix_disk: PrefixDiskConfig | None = None,
    ):
        # One memory budget for every model (none by default: each sizes its own caches), and
        # the default idle time after which a model not pinned unloads (0: never).
        self.memory = memory or HostMemory()
        self.residency = Residency(self.memory, idle_unload_s)
        self.prefix_disk = prefix_disk  # the chat models' prefix caches' disk tier (None: off)
        self.compute_turns = ComputeTurns()  # its engines compute one step at a time
        self._loader = loader
        self._embedding_loader = embedding_loader
        self._engine_classes = engines or ENGINES
        self._engines: dict[str, Engine] = {}  # serving (or dead after serving) per name
        self._loading: dict[str, tuple[Engine, concurrent.futures.Future[Info]]] = {}
        self._failures: dict[str, LoadFailure] = {}  # the last failed load per name
        self._retired: list[Engine] = []  # replaced engines, possibly still draining
        self._restarts = Restarts()
        self._closed = False
        self._lock = threading.Lock()

    def load(self, spec: ModelSpec, *, force: bool = False) -> concurrent.futures.Future[Info]:
        """Start serving `spec` (replacing another spec of that name); resolves once it serves,
        or with the load's exception. Retries a failed spec at once; with `force`, loads a fresh
        engine even when `spec` already serves (its files changed on disk, say)."""
        with self._lock:
            self._remember(spec)
            self.residency.hold(spec.name)  # for whoever asked: a request on its way
            return self._room_wait(spec, mirror(self._load_locked(spec, force=force)))

    def preload(self, spec: ModelSpec) -> concurrent.futures.Future[Info] | None:
        """Start loading `spec` if it fits in the memory budget beside what is loaded, without
        unloading anything (at start, and for a model an admin enables); None if it does not
        fit now (it loads on its first request). A serving name follows `serve`."""
        with self._lock:
            self._remember(spec, used=False)
            current = self._engines.get(spec.name)
            if (current is not None and current.is_serving) or spec.name in self._loading:
                return None
            if not self.residency.fits_now(spec):
                return None
            return mirror(self._load_locked(spec, make_room=False))

    def serve(self, spec: ModelSpec, *, request: bool = True) -> concurrent.futures.Future[Info]:
        """The info a request for `spec.name` is validated against, without waiting for a
        reload: while an engine of the spec's kind serves the name, at once (a different `spec`
        starts loading beside it); otherwise once `spec` has loaded. A spec whose load failed
        less than LOAD_RETRY_AFTER_S ago is not tried again: ModelLoadError, unless an older
        engine still serves."""
        with self._lock:
            self._remember(spec, used=request)
            if request:  # held until the request reaches the engine (`submit`, `embed`)
                self.residency.hold(spec.name)
            current = self._engines.get(spec.name)
            failure = self._failures.get(spec.name)
            recent = failure is not None and failure.blocks(spec)
            if current is not None and current.is_serving and current.spec.kind == spec.kind:
                if current.spec == spec:
                    # The registry is back on the serving spec: an older failure is moot.
                    self._failures.pop(spec.name, None)
                elif not recent:
                    self._load_locked(spec)
                return resolved(current.info)
            if recent:
                future: concurrent.futures.Future[Info] = concurrent.futures.Future()
                future.set_exception(ModelLoadError(failure.error))
                return future
            loading = mirror(self._load_locked(spec))
            return self._room_wait(spec, loading) if request else loading

    def _load_locked(
        self, spec: ModelSpec, *, force: bool = False, make_room: bool = True
    ) -> concurrent.futures.Future[Info]:
        current = self._engines.get(spec.name)
        if current is not None and current.spec == spec and current.is_serving and not force:
            return resolved(current.info)
        loading = self._loading.get(spec.name)
        if loading is not None and loading[0].spec == spec:
            return loading[1]
        engine = self._new_engine(spec)
        freed: list[concurrent.futures.Future] = []  # the unloaded engines' ends
        if make_room:
            for victim in self.residency.victims(spec, self._engines):
                logger.info("unloading %s (idle) to make room for %s", victim.spec.name, spec.name)
                self._retire_locked(victim.spec.name)
                freed.append(victim.ended)
        replacing = current if current is not None and current.is_serving else None
        reservation = self.memory.reserve(engine, spec, replacing=replacing)
        if reservation is None:
            # Kept for `status` (the admin, remote web processes) but retried by the next
            # request: room may have freed by then.
            error = ModelCapacityError(self.residency.no_room_message(spec))
            self._failures[spec.name] = LoadFailure.now(
                spec, str(error), retry_after=0.0, code=error.code
            )
            future: concurrent.futures.Future[Info] = concurrent.futures.Future()
            future.set_exception(error)
            return future
        engine.cache_bytes = reservation.cache_bytes
        engine.ended.add_done_callback(lambda _: self.memory.release(engine))
        # Resolved only after the swap, so whoever waits on it finds the new engine.
        swapped: concurrent.futures.Future[Info] = concurrent.futures.Future()
        self._loading[spec.name] = (engine, swapped)
        engine.ready.add_done_callback(lambda _: self._swap(engine, swapped))
        if freed:
            # The load starts once the unloaded engines have returned their memory (an idle
            # engine's loop ends at once), so the two never add up beyond the budget.
            threading.Thread(
                target=start_after, args=(engine, freed), name="orchard-load", daemon=True
            ).start()
        else:
            engine.start()
        return swapped

    def _room_wait(
        self, spec: ModelSpec, future: concurrent.futures.Future[Info]
    ) -> concurrent.futures.Future[Info]:
        """`future`, or where it failed for want of room, one that tries again for a while."""

        def again() -> concurrent.futures.Future[Info]:
            with self._lock:
                return mirror(self._load_locked(spec))

        return wait_for_room(future, again, closed=lambda: self._closed)

    def _new_engine(self, spec: ModelSpec) -> Engine:
        """An engine for `spec`, not started (nothing loads until `start`)."""
        if spec.kind == "embedding":
            embedder = EmbeddingEngine(spec, lambda: self._embedding_loader(spec))
            embedder.compute_turns = self.compute_turns
            return embedder
        if spec.engine not in self._engine_classes:
            raise ValueError(
                f"unknown engine {spec.engine!r}; choose from {sorted(self._engine_classes)}"
            )
        engine = self._engine_classes[spec.engine](spec, lambda: self._loader(spec))
        engine.prefix_disk = self.prefix_disk
        engine.compute_turns = self.compute_turns
        return engine

    def _swap(self, engine: Engine, swapped: concurrent.futures.Future[Info]) -> None:
        name, error = engine.spec.name, engine.ready.exception()
        with self._lock:
            loading = self._loading.get(name)
            current = loading is not None and loading[0] is engine
            if current:
                del self._loading[name]
            old = None
            if not current:
                old = engine  # superseded by another spec, or unloaded, while it loaded
            elif error is None:
                old = self._engines.get(name)
                self._engines[name] = engine
                self.memory.measured(engine, getattr(engine, "weights_bytes", 0))
                self.residency.loaded_at[name] = time.time()  # idle time counts from here
                self._failures.pop(name, None)
                engine.ended.add_done_callback(lambda ended: self._ended(engine, ended.result()))
            else:
                self._failures[name] = LoadFailure.now(
                    engine.spec,
                    describe(error),
                    retry_after=LOAD_RETRY_AFTER_S,
                    code=ModelLoadError.code,
                )
            if old is not None:
                self._retired = [e for e in self._retired if e.is_alive()] + [old]
        if old is not None:
            old.drain()
        if error is not None:
            swapped.set_exception(error)
        else:
            swapped.set_result(engine.ready.result())

    def _ended(self, engine: Engine, error: str | None) -> None:
        """An engine's loop ended: if it died while serving its name, start it again (its
        in-flight requests have ended with "error"), sooner the first time."""
        if error is None:
            return
        name = engine.spec.name
        with self._lock:
            if self._closed or self._engines.get(name) is not engine:
                return
            delay = self._restarts.died(name)
        logger.error("engine for %s died (%s); restarting it in %.0f s", name, error, delay)
        timer = threading.Timer(delay, self._restart, (engine,))
        timer.daemon = True
        timer.start()

    def _restart(self, engine: Engine) -> None:
        with self._lock:
            if self._closed or self._engines.get(engine.spec.name) is not engine:
                return  # replaced, unloaded or shut down meanwhile
            self._load_locked(engine.spec, force=True)

    def status(self, name: str) -> ModelStatus:
        """What serves `name` now, what loads, and the last load failure (for the admin)."""
        with self._lock:
            current = self._engines.get(name)
            loading = self._loading.get(name)
            failure = self._failures.get(name)
        if current is not None and current.is_serving:
            state = "serving"
        elif loading is not None:
            state = "loading"
        elif failure is not None and failure.code != ModelCapacityError.code:
            state = "failed"
        else:
            state = "stopped" if current is not None else "not_loaded"
        return ModelStatus(
            name=name,
            state=state,
            memory_bytes=self.memory.by_name().get(name, 0),
            last_used=self.residency.last_used.get(name),
            pinned=self.residency.pinned(name),
            idle_unload_s=self.residency.idle_s(name),
            serving=current.spec if current is not None and current.is_serving else None,
            loading=loading[0].spec if loading is not None else None,
            error=failure.error if failure is not None else None,
            failed_at=failure.at if failure is not None else None,
            failed_spec=failure.spec if failure is not None else None,
            failure_code=failure.code if failure is not None else None,
            stats=current.stats() if current is not None and current.is_serving else None,
            restarts=self._restarts.count(name),
        )

    def unload(self, name: str) -> None:
        """Stop serving `name`, aborting its in-flight requests (waits for the threads)."""
        with self._lock:
            engines = [self._engines.pop(name, None)] + [
                e for e in self._retired if e.spec.name == name
            ]
            self._loading.pop(name, None)
            self._failures.pop(name, None)
        for engine in engines:
            if engine is not None:
                engine.stop()

    def retire(self, name: str) -> None:
        """Stop serving `name` without aborting anyone: its engine finishes what it has in
        flight, refusing new requests, then ends (returns at once). A load under way is
        dropped when it finishes."""
        with self._lock:
            self._retire_locked(name)

    def _retire_locked(self, name: str) -> None:
        engine = self._engines.pop(name, None)
        self._loading.pop(name, None)
        self._failures.pop(name, None)
        self._restarts.forget(name)
        if engine is not None:
            self._retired = [e for e in self._retired if e.is_alive()] + [engine]
            # Its memory is free once its requests end; an idle engine's at once.
            if not engine.has_requests():
                self.memory.release(engine)
            engine.drain()  # returns at once

    def is_idle(self) -> bool:
        """No engine holds a request (queued, waiting or running)."""
        with self._lock:
            engines = [*self._engines.values(), *self._retired]
        return all(not e.is_alive() or not e.has_requests() for e in engines)

    def engine(self, name: str) -> Engine:
        """The engine serving `name`, of either kind, once its model has loaded."""
        engine = self._engines.get(name)
        if engine is None or not engine.is_serving:
            raise ModelNotLoadedError(f"The model {name!r} is not loaded.")
        return engine

    def get(self, name: str) -> EngineLoop:
        """The engine serving the chat model `name`, once its model has loaded."""
        engine = self.engine(name)
        if not isinstance(engine, EngineLoop):
            raise ModelNotLoadedError(f"The model {name!r} is not a chat model.")
        return engine

    def embedder(self, name: str) -> EmbeddingEngine:
        """The engine serving the embedding model `name`, once its model has loaded."""
        engine = self.engine(name)
        if not isinstance(engine, EmbeddingEngine):
            raise ModelNotLoadedError(f"The model {name!r} is not an embedding model.")
        return engine

    def names(self) -> list[str]:
        """Names this worker serves or loads (what retire or unload would stop)."""
        with self._lock:
            return sorted(set(self._engines) | set(self._loading))

    def model_names(self) -> list[str]:
        """Names with an engine (serving or dead), as `stats` reports them."""
        return list(self._engines)

    def submit(self, request: GenerationRequest, emit: Emit) -> None:
        self.residency.touch(request.model)
        self.residency.unhold(request.model)
        engine = self.get(request.model)
        try:
            engine.submit(request, emit)
        except ModelNotLoadedError:
            if self._engines.get(request.model) is engine:
                raise
            # Replaced between the lookup and the submit: its successor takes the request.
            self.get(request.model).submit(request, emit)

    def compile_grammar(self, model: str, grammar: str) -> None:
        self.get(model).compile_grammar(grammar)

    def embed(self, model: str, token_ids: list[list[int]]) -> EmbeddingJob:
        """A job computing the (inputs, dimensions) float32 vectors of an embedding model for
        `token_ids` (cancel its future to stop it between forwards)."""
        self.residency.touch(model)
        self.residency.unhold(model)
        return self.embedder(model).submit(token_ids)

    def abort(self, model: str, request_id: str) -> None:
        # A draining engine may still hold the request.
        engines = [self._engines.get(model)] + [e for e in self._retired if e.spec.name == model]
        for engine in engines:
            if isinstance(engine, EngineLoop):
                engine.abort(request_id)

    def stats(self) -> list[EngineStats]:
        return [engine.stats() for engine in list(self._engines.values())]

    def memory_stats(self) -> dict[str, int | None]:
        """The memory budget (None: none) and the bytes the models hold in it."""
        return self.residency.stats()

    def remember(self, spec: ModelSpec) -> None:
        """Take `spec`'s residency settings (pinned, idle time) without loading it."""
        with self._lock:
            self._remember(spec, used=False)

    def _remember(self, spec: ModelSpec, *, used: bool = True) -> None:
        """Under the lock: `spec`'s residency settings (they change without a reload) and, for
        a request's lookup, its use now."""
        self.residency.remember(spec, used=used)
        current = self._engines.get(spec.name)
        if current is not None and current.spec == spec:
            current.spec = spec  # the same model: only residency settings may differ
        if not self._closed:
            self.residency.check_idle(self.unload_idle, stopped=lambda: self._closed)

    def unload_idle(self, now: float | None = None) -> list[str]:
        """Retire every model not pinned that has had no request for its idle time (the
        worker's default unless its spec sets one; 0: never); the names retired."""
        now = time.time() if now is None else now
        with self._lock:
            names = [n for n in self.residency.idle(self._engines, now) if n not in self._loading]
            for name in names:
                logger.info(
                    "unloading %s: no requests for %.0f s", name, self.residency.idle_s(name)
                )
                self._retire_locked(name)
        return names

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort everything in flight and join every engine thread (`timeout` s each)."""
        with self._lock:
            engines = [
                *self._engines.values(),
                *(engine for engine, _ in self._loading.values()),
                *self._retired,
            ]
            self._engines, self._loading, self._retired = {}, {}, []
            self._closed = True
        for engine in engines:
            engine.stop(timeout)
