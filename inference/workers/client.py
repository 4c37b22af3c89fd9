"""RemoteEngineClient: the web process's `EngineClient` when engines run in `runengine` workers.

Routing: each request goes to a live, non-draining worker serving its model, the one with the
least load (its last beat's queue + running from other web processes, plus what this process
has in flight there now), unless its prompt continues one that ran on another worker that is
not much busier (prefix affinity: that worker's prefix cache holds the conversation so far);
preferring workers on the registry's current spec. A worker that refuses a request it could not
run (draining, not serving the model, overloaded) hands it to the next one.

Prompts render here, with the model's tokenizer read from its registry path (tokenizer files
only, no weights), so a request costs no extra round trip; where the web host cannot read the
files, the worker renders instead (one round trip).

Token events arrive on one reply channel per process, numbered per worker: they are put back in
order, and a message that never arrives (the channel layer drops what expires or overflows) is
skipped after GAP_TIMEOUT_S; each choice's last event carries the engine's count of generated
tokens, so a reply that lost events ends with an error instead of passing as complete.

A worker whose beat has not moved for `timeout_s` is dead: its requests end with an error (their
usage rows finish as failed, in the web process that owns them) and it leaves routing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from asgiref.sync import async_to_sync

from engine import (
    Embedders,
    EmbeddingInfo,
    EngineClient,
    EngineStats,
    GenerationOutput,
    GenerationRequest,
    ModelInfo,
    ModelLoadError,
    ModelNotLoadedError,
    ModelSpec,
    ModelStatus,
    ModelUnavailableError,
    PromptInput,
    PromptRenderer,
    RenderedPrompt,
)
from inference.workers.beats import BeatStore, WorkerBeat, model_status, sum_stats
from inference.workers.ordering import EventOrder, PrefixAffinity
from inference.workers.wire import (
    decode_error,
    decode_output,
    registry_group,
    reply_prefix,
    worker_channel,
)

logger = logging.getLogger(__name__)

# A request its worker's beats stop listing is given up this long after (its last events may
# still be on the way); a beat is taken to know of a request sent SEND_LATENCY_S before it.
SETTLE_GRACE_S = 2.0
SEND_LATENCY_S = 0.5
# A web process asks the workers to re-read the registry at most this often per model.
NUDGE_EVERY_S = 5.0
# A remembered worker (prefix affinity) is kept while it has at most this many more requests
# than the least loaded.
AFFINITY_SLACK = 2
CALL_TIMEOUT_S = 30.0
# After asking the workers to look at the registry, how long a model nobody serves may take to
# show up as loading somewhere before the request is refused.
PLACEMENT_GRACE_S = 3.0
ERROR_LOST = "Part of this reply was lost between the engine worker and the web server."
ERROR_WORKER_GONE = "The engine worker serving this request stopped responding."


@dataclass
class _Worker:
    beat: WorkerBeat
    seen_seq: int
    seen_at: float  # time.monotonic() when its beat number last moved
    confirmed: bool  # its beat is fresh (seen moving, or recent by the wall clock)


@dataclass
class _Flight:
    request: GenerationRequest
    worker_id: str
    run_id: str = ""
    sent_at: float = field(default_factory=time.monotonic)
    missing_since: float | None = None  # its worker's beats stopped listing it
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    received: dict[int, int] = field(default_factory=dict)  # tokens per choice
    finished: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Rejected:
    error: dict[str, Any]


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
    ):
        from channels.layers import get_channel_layer

        self.embedders = Embedders()  # embedding models run in the web process
        self.renderer = PromptRenderer()
        self.store = store
        self.namespace = namespace
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self.load_wait_s = load_wait_s
        self.refresh_s = min(0.5, heartbeat_s / 2)
        self._layer_factory = layer_factory or get_channel_layer
        self._layer = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reply: str | None = None
        self._starting: asyncio.Lock | None = None
        self._tasks: list[asyncio.Task] = []
        self._background: set[asyncio.Task] = set()
        self._workers: dict[str, _Worker] = {}
        self._snapshot: tuple[float, list[WorkerBeat]] = (0.0, [])  # for other threads
        self._orders: dict[tuple[str, str], EventOrder] = {}  # per worker run
        self._flights: dict[str, _Flight] = {}
        self._calls: dict[str, tuple[asyncio.Future, str]] = {}
        self._infos: dict[tuple[str, str], tuple[str, ModelInfo]] = {}
        self._tokenizers: dict[tuple[str, int], Any] = {}
        self._wanted: dict[str, ModelSpec] = {}
        self._nudged: dict[str, float] = {}
        self._affinity = PrefixAffinity()

    # Starting
    async def _started(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._reply is not None:
            return
        if self._loop is not None and self._loop is not loop and not self._loop.is_closed():
            raise RuntimeError("a RemoteEngineClient serves the one event loop it started on")
        if self._loop is not loop:
            self._loop, self._reply, self._starting = loop, None, asyncio.Lock()
        async with self._starting:
            if self._reply is not None:
                return
            self._layer = self._layer_factory()
            reply = await self._layer.new_channel(reply_prefix(self.namespace))
            self._workers, self._orders = {}, {}
            await self._refresh()  # raises while Redis is away: nothing started, nothing leaks
            self._reply = reply
            self._tasks = [
                asyncio.create_task(self._receive_loop(reply), name="orchard-remote-receive"),
                asyncio.create_task(self._refresh_loop(), name="orchard-remote-refresh"),
            ]

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
            self._close_gaps()

    async def _refresh(self) -> None:
        self._update(await self.store.read_all())

    def _update(self, beats: list[WorkerBeat]) -> None:
        now, wall = time.monotonic(), time.time()
        seen = set()
        for beat in beats:
            seen.add(beat.worker_id)
            known = self._workers.get(beat.worker_id)
            if known is not None and known.beat.run_id != beat.run_id:
                self._lost(beat.worker_id)  # restarted under the same id: its requests died
                known = None
            if known is None:
                fresh = abs(wall - beat.at) < self.timeout_s
                self._workers[beat.worker_id] = _Worker(beat, beat.seq, now, confirmed=fresh)
            elif beat.seq != known.seen_seq:
                known.beat, known.seen_seq, known.seen_at, known.confirmed = (
                    beat,
                    beat.seq,
                    now,
                    True,
                )
        for worker_id, known in list(self._workers.items()):
            if worker_id not in seen or now - known.seen_at > self.timeout_s:
                self._lost(worker_id)
        self._settle(now)
        self._snapshot = (now, [w.beat for w in self._workers.values() if w.confirmed])

    def _settle(self, now: float) -> None:
        """End the requests whose worker no longer lists them in its beats although their
        last events never came (lost on the way, a Redis outage say): after SETTLE_GRACE_S
        more, those that got nothing yet go to another worker, the others end with an error.
        A beat seen well after a request was sent lists it until its last events are out."""
        for flight in list(self._flights.values()):
            known = self._workers.get(flight.worker_id)
            if known is None or known.seen_at - self.refresh_s - SEND_LATENCY_S < flight.sent_at:
                continue
            listed = flight.request.request_id in known.beat.open_requests.get(self._reply, ())
            if listed or len(flight.finished) == flight.request.sampling.n:
                flight.missing_since = None
            elif flight.missing_since is None:
                flight.missing_since = now
            elif now - flight.missing_since > SETTLE_GRACE_S:
                self._give_up(flight, ERROR_LOST)

    def _give_up(self, flight: _Flight, error: str) -> None:
        """End what is left of a request its worker will not finish."""
        if not flight.received and not flight.finished:
            # Nothing came back yet: the request may never have reached it; another worker
            # takes it.
            flight.finished.update(range(flight.request.sampling.n))
            flight.queue.put_nowait(_Rejected({"retry": True, "message": error}))
            return
        for index in range(flight.request.sampling.n):
            if index not in flight.finished:
                flight.finished.add(index)
                flight.queue.put_nowait(self._error_output(flight, index, error))

    def _lost(self, worker_id: str) -> None:
        """A worker stopped beating: end what it held with an error; it leaves routing."""
        known = self._workers.pop(worker_id, None)
        for key in [k for k in self._orders if k[0] == worker_id]:
            del self._orders[key]
        for key in [k for k in self._infos if k[0] == worker_id]:
            del self._infos[key]
        flights = [f for f in self._flights.values() if f.worker_id == worker_id]
        if known is not None and (flights or known.confirmed):
            logger.warning(
                "engine worker %s is gone; ending %d request(s)", worker_id, len(flights)
            )
        for flight in flights:
            self._give_up(flight, ERROR_WORKER_GONE)
        for future, target in list(self._calls.values()):
            if target == worker_id and not future.done():
                future.set_exception(ModelNotLoadedError(ERROR_WORKER_GONE))

    @staticmethod
    def _error_output(flight: _Flight, index: int, error: str) -> GenerationOutput:
        return GenerationOutput(
            index=index,
            text="",
            token_ids=(),
            finish_reason="error",
            num_prompt_tokens=len(flight.request.prompt_token_ids),
            error=error,
        )

    def _live(self) -> list[_Worker]:
        return [w for w in self._workers.values() if w.confirmed]

    def _serving(self, model: str) -> list[_Worker]:
        return [
            w
            for w in self._live()
            if not w.beat.draining
            and (beat := w.beat.models.get(model)) is not None
            and beat.state == "serving"
        ]

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
                self._arrived(message)
            except Exception:
                logger.exception("bad engine message: %.200r", message)

    def _arrived(self, message: dict) -> None:
        key = (message["worker"], message.get("run", ""))
        ready = self._orders.setdefault(key, EventOrder()).arrive(message, time.monotonic())
        if ready is None:
            logger.warning("dropping a late message %d from %s", message["seq"], key[0])
        for each in ready or ():
            self._apply(each)

    def _close_gaps(self) -> None:
        now = time.monotonic()
        for (worker_id, _), order in self._orders.items():
            if ready := order.skip_gap(now):
                logger.warning("messages before %d from %s never came", ready[0]["seq"], worker_id)
                for each in ready:
                    self._apply(each)

    def _apply(self, message: dict) -> None:
        worker_id, run_id = message["worker"], message.get("run", "")
        for kind, ident, payload in message["events"]:
            if kind == "res":
                entry = self._calls.get(ident)
                if entry is not None and not entry[0].done():
                    entry[0].set_result(payload)
                continue
            flight = self._flights.get(ident)
            if flight is None or (flight.worker_id, flight.run_id) != (worker_id, run_id):
                continue  # its caller has gone, or it was handed to another worker
            if kind == "rej":
                flight.queue.put_nowait(_Rejected(payload))
                continue
            output = decode_output(payload)
            if output.index in flight.finished:
                continue  # ended already (its worker was given up for dead)
            received = flight.received.get(output.index, 0) + len(output.token_ids)
            flight.received[output.index] = received
            if output.finish_reason is not None:
                flight.finished.add(output.index)
                if output.num_generated_tokens > received:
                    output = dataclasses.replace(output, finish_reason="error", error=ERROR_LOST)
            flight.queue.put_nowait(output)

    # Models
    async def serving_model(self, spec: ModelSpec) -> ModelInfo:
        await self._started()
        self._wanted[spec.name] = spec
        return await self._wait_for(spec, exact=False)

    async def ensure_model(self, spec: ModelSpec) -> ModelInfo:
        await self._started()
        self._wanted[spec.name] = spec
        return await self._wait_for(spec, exact=True)

    async def _wait_for(self, spec: ModelSpec, *, exact: bool) -> ModelInfo:
        deadline = time.monotonic() + self.load_wait_s
        nudged_at: float | None = None
        # Since when no live worker has listed the model as loading: a worker that is out of
        # routing for a moment (its beats late while it loads a tokenizer, say) restarts the
        # clock when it comes back, so two short gaps do not add up to a refusal.
        absent_since: float | None = None
        wanted = spec.to_dict()
        while True:
            serving = self._serving(spec.name)
            matching = [w for w in serving if w.beat.models[spec.name].spec == wanted]
            if serving and not matching and nudged_at is None:
                await self._nudge(spec.name)  # the workers load the new spec beside the old
                nudged_at = time.monotonic()
            group = matching if exact else (matching or serving)
            infos = [info for w in group if (info := await self._info(w, spec.name)) is not None]
            if infos:
                return min(infos, key=lambda i: i.max_request_tokens or math.inf)
            beats = [b for w in self._live() if (b := w.beat.models.get(spec.name)) is not None]
            if any(b.state == "loading" for b in beats) or serving:
                absent_since = None
            else:
                failed = [b for b in beats if b.error]
                if failed:
                    raise ModelLoadError(failed[0].error)
                now = time.monotonic()
                if absent_since is None:
                    absent_since = now
                if nudged_at is None:
                    await self._nudge(spec.name)
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

    async def _info(self, worker: _Worker, model: str) -> ModelInfo | None:
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

    async def _nudge(self, model: str = "") -> None:
        now = time.monotonic()
        if now - self._nudged.get(model, -math.inf) < NUDGE_EVERY_S:
            return
        self._nudged[model] = now
        try:
            await self._layer.group_send(
                registry_group(self.namespace), {"type": "registry.changed"}
            )
        except Exception:
            logger.warning("could not reach the engine workers", exc_info=True)

    def place_models(self, specs: list[ModelSpec], *, load_new: bool = True) -> None:
        """The workers read the registry themselves: tell them to look now."""
        self._group_send_sync({"type": "registry.changed"})

    def start_loading(self, spec: ModelSpec, *, force: bool = False) -> None:
        self._group_send_sync({"type": "load", "spec": spec.to_dict(), "force": force})

    async def unload_model(self, name: str) -> None:
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
        at, beats = self._snapshot
        if time.monotonic() - at < 2 * self.refresh_s + 1:
            return list(beats)
        wall = time.time()
        return [b for b in self.store.read_all_sync() if abs(wall - b.at) < self.timeout_s]

    def model_status(self, name: str) -> ModelStatus:
        return model_status(name, self.workers())

    def clear_prefix_cache(self, name: str, timeout: float = 30.0) -> int:
        return async_to_sync(self._clear_prefix_cache)(name, timeout)

    async def _clear_prefix_cache(self, name: str, timeout_s: float) -> int:
        await self._started()
        workers = self._serving(name)
        results = await asyncio.gather(
            *(self._call(w, "clear_cache", {"model": name}, timeout_s) for w in workers),
            return_exceptions=True,
        )
        return sum(r for r in results if isinstance(r, int))

    async def stats(self) -> list[EngineStats]:
        await self._started()
        names = sorted({name for w in self._live() for name in w.beat.models})
        stats = [
            sum_stats(name, [b for w in self._serving(name) if (b := w.beat.models[name])])
            for name in names
        ]
        return [s for s in stats if s is not None]

    # Prompts
    async def render_prompt(
        self, model: str, prompt: PromptInput, *, timeout_s: float | None = None
    ) -> RenderedPrompt:
        worker, info = await self._any_serving(model)
        spec = worker.beat.models[model].model_spec()
        tokenizer = await self._tokenizer(spec, info)
        if tokenizer is not None:
            return await self.renderer.render(
                tokenizer, prompt, checkpoints=info.hybrid, timeout_s=timeout_s
            )
        args = {"model": model, "prompt": prompt.to_dict(), "timeout_s": timeout_s}
        value = await self._call(worker, "render", args, (timeout_s or CALL_TIMEOUT_S) + 2)
        return RenderedPrompt(
            tuple(value["token_ids"]), tuple(value["checkpoints"]), value["tail_text"]
        )

    async def detokenize(self, model: str, token_ids: list[int]) -> str:
        worker, info = await self._any_serving(model)
        tokenizer = await self._tokenizer(worker.beat.models[model].model_spec(), info)
        if tokenizer is not None:
            return await asyncio.to_thread(tokenizer.decode, list(token_ids))
        return await self._call(worker, "detokenize", {"model": model, "token_ids": token_ids})

    async def _any_serving(self, model: str) -> tuple[_Worker, ModelInfo]:
        await self._started()
        workers = self._serving(model)
        wanted = self._wanted.get(model)
        if wanted is not None:
            workers.sort(key=lambda w: w.beat.models[model].spec != wanted.to_dict())
        for worker in workers:
            info = await self._info(worker, model)
            if info is not None:
                return worker, info
        raise ModelNotLoadedError(f"The model {model!r} is not loaded.")

    async def _tokenizer(self, spec: ModelSpec, info: ModelInfo):
        """The model's tokenizer read here, or None when this host cannot read its files."""
        folder = Path(spec.path)
        marker = next(
            (
                folder / n
                for n in ("tokenizer.json", "tokenizer_config.json")
                if (folder / n).is_file()
            ),
            None,
        )
        if marker is None:
            return None
        key = (str(folder), marker.stat().st_mtime_ns)
        if key not in self._tokenizers:
            self._tokenizers[key] = await asyncio.to_thread(_load_tokenizer, folder, info)
        return self._tokenizers[key]

    async def _call(self, worker: _Worker, op: str, args: dict, timeout_s: float = CALL_TIMEOUT_S):
        call_id = secrets.token_hex(8)
        future = asyncio.get_running_loop().create_future()
        self._calls[call_id] = (future, worker.beat.worker_id)
        try:
            await self._layer.send(
                worker_channel(self.namespace, worker.beat.worker_id),
                {"type": "call", "op": op, "args": args, "reply": self._reply, "call_id": call_id},
            )
            result = await asyncio.wait_for(future, timeout_s)
        finally:
            self._calls.pop(call_id, None)
        if "error" in result:
            raise decode_error(result["error"])
        return result["value"]

    # Embeddings (served in this process for now)
    async def embedding_model(self, spec: ModelSpec) -> EmbeddingInfo:
        return (await asyncio.to_thread(self.embedders.get, spec.name, spec.path)).info

    async def tokenize(self, model: str, texts: list[str]) -> list[list[int]]:
        return await asyncio.to_thread(self.embedders.running(model).tokenize, texts)

    async def embed(self, model: str, token_ids: list[list[int]]):
        return await asyncio.wrap_future(self.embedders.running(model).submit(token_ids))

    # Generating
    def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        return self._generate(request)

    def _route(self, model: str, exclude: set[str], prompt: tuple[int, ...] = ()) -> _Worker | None:
        candidates = [w for w in self._serving(model) if w.beat.worker_id not in exclude]
        wanted = self._wanted.get(model)
        if wanted is not None:
            matching = [w for w in candidates if w.beat.models[model].spec == wanted.to_dict()]
            candidates = matching or candidates
        if not candidates:
            return None

        def load(worker: _Worker) -> tuple[int, float]:
            beat = worker.beat.models[model]
            others = max(0, beat.load - beat.by_reply.get(self._reply, 0))
            mine = sum(
                f.request.sampling.n - len(f.finished)
                for f in self._flights.values()
                if f.worker_id == worker.beat.worker_id and f.request.model == model
            )
            return others + mine, random.random()

        loads = {w.beat.worker_id: load(w) for w in candidates}
        best = min(candidates, key=lambda w: loads[w.beat.worker_id])
        # A prompt that continues one this process sent goes where that one ran (its prefix
        # cache holds it), unless that worker is busier than the least loaded by more than
        # AFFINITY_SLACK requests.
        by_id = {w.beat.worker_id: w for w in candidates}
        worker_id = self._affinity.lookup(model, prompt)
        if (
            worker_id in by_id
            and loads[worker_id][0] <= loads[best.beat.worker_id][0] + AFFINITY_SLACK
        ):
            return by_id[worker_id]
        return best

    async def _generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        await self._started()
        tried: set[str] = set()
        while True:
            worker = self._route(request.model, tried, request.prompt_token_ids)
            if worker is None:
                raise ModelUnavailableError(
                    f"No engine worker serves the model '{request.model}' now; please retry "
                    "shortly."
                )
            worker_id = worker.beat.worker_id
            flight = _Flight(request, worker_id, worker.beat.run_id)
            self._flights[request.request_id] = flight
            message = {
                "type": "generate",
                "request": request.to_dict(),
                "reply": self._reply,
                "run": worker.beat.run_id,
            }
            try:
                await self._layer.send(worker_channel(self.namespace, worker_id), message)
            except Exception as exc:
                self._flights.pop(request.request_id, None)
                logger.warning("could not send to engine worker %s: %s", worker_id, exc)
                tried.add(worker_id)
                continue
            except BaseException:
                # Cancelled while sending (the client left): it may have arrived.
                self._flights.pop(request.request_id, None)
                self._abort_on(worker_id, request)
                raise
            try:
                first = await flight.queue.get()
            except BaseException:
                self._flights.pop(request.request_id, None)
                self._abort_on(worker_id, request)
                raise
            if isinstance(first, _Rejected):
                self._flights.pop(request.request_id, None)
                if first.error.get("retry"):
                    tried.add(worker_id)
                    continue
                raise decode_error(first.error)
            self._affinity.remember(request.model, request.prompt_token_ids, worker_id)
            break
        num_open = request.sampling.n
        try:
            item = first
            while True:
                if isinstance(item, _Rejected):
                    raise decode_error(item.error)
                if item.finish_reason is not None:
                    num_open -= 1
                yield item
                if not num_open:
                    break
                item = await flight.queue.get()
        finally:
            self._flights.pop(request.request_id, None)
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

    async def _abort_all(self, flights: list[_Flight]) -> None:
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
        flight = self._flights.get(request_id)
        if flight is not None:
            self._abort_on(flight.worker_id, flight.request)

    # Stopping
    async def shutdown(self) -> None:
        flights = list(self._flights.values())
        self._flights.clear()
        if flights and self._layer is not None:
            await self._abort_all(flights)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks, self._reply = [], None
        await self.store.aclose()
        self.close()

    def close(self, timeout: float | None = None) -> None:
        """For an atexit hook (the event loop has stopped): abort on their workers the requests
        still in flight, so nothing generates for a web process that is gone."""
        flights = list(self._flights.values())
        self._flights.clear()
        if flights and self._layer is not None:
            try:
                asyncio.run(asyncio.wait_for(self._abort_all(flights), timeout or 5))
            except Exception:
                logger.warning("could not abort %d request(s) on their workers", len(flights))
        self.renderer.close()
        self.embedders.stop()
        self.store.close()


def _load_tokenizer(folder: Path, info: ModelInfo):
    from engine import load_tokenizer

    try:
        return load_tokenizer(folder, eos_token_ids=list(info.eos_token_ids))[0]
    except Exception as exc:
        logger.warning("cannot read the tokenizer at %s here (%s); workers render", folder, exc)
        return None
