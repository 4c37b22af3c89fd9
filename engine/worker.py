"""EngineWorker: owns the loaded models, one engine thread per model.

Thread-safe and synchronous; engine/local.py adapts it to asyncio. A model is loaded on its own
engine thread, so that thread is the only one that ever touches the model's MLX arrays.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

from engine.batched import BatchedEngine, EngineLoop
from engine.loader import LoadedModel, load_model
from engine.protocol import (
    EngineStats,
    GenerationRequest,
    ModelInfo,
    ModelNotLoadedError,
    ModelSpec,
)
from engine.request import Emit
from engine.simple import SimpleEngine

ENGINES: dict[str, type[EngineLoop]] = {"batched": BatchedEngine, "simple": SimpleEngine}

Loader = Callable[[ModelSpec], LoadedModel]


def load_spec(spec: ModelSpec) -> LoadedModel:
    return load_model(spec.path, name=spec.name, context_length=spec.context_length)


class EngineWorker:
    """Serve models by name. `loader` turns a spec into a LoadedModel (tests pass prebuilt ones)."""

    def __init__(
        self, *, loader: Loader = load_spec, engines: dict[str, type[EngineLoop]] | None = None
    ):
        self._loader = loader
        self._engine_classes = engines or ENGINES
        self._engines: dict[str, EngineLoop] = {}
        self._lock = threading.Lock()

    def load(self, spec: ModelSpec) -> concurrent.futures.Future[ModelInfo]:
        """Start serving `spec` (replacing another spec of that name); resolves once loaded."""
        if spec.engine not in self._engine_classes:
            raise ValueError(
                f"unknown engine {spec.engine!r}; choose from {sorted(self._engine_classes)}"
            )
        with self._lock:
            current = self._engines.get(spec.name)
            if current is not None and current.spec == spec and not _failed(current):
                return current.ready
            engine = self._engine_classes[spec.engine](spec, lambda: self._loader(spec))
            self._engines[spec.name] = engine
        if current is not None:
            current.stop()
        return engine.start()

    def unload(self, name: str) -> None:
        with self._lock:
            engine = self._engines.pop(name, None)
        if engine is not None:
            engine.stop()

    def get(self, name: str) -> EngineLoop:
        """The engine serving `name`, once its model has loaded."""
        engine = self._engines.get(name)
        if engine is None or not engine.ready.done() or _failed(engine):
            raise ModelNotLoadedError(f"The model {name!r} is not loaded.")
        return engine

    def submit(self, request: GenerationRequest, emit: Emit) -> None:
        self.get(request.model).submit(request, emit)

    def abort(self, model: str, request_id: str) -> None:
        engine = self._engines.get(model)
        if engine is not None:
            engine.abort(request_id)

    def stats(self) -> list[EngineStats]:
        return [engine.stats() for engine in list(self._engines.values()) if engine.ready.done()]

    def shutdown(self, timeout: float | None = None) -> None:
        """Abort everything in flight and join every engine thread."""
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
        for engine in engines:
            engine.stop(timeout)


def _failed(engine: EngineLoop) -> bool:
    return engine.ready.done() and engine.ready.exception() is not None
