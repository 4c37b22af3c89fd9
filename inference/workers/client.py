"""RemoteEngineClient: the web process's `EngineClient` when engines run in `runengine` workers.

Each request goes to the live worker with the least load (fleet.py: routing, and waiting for
the workers to place a model); its token events come back on this process's reply channel, are
put in order and settled there (replies.py). Everything else is a call with a reply (calls.py):
tokenizing and embedding on the least loaded worker serving an embedding model, whose facts
come with the workers' beats (no round trip); prompts render in this process with the model's
tokenizer files where this host can read them, else on a worker.

A worker whose beat has not moved for `timeout_s` is dead: its requests end with an error (their
usage rows finish as failed, in the web process that owns them), its calls with
ModelNotLoadedError, and it leaves routing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import numpy as np
from asgiref.sync import async_to_sync

from engine import (
    EmbeddingInfo,
    EmbeddingProgress,
    EngineClient,
    EngineStats,
    GenerationOutput,
    GenerationRequest,
    ModelInfo,
    ModelSpec,
    ModelStatus,
    ModelUnavailableError,
    PoolSize,
    PromptInput,
    PromptRoom,
    RenderedPrompt,
)
from inference.workers.beats import BeatStore, WorkerBeat, model_status, sum_stats
from inference.workers.calls import WorkerCalls
from inference.workers.fleet import Fleet, Worker
from inference.workers.replies import Flight, Rejected, Replies
from inference.workers.wire import (
    decode_error,
    registry_group,
    reply_prefix,
    worker_channel,
)

logger = logging.getLogger(__name__)


class RemoteEngineClient(EngineClient):
    def __init__(
        self,
        *,
        store: BeatStore,
        namespace: str,
        heartbeat_s: float = 1.0,
        timeout_s: float = 5.0,
        load_wait_s: float = 600.0,
        layer_factory=None,
        render: PoolSize | None = None,
    ):
        from channels.layers import get_channel_layer

        self.store = store
        self.namespace = namespace
        self.refresh_s = min(0.5, heartbeat_s / 2)
        self.fleet = Fleet(
            store,
            nudge_workers=self._nudge_workers,
            load_on=self._load_on,
            heartbeat_s=heartbeat_s,
            timeout_s=timeout_s,
            refresh_s=self.refresh_s,
            load_wait_s=load_wait_s,
        )
        self.replies = Replies()
        self.calls = WorkerCalls(
            namespace=namespace,
            fleet=self.fleet,
            replies=self.replies,
            send=self._send,
            render=render,
        )
        self._layer_factory = layer_factory or get_channel_layer
        self._layer = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._starting: asyncio.Lock | None = None
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()

    # Starting
    async def _started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self.replies.channel is not None:
            return
        if self._loop is not None and self._loop is not loop and not self._loop.is_closed():
            raise RuntimeError("a RemoteEngineClient serves the one event loop it started on")
        if self._loop is not loop:
            self._loop, self.replies.channel, self._starting = loop, None, asyncio.Lock()
        async with self._starting:
            if self.replies.channel is not None:
                return
            self._layer = self._layer_factory()
            reply = await self._layer.new_channel(reply_prefix(self.namespace))
            self.fleet.workers, self.replies.orders = {}, {}
            await self._refresh()  # raises while Redis is away: nothing started, nothing leaks
            self.replies.channel = reply
            self._tasks = [
                asyncio.create_task(self._receive_loop(reply), name="orchard-remote-receive"),
                asyncio.create_task(self._refresh_loop(), name="orchard-remote-refresh"),
            ]

    async def _send(self, channel: str, message: dict) -> None:
        await self._layer.send(channel, message)

    def _spawn(self, coroutine) -> None:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # Beats
    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self._refresh()
            except Exception:
                logger.warning("could not read the engine workers' beats", exc_info=True)
            self.replies.close_gaps()

    async def _refresh(self) -> None:
        self._update(await self.store.read_all())

    def _update(self, beats: list[WorkerBeat]) -> None:
        now = time.monotonic()
        for known in self.fleet.update(beats, now):
            # A worker stopped beating: end what it held with an error.
            num_flights = self.replies.worker_lost(known.beat.worker_id)
            if num_flights or known.confirmed:
                logger.warning(
                    "engine worker %s is gone; ending %d request(s)",
                    known.beat.worker_id,
                    num_flights,
                )
        self.replies.settle(self.fleet.workers, now, self.refresh_s)

    # Receiving
    async def _receive_loop(self, reply: str) -> None:
        while True:
            try:
                message = await self._layer.receive(reply)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.warning("receiving engine events failed", exc_info=True)
                await asyncio.sleep(0.5)
                continue
            try:
                self.replies.arrived(message)
            except Exception:
                logger.exception("bad engine message: %.200r", message)

    # Models
    async def serving_model(self, spec: ModelSpec) -> ModelInfo:
        await self._started()
        self.fleet.wanted[spec.name] = spec
        return await self.fleet.wait_for(spec, exact=False)

    async def ensure_model(self, spec: ModelSpec) -> ModelInfo:
        await self._started()
        self.fleet.wanted[spec.name] = spec
        return await self.fleet.wait_for(spec, exact=True)

    async def _nudge_workers(self) -> None:
        try:
            await self._layer.group_send(
                registry_group(self.namespace), {"type": "registry.changed"}
            )
        except Exception:
            logger.warning("could not reach the engine workers", exc_info=True)

    async def _load_on(self, worker_id: str, spec: ModelSpec) -> None:
        await self._send_quietly(
            worker_channel(self.namespace, worker_id),
            {"type": "load", "spec": spec.to_dict(), "force": False},
        )

    def place_models(self, specs: list[ModelSpec], *, load_new: bool = True) -> None:
        """The workers read the registry themselves: tell them to look now."""
        self._group_send_sync({"type": "registry.changed"})

    def start_loading(self, spec: ModelSpec, *, force: bool = False) -> None:
        self._group_send_sync({"type": "load", "spec": spec.to_dict(), "force": force})

    async def unload_model(self, name: str, *, drain: bool = False) -> None:
        await self._started()
        await self._layer.group_send(
            registry_group(self.namespace), {"type": "unload", "model": name}
        )

    def _group_send_sync(self, message: dict) -> None:
        from channels.layers import get_channel_layer

        try:
            async_to_sync(get_channel_layer().group_send)(registry_group(self.namespace), message)
        except Exception:
            logger.warning("could not reach the engine workers", exc_info=True)

    def workers(self) -> list[WorkerBeat]:
        """The live workers' last beats (any thread)."""
        return self.fleet.beats()

    def memory_budgets(self) -> dict[str, dict[str, int | None]]:
        return {
            beat.worker_id: {
                "max_bytes": beat.memory_max_bytes,
                "used_bytes": beat.memory_used_bytes,
            }
            for beat in self.workers()
        }

    def model_status(self, name: str) -> ModelStatus:
        return model_status(name, self.workers())

    def clear_prefix_cache(self, name: str, timeout: float = 30.0) -> int:
        return async_to_sync(self._clear_prefix_cache)(name, timeout)

    async def _clear_prefix_cache(self, name: str, timeout_s: float) -> int:
        await self._started()
        return await self.calls.clear_prefix_cache(name, timeout_s)

    async def stats(self) -> list[EngineStats]:
        await self._started()
        names = sorted({name for w in self.fleet.live() for name in w.beat.models})
        stats = [
            sum_stats(name, [b for w in self.fleet.serving(name) if (b := w.beat.models[name])])
            for name in names
        ]
        return [s for s in stats if s is not None]

    # Prompts
    async def render_prompt(
        self,
        model: str,
        prompt: PromptInput,
        *,
        timeout_s: float | None = None,
        room: PromptRoom | None = None,
    ) -> RenderedPrompt:
        await self._started()
        return await self.calls.render(model, prompt, timeout_s, None if prompt.images else room)

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        await self._started()
        return await self.calls.detokenize(model, token_ids)

    # Embeddings
    async def embedding_model(self, spec: ModelSpec) -> EmbeddingInfo:
        await self._started()
        self.fleet.wanted[spec.name] = spec
        return await self.fleet.wait_for(spec, exact=False)

    async def tokenize(
        self, model: str, texts: list[str], *, timeout_s: float | None = None
    ) -> list[list[int]]:
        await self._started()
        return await self.calls.tokenize(model, texts, timeout_s)

    async def embed(
        self,
        model: str,
        token_ids: list[list[int]],
        progress: EmbeddingProgress | None = None,
    ) -> np.ndarray:
        await self._started()
        return await self.calls.embed(model, token_ids, progress)

    # Generating
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        return self._generate(request)

    def _route(
        self,
        model: str,
        exclude: set[str],
        prompt: tuple[int, ...] = (),
        scope: str = "",
        tenant: str | None = None,
    ) -> Worker | None:
        return self.fleet.route(
            model,
            exclude,
            prompt,
            reply=self.replies.channel,
            in_flight=self.replies.in_flight,
            scope=scope,
            tenant=tenant,
        )

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        await self._started()
        flights = self.replies.flights
        tried: set[str] = set()
        while True:
            worker = self._route(
                request.model,
                tried,
                request.prompt_token_ids,
                request.cache_scope,
                request.service.tenant,
            )
            if worker is None:
                raise ModelUnavailableError(
                    f"No engine worker serves the model '{request.model}' now; please retry "
                    "shortly."
                )
            worker_id = worker.beat.worker_id
            flight = Flight(request, worker_id, worker.beat.run_id)
            flights[request.request_id] = flight
            message = {
                "type": "generate",
                "request": request.to_dict(),
                "reply": self.replies.channel,
                "run": worker.beat.run_id,
            }
            try:
                await self._layer.send(worker_channel(self.namespace, worker_id), message)
            except Exception as exc:
                flights.pop(request.request_id, None)
                logger.warning("could not send to engine worker %s: %s", worker_id, exc)
                tried.add(worker_id)
                continue
            except BaseException:
                # Cancelled while sending (the client left): it may have arrived.
                flights.pop(request.request_id, None)
                self._abort_on(worker_id, request)
                raise
            try:
                first = await flight.queue.get()
            except BaseException:
                flights.pop(request.request_id, None)
                self._abort_on(worker_id, request)
                raise
            if isinstance(first, Rejected):
                flights.pop(request.request_id, None)
                if first.error.get("retry"):
                    tried.add(worker_id)
                    continue
                raise decode_error(first.error)
            self.fleet.affinity.remember(
                request.model, request.prompt_token_ids, worker_id, request.cache_scope
            )
            break
        num_open = request.sampling.n
        try:
            item = first
            while True:
                if isinstance(item, Rejected):
                    raise decode_error(item.error)
                if item.finish_reason is not None:
                    num_open -= 1
                yield item
                if not num_open:
                    break
                item = await flight.queue.get()
        finally:
            flights.pop(request.request_id, None)
            if num_open:
                self._abort_on(worker_id, request)

    def _abort_on(self, worker_id: str, request: GenerationRequest) -> None:
        message = {"type": "abort", "model": request.model, "request_id": request.request_id}
        self._spawn(self._send_quietly(worker_channel(self.namespace, worker_id), message))

    async def _send_quietly(self, channel: str, message: dict) -> None:
        try:
            await self._layer.send(channel, message)
        except Exception:
            logger.warning("could not send %s to %s", message.get("type"), channel, exc_info=True)

    async def _abort_all(self, flights: list[Flight]) -> None:
        for flight in flights:
            await self._send_quietly(
                worker_channel(self.namespace, flight.worker_id),
                {
                    "type": "abort",
                    "model": flight.request.model,
                    "request_id": flight.request.request_id,
                },
            )

    async def abort(self, request_id: str) -> None:
        flight = self.replies.flights.get(request_id)
        if flight is not None:
            self._abort_on(flight.worker_id, flight.request)

    # Stopping
    async def shutdown(self) -> None:
        flights = list(self.replies.flights.values())
        self.replies.flights.clear()
        if flights and self._layer is not None:
            await self._abort_all(flights)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks, self.replies.channel = [], None
        await self.store.aclose()
        self.close()

    def close(self, timeout: float | None = None) -> None:
        """For an atexit hook (the event loop has stopped): abort on their workers the requests
        still in flight, so nothing generates for a web process that is gone."""
        flights = list(self.replies.flights.values())
        self.replies.flights.clear()
        if flights and self._layer is not None:
            try:
                asyncio.run(asyncio.wait_for(self._abort_all(flights), timeout or 5))
            except Exception:
                logger.warning("could not abort %d request(s) on their workers", len(flights))
        self.calls.renderer.close()
        self.store.close()
