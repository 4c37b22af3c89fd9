"""The engine loop both engines share: one thread per model, schedule → run → update.

`EngineLoop` owns the thread (which also loads the model, so only it touches MLX), a thread-safe
inbox for new requests and aborts, admission (validation and the waiting-queue limit, raised on
the caller's thread before any work; the request's sampling state, which holds MLX arrays, is
built later on the engine thread), turning sampled tokens into `GenerationOutput` events
(engine/core/outputs.py says what they hold), and stats (engine/core/meter.py). A failure while
serving a request ends that request (or, if a step itself fails, the running batch) with
finish_reason "error" and the loop goes on; if the loop itself dies, the engine stops serving and
everything it held ends with "error". The engines are in engine/core/batched.py (continuous
batching) and engine/core/simple.py (serialized).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import engine  # noqa: F401  (OpenBLAS before mlx)

# isort: split
import mlx.core as mx

from engine.cache.budget import MemoryBudget
from engine.cache.disk import PrefixDiskConfig
from engine.cache.memory import plan_caches
from engine.cache.mlx_caches import CacheLayout
from engine.cache.prefix import PrefixCache
from engine.core.meter import Meter
from engine.core.outputs import emit_end, end_queued, token_output
from engine.core.request import Emit, Request, Sequence
from engine.core.sampled import Sampled
from engine.core.sampling import SamplingState
from engine.core.turns import ComputeTurns
from engine.models.loader import LoadedModel
from engine.models.vision import check_images
from engine.protocol import (
    EngineOverloadedError,
    EngineStats,
    GenerationRequest,
    ModelInfo,
    ModelNotLoadedError,
    ModelSpec,
    RequestStatus,
    completion_budget,
    describe,
    validate_generation,
)
from engine.text.detokenizer import StreamDetokenizer
from engine.text.grammar import Grammars

logger = logging.getLogger(__name__)

STOP = object()  # inbox command: end the loop, aborting what is in flight
DRAIN = object()  # inbox command: end the loop once what is in flight has finished
CLEAR = object()  # inbox command: empty the prefix cache


class EngineLoop:
    """Base of the engines: lifecycle, inbox, admission, output events, stats."""

    COHORTS = False  # whether the engine's decode batch keeps length cohorts
    IMAGES = False  # whether it runs a vision model's image prompts

    def __init__(self, spec: ModelSpec, load: Callable[[], LoadedModel]):
        self.spec = spec
        self._load = load
        self.loaded: LoadedModel | None = None
        self._grammars: Grammars | None = None
        self.ready: concurrent.futures.Future[ModelInfo] = concurrent.futures.Future()
        # Resolves when the thread's loop has ended: with None after a stop or a drain, with
        # the reason when the loop died (the worker restarts such an engine).
        self.ended: concurrent.futures.Future[str | None] = concurrent.futures.Future()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._num_queued = 0  # submitted, not yet seen by the engine thread
        self._num_waiting = 0  # seen, not yet running (published by the engine thread)
        # The same per tenant (ServiceClass.tenant): the waiting queue is shared fairly.
        self._queued_tenants: Counter[str] = Counter()
        self._waiting_tenants: Mapping[str, int] = {}
        self._num_running = 0
        self.kv_cache_bytes = 0  # the running sequences' caches (published by the engine thread)
        self._closing = False  # set by drain or the loop ending: submit refuses from then on
        self._draining = False  # engine thread only
        self.leftover: list = []  # commands taken with a STOP, after it (engine thread only)
        self._meter = Meter()
        # The caches' budget the worker's memory budget granted (None: sized from the device's
        # memory), and the weights' bytes as loaded (set by `setup_caches`).
        self.cache_bytes: int | None = None
        self.weights_bytes = 0
        # Set on the engine thread by `setup_caches`.
        self.layout: CacheLayout | None = None
        self.memory: MemoryBudget | None = None
        self.prefix_cache: PrefixCache | None = None
        self.prefix_disk: PrefixDiskConfig | None = None  # the prefix cache's disk tier, if any
        self.compute_turns = ComputeTurns()  # the worker's, shared by its engines (turns.py)
        # The batch's length cohorts' padding limit (engine/cache/cohorts.py); None: one batch.
        self.cohort_pad: int | None = None
        self._thread = threading.Thread(
            target=self._main, name=f"orchard-engine-{spec.name}", daemon=True
        )

    @property
    def info(self) -> ModelInfo:
        return self.ready.result()

    @property
    def grammars(self) -> Grammars:
        """The model's structured-output grammars (made on first use, once loaded)."""
        with self._lock:
            if self._grammars is None:
                loaded = self.loaded
                self._grammars = Grammars(
                    loaded.tokenizer, loaded.info.vocab_size, loaded.info.eos_token_ids
                )
            return self._grammars

    @property
    def is_serving(self) -> bool:
        """Loaded, and neither retired nor dead: new requests may be submitted."""
        return self.ready.done() and self.ready.exception() is None and not self._closing

    def is_alive(self) -> bool:
        """Whether the thread is still running (loading, serving or draining)."""
        return self._thread.is_alive()

    def start(self) -> concurrent.futures.Future[ModelInfo]:
        self._thread.start()
        return self.ready

    def stop(self, timeout: float | None = None) -> None:
        """Abort everything in flight and join the thread."""
        if self._thread.is_alive():
            with self._lock:
                self._closing = True  # a request submitted from now on is refused, not lost
            self._inbox.put((STOP, None))
            self._thread.join(timeout)
        if not self._thread.is_alive():
            _wait_until_gone(self._thread)

    def drain(self) -> None:
        """Refuse new requests and let the thread end once those in flight have finished
        (thread-safe, returns at once): how a replaced engine retires without aborting anyone."""
        with self._lock:
            self._closing = True
            self._inbox.put((DRAIN, None))

    def submit(self, spec: GenerationRequest, emit: Emit) -> None:
        """Queue a request (thread-safe); bad input and a full queue raise here, before any work,
        and ModelNotLoadedError once the engine is retired or dead.

        `emit` is called on the engine thread for every output event; it must not block.
        """
        max_tokens = self.check(spec)
        with self._lock:
            if self._closing:
                raise ModelNotLoadedError(f"The model {self.spec.name!r} is not loaded.")
            if self._queue_full(spec.service.tenant):
                raise EngineOverloadedError(f"Model {self.spec.name} is overloaded; retry later.")
            self._num_queued += 1
            self._queued_tenants[spec.service.tenant] += 1
            # Under the lock, so a request is queued before the loop's end drains the inbox.
            self._inbox.put(("add", (spec, emit, max_tokens)))

    def _queue_full(self, tenant: str) -> bool:
        """Under the lock: whether a request of `tenant` finds the waiting queue full. The queue
        holds `max_waiting` requests; past that a tenant may still queue up to its share of
        `max_waiting` among the tenants waiting (itself included), so one team's flood never
        locks the others out (at most twice `max_waiting` wait in all)."""
        limit = self.spec.max_waiting
        if self._num_queued + self._num_waiting < limit:
            return False
        waiting = Counter(self._waiting_tenants)
        waiting.update(self._queued_tenants)
        tenants = {t for t, n in waiting.items() if n > 0} | {tenant}
        return waiting[tenant] >= limit / len(tenants)

    def has_requests(self) -> bool:
        """Whether any request is queued, waiting or running (thread-safe)."""
        with self._lock:
            return bool(self._num_queued or self._num_waiting or self._num_running)

    def abort(self, request_id: str) -> None:
        """Abort a request (thread-safe); a no-op when it has finished or is unknown."""
        self._inbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        with self._lock:
            num_waiting, num_running = self._num_queued + self._num_waiting, self._num_running
        stats = self._meter.snapshot(self.spec.name, num_waiting, num_running)
        # Plain ints written by the engine thread: a snapshot a moment old at worst.
        cache = self.prefix_cache.stats().to_dict() if self.prefix_cache is not None else {}
        drafted, accepted = self.draft_counts()
        preemptions, tenants = self.fair_share_stats()
        return dataclasses.replace(
            stats,
            kv_cache_bytes=self.kv_cache_bytes,
            num_preemptions=preemptions,
            tenants=tenants,
            num_draft_tokens=drafted,
            num_accepted_draft_tokens=accepted,
            num_cached_prompt_tokens=cache.get("hit_tokens", 0),
            prefill_chunk_tokens=self.prefill_chunk_tokens(),
            memory_budget_bytes=self.memory.max_bytes if self.memory else 0,
            prefix_cache=cache,
        )

    def prefill_chunk_tokens(self) -> int:
        """Prefill tokens per step while others decode (0: no limit)."""
        return 0

    def fair_share_stats(self) -> tuple[int, dict]:
        """Preemptions since load, and the per-tenant counts of engine/core/fairness.py."""
        return 0, {}

    def draft_counts(self) -> tuple[int, int]:
        """Speculative decoding's draft tokens checked and accepted (engine/core/speculative.py)."""
        return 0, 0

    def clear_prefix_cache(self) -> concurrent.futures.Future[int]:
        """Empty the prefix cache (on the engine thread) and hand its memory back to the
        system; resolves with the bytes freed."""
        future: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._inbox.put((CLEAR, future))
        return future

    def _clear_prefix_cache(self, future: concurrent.futures.Future[int]) -> None:
        freed = self.prefix_cache.clear() if self.prefix_cache is not None else 0
        mx.clear_cache()  # the allocator's free list, else the memory stays with the process
        future.set_result(freed)

    def check(self, spec: GenerationRequest) -> int:
        """Validate a request without touching MLX (any thread); return its max_tokens. The web
        side has done both already; they are done again here because a bad token id reaching
        the device corrupts other requests, and with the same functions, so the two agree."""
        validate_generation(spec, self.info)
        if spec.images:
            check_images(spec, self.loaded.vision, self.memory)
        return completion_budget(
            num_prompt_tokens=len(spec.prompt_token_ids),
            context_length=self.info.context_length,
            max_tokens=spec.sampling.max_tokens,
        )

    def compile_grammar(self, grammar: str) -> None:
        """Compile (and cache) a request's grammar before it is submitted (any thread; it may
        take a while for a large schema): InvalidRequestError if it is refused."""
        self.ready.result()
        self.grammars.constraint(grammar)

    def make_request(self, spec: GenerationRequest, emit: Emit) -> Request:
        """Validate and build a request: on the engine thread only (it creates MLX arrays)."""
        return self.build(spec, emit, self.check(spec))

    def build(self, spec: GenerationRequest, emit: Emit, max_tokens: int) -> Request:
        info, tokenizer, params = self.info, self.loaded.tokenizer, spec.sampling
        request = Request(spec, emit, max_tokens=max_tokens)
        if spec.images:
            self.loaded.vision.prepare(request)
        if self.prefix_cache is not None and self.prefix_cache.hybrid:
            # Only the recurrent state needs taking at a boundary; attention layers' keys and
            # values are cut from anywhere.
            body = len(spec.prompt_token_ids) - 1
            request.checkpoints = tuple(sorted({c for c in spec.checkpoints if 0 < c < body}))
        for index in range(params.n):
            state = SamplingState(
                params,
                prompt_token_ids=spec.prompt_token_ids,
                eos_token_ids=info.eos_token_ids,
                vocab_size=info.vocab_size,
                choice_index=index,
            )
            detokenizer = StreamDetokenizer(
                tokenizer, stop=params.stop, keep=params.keep_special_tokens
            )
            sequence = Sequence(request, index, state, detokenizer)
            if params.grammar is not None:
                sequence.constraint = self.grammars.constraint(params.grammar)
            request.sequences.append(sequence)
        return request

    def admit(self, payload: tuple[GenerationRequest, Emit, int]) -> Request | None:
        """Build a queued request on the engine thread; None (and "error" sent) if that fails."""
        spec, emit, max_tokens = payload
        try:
            return self.build(spec, emit, max_tokens)
        except Exception as exc:
            logger.exception("could not start request %s", spec.request_id)
            end_queued(payload, RequestStatus.FINISHED_ERROR, describe(exc))
            return None

    def _main(self) -> None:
        try:
            self.loaded = self._load()
            self.setup()
        except BaseException as exc:
            self.ready.set_exception(exc)
            self.ended.set_result(None)
            return
        self.ready.set_result(self.serving_info(self.loaded.info))
        status, error = RequestStatus.FINISHED_ABORTED, None
        try:
            self.run()
        except BaseException as exc:
            # A bug outside any one request's handling: end everything cleanly rather than
            # leave callers waiting on a thread that is gone.
            logger.exception("engine loop for %s died", self.spec.name)
            status, error = RequestStatus.FINISHED_ERROR, f"engine stopped: {describe(exc)}"
        finally:
            with self._lock:
                self._closing = True
            try:
                self.close(status, error)
            finally:
                self._release()
                self.ended.set_result(error)

    def _take(self, block: bool) -> list:
        """Commands from the inbox: all that are there, waiting for the first one if `block`."""
        commands = []
        try:
            commands.append(self._inbox.get(block=block))
            while True:
                commands.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        added = [payload[0].service.tenant for kind, payload in commands if kind == "add"]
        if added:
            with self._lock:
                self._num_queued -= len(added)
                self._queued_tenants.subtract(added)
                self._queued_tenants += Counter()  # drops the tenants at zero
        return commands

    def _publish(
        self,
        num_waiting: int,
        num_running: int,
        *,
        waiting: Iterable[Request] = (),
    ) -> None:
        """The engine thread's counts, for other threads: requests waiting (`waiting`, to
        count them per tenant) and rows running."""
        tenants = Counter(request.spec.service.tenant for request in waiting)
        with self._lock:
            self._num_waiting, self._num_running = num_waiting, num_running
            self._waiting_tenants = tenants

    def accept(self, sampled: Sampled) -> None:
        """Record one sampled token: stop checks, text, and the event for the caller."""
        output = token_output(sampled, self.info.eos_token_ids, self.loaded.tokenizer)
        self._meter.num_generated_tokens += 1
        sampled.seq.request.emit(output)

    @staticmethod
    def finish(request: Request, status: RequestStatus, error: str | None = None) -> None:
        """End every live sequence of a request with `status` and tell the caller."""
        for seq in request.live_sequences():
            seq.status = status
            emit_end(
                request.spec, request.emit, seq.index, status, error, len(seq.output_token_ids)
            )

    def setup(self) -> None:
        """Build per-model state on the engine thread, after loading."""

    def setup_caches(self) -> None:
        """On the engine thread: the model's cache layout, memory budget and prefix cache."""
        plan = plan_caches(
            self.spec,
            self.loaded.model,
            cache_bytes=self.cache_bytes,
            prefix_disk=self.prefix_disk,
            cohorts=self.COHORTS,
        )
        self.kv_quant, self.layout, self.cohort_pad = plan.kv_quant, plan.layout, plan.cohort_pad
        self.weights_bytes = plan.weights_bytes
        self.memory, self.prefix_cache = plan.memory, plan.prefix_cache

    def serving_info(self, info: ModelInfo) -> ModelInfo:
        """The model's info as this engine serves it (what requests are validated against)."""
        if not self.IMAGES:
            info = dataclasses.replace(info, input_kinds=("text",))
        if self.memory is None:
            return info
        return dataclasses.replace(
            info, max_request_tokens=self.memory.max_tokens(), hybrid=self.layout.hybrid
        )

    def run(self) -> None:
        raise NotImplementedError

    def end_inbox(self, status: RequestStatus, error: str | None) -> None:
        """On the engine thread, once the loop has ended: end every request still queued in
        the inbox (or taken with the STOP) and answer pending cache clears."""
        commands, self.leftover = [*self.leftover, *self._take(block=False)], []
        for kind, payload in commands:
            if kind == "add":
                end_queued(payload, status, error)
            elif kind is CLEAR:
                payload.set_result(0)

    def _release(self) -> None:
        """Drop the model's arrays once the loop has ended: a retired, stopped or dead engine
        keeps its info and tokenizer (for callers holding it), not its weights and caches,
        so a replacement or a restart does not need room for two copies."""
        if self.loaded is not None:
            self.loaded = dataclasses.replace(self.loaded, model=None)
        if self.prefix_cache is not None:
            self.prefix_cache.close()  # what it holds goes to its disk tier, if any
        self.prefix_cache = None
        runner = getattr(self, "runner", None)
        if runner is not None:  # emptied by close(); its model and cache go
            runner.drop()
        # Whatever else of the engine's holds arrays (a draft model, the scheduler's reference
        # to the prefix cache): the memory budget counts this engine's memory as returned.
        if getattr(self, "draft_model", None) is not None:
            self.draft_model = None
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.prefix_cache = None
        try:
            mx.clear_cache()
        except Exception:
            logger.warning("could not return %s's memory", self.spec.name, exc_info=True)

    def close(self, status: RequestStatus, error: str | None) -> None:
        """End what is left when the loop ends (aborted on stop, "error" if the loop died)."""


def _wait_until_gone(thread: threading.Thread, timeout: float = 2.0) -> None:
    """Wait for a joined thread's OS thread to end. `join` returns once the Python side of the
    thread is done, before its C++ thread-local destructors run; MLX's takes the GIL, and if the
    interpreter is already exiting then, the process aborts ("terminate called without an
    active exception"). Stopping engines is the last thing a process does before it exits."""
    task = Path(f"/proc/self/task/{thread.native_id}")
    if thread.native_id is None or not task.parent.is_dir():  # Linux only (libstdc++)
        return
    deadline = time.monotonic() + timeout
    while task.exists() and time.monotonic() < deadline:
        time.sleep(0.001)
