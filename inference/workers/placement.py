"""Which models a `runengine` worker serves: the registry's enabled models, chat and embedding
(or those `--models` names among them), followed on a poll every `sync_s` and at once when a web
process nudges the registry group (an admin changed a model). A name the registry drops
retires: its engine finishes what it runs, taking nothing new.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
from collections.abc import Awaitable, Callable

from engine import EngineWorker, ModelSpec

logger = logging.getLogger(__name__)


class Placement:
    """Places `desired()`'s specs on `worker`. `join` (re)joins the registry group; `changed`
    (any thread) says the worker's models changed, for a beat now."""

    def __init__(
        self,
        *,
        worker: EngineWorker,
        desired: Callable[[], Awaitable[list[ModelSpec]]],
        model_filter: list[str] | None,
        sync_s: float,
        join: Callable[[], Awaitable[None]],
        changed: Callable[[], None],
    ):
        self.worker = worker
        self.desired = desired
        self.model_filter = model_filter
        self.sync_s = sync_s
        self.join = join
        self.changed = changed
        self.specs: dict[str, ModelSpec] = {}  # what the registry enables, within the filter
        self.stopped = False  # draining: nothing new is loaded
        self.sync_now = asyncio.Event()
        self._load_errors: dict[str, str] = {}
        self._announced: set[str] = set()

    def allowed(self, name: str) -> bool:
        return self.model_filter is None or name in self.model_filter

    async def loop(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.sync_s):
                    await self.sync_now.wait()
            except TimeoutError:
                pass
            self.sync_now.clear()
            try:
                await self.place()
            except Exception:
                logger.warning("could not follow the registry", exc_info=True)

    async def place(self) -> None:
        """Offer what the registry enables (within --models): a served model follows its spec,
        another loads if it fits in the memory budget beside what is loaded (else on a web
        process's request: `load`); retire the rest, letting what it runs finish."""
        if self.stopped:
            return
        specs = {spec.name: spec for spec in await self.desired() if self.allowed(spec.name)}
        self.specs = specs
        served = set(self.worker.names())
        for spec in specs.values():
            try:
                if spec.name in served:
                    future = self.worker.serve(spec, request=False)
                else:
                    future = self.worker.preload(spec)
                    if future is None:
                        self.worker.remember(spec)
                        continue
            except ValueError as exc:
                self._log_failure(spec.name, str(exc))
                continue
            future.add_done_callback(lambda done, name=spec.name: self._loaded(name, done))
        for name in self.worker.names():
            if name not in specs:
                logger.info("no longer serving %s (registry)", name)
                self.worker.retire(name)
        await self.join()
        self.changed()

    def load(self, spec: ModelSpec, *, force: bool) -> None:
        """An admin's reload (`force`: even when the spec serves), or a web process's request
        for a model this worker offers but has not loaded (idle models make room for it)."""
        if self.stopped or not self.allowed(spec.name):
            return
        self.worker.load(spec, force=force).add_done_callback(
            lambda done: self._loaded(spec.name, done)
        )

    def unload(self, name: str) -> None:
        if self.allowed(name):
            self.worker.retire(name)
            self.changed()

    def _loaded(self, name: str, done: concurrent.futures.Future) -> None:
        if done.cancelled():
            return
        if done.exception() is None:
            if self._load_errors.pop(name, None) is not None or name not in self._announced:
                self._announced.add(name)
                logger.info("serving %s", name)
        else:
            self._log_failure(name, str(done.exception()))
        self.changed()

    def _log_failure(self, name: str, error: str) -> None:
        if self._load_errors.get(name) != error:
            self._load_errors[name] = error
            logger.error("model %s could not be loaded: %s", name, error)
