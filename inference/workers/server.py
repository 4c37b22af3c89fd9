"""EngineServer: a `runengine` process's side of the channel layer.

It serves the registry's enabled models, chat and embedding (or those `--models` names), on an
`EngineWorker` (placement.py follows the registry), takes requests and calls on its own channel,
and sends their events back in batches (outbox.py). Beats go to Redis every `heartbeat_s`
(beats.py): each model's state, load and info, and the requests in flight per web process.
`drain()` stops taking requests and returns once those in flight have finished: what SIGTERM
does. A bad message is answered with an error (or logged), never the end of the worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from engine import (
    EmbeddingJob,
    EngineError,
    EngineOverloadedError,
    EngineWorker,
    GenerationOutput,
    GenerationRequest,
    ModelNotLoadedError,
    ModelSpec,
    PoolSize,
    PromptInput,
    PromptRenderer,
    PromptRoom,
    expand_rendered,
)
from inference.workers.beats import BeatStore, ModelBeat, WorkerBeat
from inference.workers.outbox import Outbox
from inference.workers.placement import Placement
from inference.workers.wire import encode_error, registry_group, safe_name, worker_channel

logger = logging.getLogger(__name__)

# An abort that arrives before its request (the request still compiling its grammar) is kept
# this long.
EARLY_ABORT_TTL_S = 60.0
ERROR_DRAINING = "This engine worker is shutting down."


@dataclass
class _Flight:
    model: str
    reply: str
    open: int  # choices without their last event yet


class EngineServer:
    def __init__(
        self,
        *,
        worker: EngineWorker,
        layer,
        store: BeatStore,
        namespace: str,
        desired: Callable[[], Awaitable[list[ModelSpec]]],
        model_filter: list[str] | None = None,
        heartbeat_s: float = 1.0,
        timeout_s: float = 5.0,
        sync_s: float = 5.0,
        worker_id: str | None = None,
        render: PoolSize | None = None,
    ):
        self.worker = worker
        self.layer = layer
        self.store = store
        self.namespace = namespace
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.worker_id = (
            safe_name(worker_id)
            if worker_id
            else (f"{safe_name(socket.gethostname())}-{os.getpid()}-{secrets.token_hex(3)}")
        )
        self.channel = worker_channel(namespace, self.worker_id)
        self.renderer = PromptRenderer(render)
        self.started_at = time.time()
        # This process's run: a worker restarted under the same id is another run, and a
        # request sent to an earlier run is not taken up by this one.
        self.run_id = secrets.token_hex(4)
        self.outbox = Outbox(
            layer=layer,
            worker_id=self.worker_id,
            run_id=self.run_id,
            on_output=self._note,
            on_unreachable=self._abandon,
        )
        self.placement = Placement(
            worker=worker,
            desired=desired,
            model_filter=model_filter,
            sync_s=sync_s,
            join=self._join,
            changed=self._changed,
        )
        self._ops: dict[str, Callable[[dict], Awaitable[Any]]] = {
            "render": self._render,
            "detokenize": self._detokenize,
            "clear_cache": self._clear_cache,
            "tokenize": self._tokenize,
            "embed": self._embed,
        }
        self._flights: dict[str, _Flight] = {}
        self._calls: dict[str, tuple[str, str]] = {}  # call id -> (model, reply) while it runs
        self._embeddings: dict[str, EmbeddingJob] = {}  # embed calls' request ids, while they run
        self._early_aborts: dict[str, float] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._beat_now = asyncio.Event()
        self._draining = False
        self._beat_seq = 0
        self._versions: dict[str, str] = {}
        self._tasks: set[asyncio.Task] = set()
        self._starting: dict[str, str] = {}  # request id -> reply, until submitted or refused

    # Lifecycle
    async def run(self, stop: asyncio.Event, abort: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set, then drain (or, once `abort` is set too, abort what is
        still running) and leave: beat removed, engines stopped."""
        self._loop = asyncio.get_running_loop()
        loops = [asyncio.create_task(self.outbox.run(), name="orchard-worker-send")]
        await self.placement.place()
        loops += [
            asyncio.create_task(self._beat_loop(), name="orchard-worker-beat"),
            asyncio.create_task(self._receive_loop(), name="orchard-worker-receive"),
            asyncio.create_task(self.placement.loop(), name="orchard-worker-placement"),
        ]
        logger.info("engine worker %s serving on %s", self.worker_id, self.channel)
        try:
            await stop.wait()
            logger.info("engine worker %s draining", self.worker_id)
            drained = asyncio.create_task(self.drain())
            waits = [drained] + ([asyncio.create_task(abort.wait())] if abort else [])
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            if not drained.done():
                logger.warning("engine worker %s aborting what is still running", self.worker_id)
                await asyncio.to_thread(self.worker.shutdown, 10)
                drained.cancel()
            for task in waits:
                task.cancel()
            await self.outbox.flushed()
        finally:
            # On Python 3.11 `asyncio.wait_for` (here and inside redis-py) can swallow a
            # cancellation that lands as its wait completes: cancel until each loop has ended.
            while pending := [task for task in loops if not task.done()]:
                for task in pending:
                    task.cancel()
                await asyncio.wait(pending, timeout=0.5)
            await self._leave()

    async def drain(self) -> None:
        """Refuse new requests (other workers take them) and return once every request this
        worker holds has finished and its last events have been sent."""
        self._draining = self.placement.stopped = True
        self._beat_now.set()
        # Engine threads' state: polled, as nothing on this loop is told when it changes.
        while self._flights or self._tasks or not self.worker.is_idle():  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        await self.outbox.flushed()

    async def _leave(self) -> None:
        await self.outbox.close()
        try:
            await self.layer.group_discard(registry_group(self.namespace), self.channel)
        except Exception:
            logger.warning("could not leave the registry group", exc_info=True)
        try:
            await self.store.remove(self.worker_id, list(self._versions))
        except Exception:
            logger.warning("could not remove this worker's beat", exc_info=True)
        await asyncio.to_thread(self.worker.shutdown, 10)
        self.renderer.close()
        await self.store.aclose()

    async def _join(self) -> None:
        await self.layer.group_add(registry_group(self.namespace), self.channel)

    def _changed(self) -> None:
        """Beat now (any thread): what this worker serves has changed."""
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._beat_now.set)
            except RuntimeError:
                pass  # the loop is closed: the process is exiting

    # Receiving
    async def _receive_loop(self) -> None:
        while True:
            try:
                message = await self.layer.receive(self.channel)
            except asyncio.CancelledError:
                raise
            except Exception:
                # Redis away: keep trying (the beat stops meanwhile, so web processes route
                # elsewhere), and take requests again once it is back.
                logger.warning("receiving on %s failed", self.channel, exc_info=True)
                await asyncio.sleep(0.5)
                continue
            try:
                self._handle(message)
            except Exception:
                logger.exception("bad message on %s: %.200r", self.channel, message)

    def _handle(self, message: dict[str, Any]) -> None:
        kind = message.get("type")
        if kind == "generate":
            self._spawn(self._generate(message))
        elif kind == "abort":
            self._abort(message["model"], message["request_id"])
        elif kind == "call":
            if not isinstance(message.get("reply"), str):
                raise ValueError("a call without a reply channel")  # whom to answer?
            self._spawn(self._call(message))
        elif kind == "registry.changed":
            self.placement.sync_now.set()
        elif kind == "load":
            self.placement.load(
                ModelSpec.from_dict(message["spec"]), force=bool(message.get("force"))
            )
        elif kind == "unload":
            self.placement.unload(message["model"])
        else:
            logger.warning("unknown message type %r on %s", kind, self.channel)

    def _spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _generate(self, message: dict[str, Any]) -> None:
        request = GenerationRequest.from_dict(message["request"])
        reply, request_id = message["reply"], request.request_id
        if message.get("run") not in (None, self.run_id):
            # Sent to the process that had this worker id before: its caller has given it
            # up (or handed it to another worker) when that process stopped beating.
            logger.info("dropping request %s sent to an earlier run", request_id)
            return
        if self._draining:
            self.outbox.post(
                reply,
                ("rej", request_id, encode_error(ModelNotLoadedError(ERROR_DRAINING), retry=True)),
            )
            return
        self._starting[request_id] = reply
        try:
            if request.sampling.grammar is not None:
                await asyncio.to_thread(
                    self.worker.compile_grammar, request.model, request.sampling.grammar
                )
            if self._early_aborts.pop(request_id, None) is not None:
                return  # the client left while the grammar compiled
            self._flights[request_id] = _Flight(request.model, reply, request.sampling.n)
            self.worker.submit(
                request, lambda output: self.outbox.post(reply, ("out", request_id, output))
            )
        except Exception as exc:
            self._flights.pop(request_id, None)
            retry = isinstance(exc, ModelNotLoadedError | EngineOverloadedError)
            if not isinstance(exc, EngineError):
                logger.exception("request %s could not start", request_id)
            self.outbox.post(reply, ("rej", request_id, encode_error(exc, retry=retry)))
        finally:
            self._starting.pop(request_id, None)

    def _abort(self, model: str, request_id: str) -> None:
        if request_id in self._flights:
            self.worker.abort(model, request_id)
            return
        if request_id in self._embeddings:
            self._embeddings[request_id].future.cancel()
            return
        now = time.monotonic()
        self._early_aborts = {
            rid: at for rid, at in self._early_aborts.items() if now - at < EARLY_ABORT_TTL_S
        }
        self._early_aborts[request_id] = now

    async def _call(self, message: dict[str, Any]) -> None:
        op, reply, call_id = message["op"], message["reply"], message["call_id"]
        args = message.get("args")
        self._calls[call_id] = (args.get("model", "") if isinstance(args, dict) else "", reply)
        try:
            handler = self._ops.get(op)
            if handler is None or not isinstance(args, dict):
                raise EngineError(f"unknown call {op!r}, or arguments that are not a mapping")
            result = {"value": await handler(args)}
        except Exception as exc:
            if not isinstance(exc, EngineError):
                logger.exception("call %s failed", op)
            result = {"error": encode_error(exc)}
        finally:
            self._calls.pop(call_id, None)
        self.outbox.post(reply, ("res", call_id, result))

    async def _render(self, args: dict) -> dict:
        engine = self.worker.get(args["model"])
        prompt = PromptInput.from_dict(args["prompt"])
        rendered = await self.renderer.render(
            engine.loaded.tokenizer,
            dataclasses.replace(prompt, images=()),  # the template sees image parts only
            checkpoints=engine.info.hybrid,
            timeout_s=args.get("timeout_s"),
            room=None if prompt.images or not args.get("room") else PromptRoom(**args["room"]),
        )
        if prompt.images:
            rendered = await expand_rendered(engine.loaded.vision, rendered, prompt.images)
        return {
            "token_ids": list(rendered.token_ids),
            "checkpoints": list(rendered.checkpoints),
            "tail_text": rendered.tail_text,
            "image_tokens": list(rendered.image_tokens),
        }

    async def _detokenize(self, args: dict) -> str:
        tokenizer = self.worker.get(args["model"]).loaded.tokenizer
        return await asyncio.to_thread(tokenizer.decode, list(args["token_ids"]))

    async def _clear_cache(self, args: dict) -> int:
        try:
            engine = self.worker.get(args["model"])
        except ModelNotLoadedError:
            return 0
        return await asyncio.wrap_future(engine.clear_prefix_cache())

    async def _tokenize(self, args: dict) -> list[list[int]]:
        tokenizer = self.worker.embedder(args["model"]).tokenizer()
        return await self.renderer.encode(tokenizer, args["texts"], timeout_s=args.get("timeout_s"))

    async def _embed(self, args: dict) -> dict:
        """The vectors and the tokens computed; an `abort` naming the call's `request_id`
        stops it between forwards, and it answers with the tokens computed alone."""
        request_id = args.get("request_id")
        if self._early_aborts.pop(request_id, None) is not None:
            return {"num_computed_tokens": 0}  # the client left before it started
        job = self.worker.embed(args["model"], args["token_ids"])
        if request_id is not None:
            self._embeddings[request_id] = job
        try:
            num_computed_tokens = await asyncio.wrap_future(job.ended)
        finally:
            self._embeddings.pop(request_id, None)
        if job.future.cancelled():
            return {"num_computed_tokens": num_computed_tokens}
        vectors = job.future.result()  # or the engine's error
        # float32 bytes: a quarter of the size of the numbers in msgpack, and exact.
        return {
            "shape": list(vectors.shape),
            "vectors": vectors.astype("<f4").tobytes(),
            "num_computed_tokens": num_computed_tokens,
        }

    # Requests' bookkeeping
    def _note(self, request_id: str, output: GenerationOutput) -> None:
        if output.finish_reason is None:
            return
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.open -= 1
            if flight.open <= 0:
                del self._flights[request_id]

    def _abandon(self, reply: str) -> None:
        """A web process that no longer reads its channel: abort what runs for it."""
        for request_id, flight in list(self._flights.items()):
            if flight.reply == reply:
                self.worker.abort(flight.model, request_id)

    # Beats
    async def _beat_loop(self) -> None:
        while True:
            try:
                await self._beat()
            except Exception:
                logger.warning("heartbeat failed", exc_info=True)
            try:
                async with asyncio.timeout(self.heartbeat_s):
                    await self._beat_now.wait()
            except TimeoutError:
                pass
            self._beat_now.clear()

    async def _beat(self) -> None:
        self._beat_seq += 1
        ttl = self.timeout_s * 3
        models: dict[str, ModelBeat] = {}
        for name in sorted(set(self.placement.specs) | set(self.worker.names())):
            status = self.worker.status(name)
            beat = ModelBeat.of_status(status)
            if status.state == "serving":
                engine = self.worker.engine(name)
                digest = hashlib.sha1(
                    json.dumps(status.serving.to_dict(), sort_keys=True).encode()
                ).hexdigest()[:12]
                beat.version = f"{digest}-{id(engine):x}"
                if self._versions.get(name) != beat.version:
                    await self.store.publish_info(
                        self.worker_id, beat.version, status.serving, engine.info, ttl
                    )
                    self._versions[name] = beat.version
            for flight in self._flights.values():
                if flight.model == name:
                    beat.by_reply[flight.reply] = beat.by_reply.get(flight.reply, 0) + flight.open
            for model, reply in self._calls.values():
                if model == name:
                    beat.by_reply[reply] = beat.by_reply.get(reply, 0) + 1
            models[name] = beat
        memory = self.worker.memory_stats()
        open_requests: dict[str, list[str]] = {}
        for request_id, flight in self._flights.items():
            open_requests.setdefault(flight.reply, []).append(request_id)
        for request_id, reply in self._starting.items():
            open_requests.setdefault(reply, []).append(request_id)
        await self.store.refresh_info(self.worker_id, list(self._versions), ttl)
        await self.store.publish(
            WorkerBeat(
                worker_id=self.worker_id,
                host=socket.gethostname(),
                pid=os.getpid(),
                started_at=self.started_at,
                at=time.time(),
                seq=self._beat_seq,
                run_id=self.run_id,
                draining=self._draining,
                open_requests=open_requests,
                model_filter=self.placement.model_filter,
                models=models,
                memory_max_bytes=memory["max_bytes"],
                memory_used_bytes=memory["used_bytes"],
            ),
            ttl,
        )
