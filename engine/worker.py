"""EngineWorker: owns the loaded models, one engine thread per model.

Thread-safe and synchronous; engine/local.py adapts it to asyncio, and a `runengine` process
serves one to the web processes. A model is loaded on its own engine thread, so that thread is
the only one that ever touches the model's MLX arrays. A chat model (`ModelSpec.kind` "chat") is
served by an EngineLoop, an embedding model by an EmbeddingEngine (engine/core/embedding.py):
both follow one lifecycle (start, ready, drain, stop, ended), so loading, replacing, retiring,
restarting and `status` are the same for both.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.batched import BatchedEngine
from engine.core.embedding import EmbeddingEngine, EmbeddingJob
from engine.core.loop import EngineLoop, describe
from engine.core.request import Emit
from engine.core.simple import SimpleEngine
from engine.models.embeddings import EmbeddingModel
from engine.models.loader import LoadedModel, load_model
from engine.protocol import (
    EmbeddingInfo,
    EngineStats,
    GenerationRequest,
    ModelInfo,
    ModelLoadError,
    ModelNotLoadedError,
    ModelSpec,
    ModelStatus,
)

logger = logging.getLogger(__name__)

ENGINES: dict[str, type[EngineLoop]] = {"batched": BatchedEngine, "simple": SimpleEngine}
# A spec whose load failed is not retried by requests before this many seconds: a broken path
# must not cost every request a load attempt. `load` (an admin's reload) retries at once.
LOAD_RETRY_AFTER_S = 60.0
# An engine whose loop dies is started again after the first delay; one that dies again soon
# after (within RESTART_RESET_S of its restart) waits twice as long, up to the last.
RESTART_DELAYS_S = (0.0, 1.0, 2.0, 5.0, 10.0, 30.0)
RESTART_RESET_S = 60.0

Loader = Callable[[ModelSpec], LoadedModel]
EmbeddingLoader = Callable[[ModelSpec], EmbeddingModel]
Engine = EngineLoop | EmbeddingEngine
Info = ModelInfo | EmbeddingInfo


def load_spec(spec: ModelSpec) -> LoadedModel:
    return load_model(spec.path, name=spec.name, context_length=spec.context_length)


def load_embedding_spec(spec: ModelSpec) -> EmbeddingModel:
    return EmbeddingModel(spec.path, name=spec.name)


@dataclass(frozen=True)
class _Failure:
    spec: ModelSpec
    error: str
    at: float  # time.time()
    retry_at: float  # time.monotonic()


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
    ):
        self._loader = loader
        self._embedding_loader = embedding_loader
        self._engine_classes = engines or ENGINES
        self._engines: dict[str, Engine] = {}  # serving (or dead after serving) per name
        self._loading: dict[str, tuple[Engine, concurrent.futures.Future[Info]]] = {}
        self._failures: dict[str, _Failure] = {}  # the last failed load per name
        self._retired: list[Engine] = []  # replaced engines, possibly still draining
        self._restarts: dict[str, tuple[int, float]] = {}  # name -> (deaths in a row, last at)
        self._closed = False
        self._lock = threading.Lock()

    def load(self, spec: ModelSpec, *, force: bool = False) -> concurrent.futures.Future[Info]:
        """Start serving `spec` (replacing another spec of that name); resolves once it serves,
        or with the load's exception. Retries a failed spec at once; with `force`, loads a fresh
        engine even when `spec` already serves (its files changed on disk, say)."""
        with self._lock:
            return _mirror(self._load_locked(spec, force=force))

    def serve(self, spec: ModelSpec) -> concurrent.futures.Future[Info]:
        """The info a request for `spec.name` is validated against, without waiting for a
        reload: while an engine of the spec's kind serves the name, at once (a different `spec`
        starts loading beside it); otherwise once `spec` has loaded. A spec whose load failed
        less than LOAD_RETRY_AFTER_S ago is not tried again: ModelLoadError, unless an older
        engine still serves."""
        with self._lock:
            current = self._engines.get(spec.name)
            failure = self._failures.get(spec.name)
            recent = (
                failure is not None and failure.spec == spec and time.monotonic() < failure.retry_at
            )
            if current is not None and current.is_serving and current.spec.kind == spec.kind:
                if current.spec == spec:
                    # The registry is back on the serving spec: an older failure is moot.
                    self._failures.pop(spec.name, None)
                elif not recent:
                    self._load_locked(spec)
                return _resolved(current.info)
            if recent:
                future: concurrent.futures.Future[Info] = concurrent.futures.Future()
                future.set_exception(ModelLoadError(failure.error))
                return future
            return _mirror(self._load_locked(spec))

    def _load_locked(
        self, spec: ModelSpec, *, force: bool = False
    ) -> concurrent.futures.Future[Info]:
        current = self._engines.get(spec.name)
        if current is not None and current.spec == spec and current.is_serving and not force:
            return _resolved(current.info)
        loading = self._loading.get(spec.name)
        if loading is not None and loading[0].spec == spec:
            return loading[1]
        engine = self._new_engine(spec)
        # Resolved only after the swap, so whoever waits on it finds the new engine.
        swapped: concurrent.futures.Future[Info] = concurrent.futures.Future()
        self._loading[spec.name] = (engine, swapped)
        engine.ready.add_done_callback(lambda _: self._swap(engine, swapped))
        engine.start()
        return swapped

    def _new_engine(self, spec: ModelSpec) -> Engine:
        """An engine for `spec`, not started (nothing loads until `start`)."""
        if spec.kind == "embedding":
            return EmbeddingEngine(spec, lambda: self._embedding_loader(spec))
        if spec.engine not in self._engine_classes:
            raise ValueError(
                f"unknown engine {spec.engine!r}; choose from {sorted(self._engine_classes)}"
            )
        return self._engine_classes[spec.engine](spec, lambda: self._loader(spec))

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
                self._failures.pop(name, None)
                engine.ended.add_done_callback(lambda ended: self._ended(engine, ended.result()))
            else:
                self._failures[name] = _Failure(
                    engine.spec, describe(error), time.time(), time.monotonic() + LOAD_RETRY_AFTER_S
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
            deaths, last = self._restarts.get(name, (0, 0.0))
            now = time.monotonic()
            deaths = deaths + 1 if now - last < RESTART_RESET_S else 1
            self._restarts[name] = (deaths, now)
        delay = RESTART_DELAYS_S[min(deaths, len(RESTART_DELAYS_S)) - 1]
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
        elif failure is not None:
            state = "failed"
        else:
            state = "stopped" if current is not None else "not_loaded"
        return ModelStatus(
            name=name,
            state=state,
            serving=current.spec if current is not None and current.is_serving else None,
            loading=loading[0].spec if loading is not None else None,
            error=failure.error if failure is not None else None,
            failed_at=failure.at if failure is not None else None,
            failed_spec=failure.spec if failure is not None else None,
            stats=current.stats() if current is not None and current.is_serving else None,
            restarts=self._restarts.get(name, (0, 0.0))[0],
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
            engine = self._engines.pop(name, None)
            self._loading.pop(name, None)
            self._failures.pop(name, None)
            self._restarts.pop(name, None)
            if engine is not None:
                self._retired = [e for e in self._retired if e.is_alive()] + [engine]
        if engine is not None:
            engine.drain()

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
        return self.embedder(model).submit(token_ids)

    def abort(self, model: str, request_id: str) -> None:
        # A draining engine may still hold the request.
        engines = [self._engines.get(model)] + [e for e in self._retired if e.spec.name == model]
        for engine in engines:
            if isinstance(engine, EngineLoop):
                engine.abort(request_id)

    def stats(self) -> list[EngineStats]:
        return [engine.stats() for engine in list(self._engines.values())]

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


def _mirror(future: concurrent.futures.Future[Info]) -> concurrent.futures.Future[Info]:
    """A future of the caller's own that follows `future`: one waiter giving up (cancelling
    its future, as asyncio does when a client leaves) never cancels the load for the others."""
    mirror: concurrent.futures.Future[Info] = concurrent.futures.Future()

    def follow(done: concurrent.futures.Future[Info]) -> None:
        try:
            if done.cancelled():
                mirror.cancel()
            elif done.exception() is not None:
                mirror.set_exception(done.exception())
            else:
                mirror.set_result(done.result())
        except concurrent.futures.InvalidStateError:
            pass  # this waiter gave up already

    future.add_done_callback(follow)
    return mirror


def _resolved(info: Info) -> concurrent.futures.Future[Info]:
    future: concurrent.futures.Future[Info] = concurrent.futures.Future()
    future.set_result(info)
    return future
