"""LocalEngineClient: the engine in this process, behind the asyncio `EngineClient` interface.

Outputs cross from the engine thread into a per-request `asyncio.Queue`. Outputs for one event
loop are coalesced: while a delivery is pending, new ones join it, so a batch step wakes the loop
about once rather than once per token per sequence. Leaving the stream early (closing the
iterator, or cancelling the task that consumes it) sends an abort, which the engine applies
before its next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import functools
import logging
import threading
import weakref
from collections.abc import AsyncIterator

import numpy as np

from engine.client import EngineClient
from engine.core.embedding import EmbeddingJob
from engine.models.vision import expand_rendered
from engine.protocol import (
    EmbeddingInfo,
    EmbeddingProgress,
    EngineStats,
    GenerationOutput,
    GenerationRequest,
    ModelInfo,
    ModelNotLoadedError,
    ModelSpec,
    ModelStatus,
    PromptInput,
    PromptRoom,
    RenderedPrompt,
)
from engine.text.processes import PoolSize
from engine.text.rendering import PromptRenderer
from engine.worker import EngineWorker

logger = logging.getLogger(__name__)

# A cancelled embedding ends at the end of its engine's forward under way: a second or so.
EMBED_STOP_WAIT_S = 10.0


class _LoopMailbox:
    """Outputs posted from engine threads to one event loop, delivered in batches."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, GenerationOutput]] = []

    def post(self, queue: asyncio.Queue, output: GenerationOutput) -> None:
        with self._lock:
            self._pending.append((queue, output))
            if len(self._pending) > 1:
                return  # a delivery is already scheduled and will take this one too
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            pass  # the event loop is closed: nobody is listening any more

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, output in pending:
            queue.put_nowait(output)


class LocalEngineClient(EngineClient):
    def __init__(self, worker: EngineWorker | None = None, *, render: PoolSize | None = None):
        self.worker = worker or EngineWorker()
        self.renderer = PromptRenderer(render)
        self._mailboxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopMailbox] = (
            weakref.WeakKeyDictionary()
        )

    def _mailbox(self, loop: asyncio.AbstractEventLoop) -> _LoopMailbox:
        mailbox = self._mailboxes.get(loop)
        if mailbox is None:
            mailbox = self._mailboxes[loop] = _LoopMailbox(loop)
        return mailbox

    async def ensure_model(self, spec: ModelSpec) -> ModelInfo:
        # `load` never waits for an engine thread (a replaced engine drains on its own), so it
        # is safe on the event loop.
        return await asyncio.wrap_future(self.worker.load(spec))

    async def serving_model(self, spec: ModelSpec) -> ModelInfo:
        return await asyncio.wrap_future(self.worker.serve(spec))

    def model_status(self, name: str) -> ModelStatus:
        return self.worker.status(name)

    def memory_budgets(self) -> dict[str, dict[str, int | None]]:
        return {"local": self.worker.memory_stats()}

    def clear_prefix_cache(self, name: str, timeout: float = 30.0) -> int:
        try:
            engine = self.worker.get(name)
        except ModelNotLoadedError:
            return 0
        return engine.clear_prefix_cache().result(timeout)

    def start_loading(self, spec: ModelSpec, *, force: bool = False) -> None:
        future = self.worker.load(spec, force=force)
        future.add_done_callback(functools.partial(_report_load, spec.name))

    def place_models(self, specs: list[ModelSpec], *, load_new: bool = True) -> None:
        listed = {spec.name for spec in specs}
        served = set(self.worker.names())
        for spec in specs:
            if spec.name in served:
                future = self.worker.serve(spec, request=False)  # follows a changed spec
            elif load_new:
                future = self.worker.preload(spec)  # only into free room
                if future is None:
                    logger.info("%s loads on its first request (no room now)", spec.name)
                    continue
                logger.info("loading model %s from %s", spec.name, spec.path)
            else:
                self.worker.remember(spec)
                continue
            future.add_done_callback(functools.partial(_report_load, spec.name))
        for name in served - listed:
            logger.info("no longer serving %s (registry)", name)
            self.worker.retire(name)

    async def unload_model(self, name: str, *, drain: bool = False) -> None:
        if drain:
            self.worker.retire(name)  # returns at once
        else:
            await asyncio.to_thread(self.worker.unload, name)

    async def render_prompt(
        self,
        model: str,
        prompt: PromptInput,
        *,
        timeout_s: float | None = None,
        room: PromptRoom | None = None,
    ) -> RenderedPrompt:
        engine = self.worker.get(model)
        rendered = await self.renderer.render(
            engine.loaded.tokenizer,
            dataclasses.replace(prompt, images=()),  # the template sees image parts only
            checkpoints=engine.info.hybrid,
            timeout_s=timeout_s,
            room=None if prompt.images else room,  # images add their tokens after
        )
        if prompt.images:
            rendered = await expand_rendered(engine.loaded.vision, rendered, prompt.images)
        return rendered

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        tokenizer = self.worker.get(model).loaded.tokenizer
        return await asyncio.to_thread(tokenizer.decode, list(token_ids))

    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        return self._generate(request)

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        mailbox = self._mailbox(asyncio.get_running_loop())
        outputs: asyncio.Queue[GenerationOutput] = asyncio.Queue()

        def emit(output: GenerationOutput) -> None:
            mailbox.post(outputs, output)

        if request.sampling.grammar is not None:
            await asyncio.to_thread(
                self.worker.compile_grammar, request.model, request.sampling.grammar
            )
        self.worker.submit(request, emit)
        num_open = request.sampling.n
        try:
            while num_open:
                output = await outputs.get()
                if output.finish_reason is not None:
                    num_open -= 1
                yield output
        finally:
            if num_open:
                self.worker.abort(request.model, request.request_id)

    async def abort(self, request_id: str) -> None:
        for name in self.worker.model_names():
            self.worker.abort(name, request_id)

    async def stats(self) -> list[EngineStats]:
        return self.worker.stats()

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self, timeout: float | None = None) -> None:
        """`shutdown` for callers without an event loop (an atexit hook): abort everything in
        flight and join each engine thread, waiting at most `timeout` seconds for each."""
        self.worker.shutdown(timeout)
        self.renderer.close()

    async def embedding_model(self, spec: ModelSpec) -> EmbeddingInfo:
        return await asyncio.wrap_future(self.worker.serve(spec))

    async def tokenize(
        self, model: str, texts: list[str], *, timeout_s: float | None = None
    ) -> list[list[int]]:
        tokenizer = self.worker.embedder(model).tokenizer()
        return await self.renderer.encode(tokenizer, texts, timeout_s=timeout_s)

    async def embed(
        self,
        model: str,
        token_ids: list[list[int]],
        progress: EmbeddingProgress | None = None,
    ) -> np.ndarray:
        job = self.worker.embed(model, token_ids)
        try:
            # Cancelled, this cancels the job's future: the engine stops it before its next
            # forward.
            return await asyncio.wrap_future(job.future)
        finally:
            if progress is not None:
                progress.num_computed_tokens = await _final_count(job)


async def _final_count(job: EmbeddingJob) -> int:
    """The tokens `job` computed, once its engine has let go of it (a cancelled job: at the end
    of the forward under way), or as counted after EMBED_STOP_WAIT_S."""
    if not job.ended.done():
        await asyncio.wait([asyncio.wrap_future(job.ended)], timeout=EMBED_STOP_WAIT_S)
    return job.num_computed_tokens


def _report_load(name: str, future: concurrent.futures.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        logger.error("model %s could not be loaded: %s", name, future.exception())
