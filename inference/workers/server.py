"""EngineServer: a `runengine` process's side of the channel layer.

It serves the registry's enabled chat models (or those `--models` names) on an `EngineWorker`,
follows the registry (a poll, and a nudge on the registry group when an admin changes a model),
takes requests on its own channel and sends their events back in batches: whatever the engine
threads produced since the last send goes out as one message per web process, so a busy batch
costs about one Redis write per engine step rather than one per token. Beats go to Redis every
`heartbeat_s` (beats.py). `drain()` stops taking requests and returns once those in flight have
finished: what SIGTERM does.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from channels.exceptions import ChannelFull

from engine import (
    EngineError,
    EngineOverloadedError,
    EngineWorker,
    GenerationOutput,
    GenerationRequest,
    ModelNotLoadedError,
    ModelSpec,
    PromptInput,
    PromptRenderer,
)
from inference.workers.beats import BeatStore, ModelBeat, WorkerBeat
from inference.workers.wire import (
    encode_error,
    encode_output,
    registry_group,
    safe_name,
    worker_channel,
)

logger = logging.getLogger(__name__)

# A reply channel that stays full this long belongs to a web process that no longer reads it:
# its requests are aborted rather than generated for nobody.
SEND_RETRY_FOR_S = 5.0
# A web process's sender task ends after this long without anything to send it.
SENDER_IDLE_S = 60.0
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
    ):
        self.worker = worker
        self.layer = layer
        self.store = store
        self.namespace = namespace
        self.desired = desired
        self.model_filter = model_filter
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.sync_s = sync_s
        self.worker_id = (
            safe_name(worker_id)
            if worker_id
            else (f"{safe_name(socket.gethostname())}-{os.getpid()}-{secrets.token_hex(3)}")
        )
        self.channel = worker_channel(namespace, self.worker_id)
        self.renderer = PromptRenderer()
        self.started_at = time.time()
        self._flights: dict[str, _Flight] = {}
        self._early_aborts: dict[str, float] = {}
        self._seq: dict[str, int] = {}  # per reply channel
        self._pending: list[tuple[str, tuple[str, str, Any]]] = []
        self._pending_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._beat_now: asyncio.Event | None = None
        self._sync_now: asyncio.Event | None = None
        self._draining = False
        self._beat_seq = 0
        self._desired: dict[str, ModelSpec] = {}
        self._versions: dict[str, str] = {}
        self._load_errors: dict[str, str] = {}
        self._tasks: set[asyncio.Task] = set()
        self._starting: dict[str, str] = {}  # request id -> reply, until submitted or refused
        self._senders: dict[str, tuple[asyncio.Queue, asyncio.Task]] = {}
        self._sending = 0  # batches taken from `_pending` and not yet sent
        # This process's run: a worker restarted under the same id is another run, and a
        # request sent to an earlier run is not taken up by this one.
        self.run_id = secrets.token_hex(4)

    # Lifecycle
    async def run(self, stop: asyncio.Event, abort: asyncio.Event | None = None) -> None:
        """Serve until `stop` is set, then drain (or, once `abort` is set too, abort what is
        still running) and leave: beat removed, engines stopped."""
        self._loop = asyncio.get_running_loop()
        self._wake, self._beat_now, self._sync_now = (
            asyncio.Event(),
            asyncio.Event(),
            asyncio.Event(),
        )
        await self._place()
        loops = [
            asyncio.create_task(self._send_loop(), name="orchard-worker-send"),
            asyncio.create_task(self._beat_loop(), name="orchard-worker-beat"),
            asyncio.create_task(self._receive_loop(), name="orchard-worker-receive"),
            asyncio.create_task(self._placement_loop(), name="orchard-worker-placement"),
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
            await self._flushed()
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
        self._draining = True
        self._beat_now.set()
        # Engine threads' state: polled, as nothing on this loop is told when it changes.
        while self._flights or self._tasks or not self.worker.is_idle():  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        await self._flushed()

    async def _flushed(self) -> None:
        for _ in range(500):
            with self._pending_lock:
                if not self._pending and not self._sending:
                    return
            await asyncio.sleep(0.01)

    async def _leave(self) -> None:
        senders = [task for _, task in self._senders.values()]
        for task in senders:
            task.cancel()
        await asyncio.gather(*senders, return_exceptions=True)
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
            self._spawn(self._call(message))
        elif kind == "registry.changed":
            self._sync_now.set()
        elif kind == "load":
            self._load(ModelSpec.from_dict(message["spec"]), force=bool(message.get("force")))
        elif kind == "unload":
            if self._allowed(message["model"]):
                self.worker.retire(message["model"])
                self._beat_now.set()
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
            self._post(
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
                request, lambda output: self._post(reply, ("out", request_id, output))
            )
        except Exception as exc:
            self._flights.pop(request_id, None)
            retry = isinstance(exc, ModelNotLoadedError | EngineOverloadedError)
            if not isinstance(exc, EngineError):
                logger.exception("request %s could not start", request_id)
            self._post(reply, ("rej", request_id, encode_error(exc, retry=retry)))
        finally:
            self._starting.pop(request_id, None)

    def _abort(self, model: str, request_id: str) -> None:
        if request_id in self._flights:
            self.worker.abort(model, request_id)
            return
        now = time.monotonic()
        self._early_aborts = {
            rid: at for rid, at in self._early_aborts.items() if now - at < EARLY_ABORT_TTL_S
        }
        self._early_aborts[request_id] = now

    async def _call(self, message: dict[str, Any]) -> None:
        op, reply, call_id = message["op"], message["reply"], message["call_id"]
        args = message.get("args", {})
        try:
            if op == "render":
                engine = self.worker.get(args["model"])
                rendered = await self.renderer.render(
                    engine.loaded.tokenizer,
                    PromptInput.from_dict(args["prompt"]),
                    checkpoints=engine.info.hybrid,
                    timeout_s=args.get("timeout_s"),
                )
                value: Any = {
                    "token_ids": list(rendered.token_ids),
                    "checkpoints": list(rendered.checkpoints),
                    "tail_text": rendered.tail_text,
                }
            elif op == "detokenize":
                tokenizer = self.worker.get(args["model"]).loaded.tokenizer
                value = await asyncio.to_thread(tokenizer.decode, list(args["token_ids"]))
            elif op == "clear_cache":
                try:
                    engine = self.worker.get(args["model"])
                except ModelNotLoadedError:
                    value = 0
                else:
                    value = await asyncio.wrap_future(engine.clear_prefix_cache())
            else:
                raise EngineError(f"unknown call {op!r}")
            result = {"value": value}
        except Exception as exc:
            if not isinstance(exc, EngineError):
                logger.exception("call %s failed", op)
            result = {"error": encode_error(exc)}
        self._post(reply, ("res", call_id, result))

    # Sending

    def _post(self, reply: str, event: tuple[str, str, Any]) -> None:
        """Queue an event for a web process (any thread; engine threads call it per token)."""
        with self._pending_lock:
            self._pending.append((reply, event))
            first = len(self._pending) == 1
        if first:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:
                pass  # the loop is closed: the process is exiting

    async def _send_loop(self) -> None:
        """Sort what the engine threads posted into one batch per web process and hand each
        to that process's sender: a web process that stops reading holds up only itself."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            with self._pending_lock:
                pending, self._pending = self._pending, []
                self._sending += 1
            try:
                batches: dict[str, list] = {}
                for reply, (kind, ident, payload) in pending:
                    if kind == "out":
                        self._note(ident, payload)
                        payload = encode_output(payload)
                    batches.setdefault(reply, []).append([kind, ident, payload])
                for reply, events in batches.items():
                    sender = self._senders.get(reply)
                    if sender is None or sender[1].done():
                        queue: asyncio.Queue = asyncio.Queue()
                        task = asyncio.create_task(self._sender(reply, queue))
                        sender = self._senders[reply] = (queue, task)
                    with self._pending_lock:
                        self._sending += 1
                    sender[0].put_nowait(events)
            finally:
                with self._pending_lock:
                    self._sending -= 1

    async def _sender(self, reply: str, queue: asyncio.Queue) -> None:
        """Send one web process its batches in order; ends after SENDER_IDLE_S without any."""
        while True:
            try:
                async with asyncio.timeout(SENDER_IDLE_S):
                    events = await queue.get()
            except TimeoutError:
                if queue.empty():
                    self._senders.pop(reply, None)
                    return
                continue
            try:
                # Whatever queued meanwhile goes in the same message.
                while not queue.empty():
                    more = queue.get_nowait()
                    events = events + more
                    with self._pending_lock:
                        self._sending -= 1
                await self._send(reply, events)
            finally:
                with self._pending_lock:
                    self._sending -= 1

    def _note(self, request_id: str, output: GenerationOutput) -> None:
        if output.finish_reason is None:
            return
        flight = self._flights.get(request_id)
        if flight is not None:
            flight.open -= 1
            if flight.open <= 0:
                del self._flights[request_id]

    async def _send(self, reply: str, events: list) -> None:
        seq = self._seq.get(reply, 0)
        self._seq[reply] = seq + 1
        message = {
            "type": "events",
            "worker": self.worker_id,
            "run": self.run_id,
            "seq": seq,
            "events": events,
        }
        deadline = time.monotonic() + SEND_RETRY_FOR_S
        while True:
            try:
                await self.layer.send(reply, message)
                return
            except ChannelFull:
                reason = "does not read its channel"
            except Exception as exc:
                # Redis away for a moment: the batch is kept and sent again.
                reason = f"cannot be reached ({type(exc).__name__}: {exc})"
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        logger.warning("%s %s; aborting its requests", reply, reason)
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
        for name in sorted(set(self._desired) | set(self.worker.names())):
            status = self.worker.status(name)
            beat = ModelBeat(
                name=name,
                state=status.state,
                spec=status.serving.to_dict() if status.serving else None,
                loading=status.loading.to_dict() if status.loading else None,
                error=status.error,
                failed_at=status.failed_at,
                failed_spec=status.failed_spec.to_dict() if status.failed_spec else None,
                stats=status.stats.to_dict() if status.stats else None,
                restarts=status.restarts,
            )
            if status.state == "serving":
                engine = self.worker.get(name)
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
            models[name] = beat
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
                model_filter=self.model_filter,
                models=models,
            ),
            ttl,
        )

    # Placement
    def _allowed(self, name: str) -> bool:
        return self.model_filter is None or name in self.model_filter

    async def _placement_loop(self) -> None:
        while True:
            try:
                async with asyncio.timeout(self.sync_s):
                    await self._sync_now.wait()
            except TimeoutError:
                pass
            self._sync_now.clear()
            try:
                await self._place()
            except Exception:
                logger.warning("could not follow the registry", exc_info=True)

    async def _place(self) -> None:
        """Serve what the registry enables (within --models); retire the rest, letting what
        it runs finish."""
        if self._draining:
            return
        specs = {spec.name: spec for spec in await self.desired() if self._allowed(spec.name)}
        self._desired = specs
        for spec in specs.values():
            try:
                future = self.worker.serve(spec)
            except ValueError as exc:
                self._log_failure(spec.name, str(exc))
                continue
            future.add_done_callback(lambda done, name=spec.name: self._loaded(name, done))
        for name in self.worker.names():
            if name not in specs:
                logger.info("no longer serving %s (registry)", name)
                self.worker.retire(name)
        await self.layer.group_add(registry_group(self.namespace), self.channel)
        self._beat_now.set()

    def _load(self, spec: ModelSpec, *, force: bool) -> None:
        if self._draining or not self._allowed(spec.name):
            return
        self.worker.load(spec, force=force).add_done_callback(
            lambda done: self._loaded(spec.name, done)
        )

    def _loaded(self, name: str, done) -> None:
        if done.cancelled():
            return
        if done.exception() is None:
            if self._load_errors.pop(name, None) is not None or name not in self._versions:
                logger.info("serving %s", name)
        else:
            self._log_failure(name, str(done.exception()))
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._beat_now.set)
            except RuntimeError:
                pass

    def _log_failure(self, name: str, error: str) -> None:
        if self._load_errors.get(name) != error:
            self._load_errors[name] = error
            logger.error("model %s could not be loaded: %s", name, error)
