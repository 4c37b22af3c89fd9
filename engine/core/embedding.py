"""EmbeddingEngine: one embedding model (engine/models/embeddings.py) served from its own thread.

The thread loads the model, so it is the only one that touches the model's MLX arrays. Each
request is an `EmbeddingJob`. Every step the thread takes the jobs submitted meanwhile, lets go
of those cancelled, and runs one padded forward (a mask hides the padding): the shortest waiting
input of the job whose turn it is, with the waiting inputs of every job nearest it in length, as
many as MAX_BATCH_SEQUENCES and MAX_BATCH_TOKENS allow. Jobs take turns, so a small request waits
a forward or two, never for a large one's thousands of inputs; concurrent requests of similar
lengths share forwards; a job whose client left stops between forwards, and its count of the
tokens computed is what its client is billed.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np

from engine.core.turns import ComputeTurns
from engine.models.embeddings import EmbeddingModel
from engine.protocol import (
    EmbeddingInfo,
    EngineStats,
    InvalidRequestError,
    ModelNotLoadedError,
    ModelSpec,
)

logger = logging.getLogger(__name__)

MAX_BATCH_SEQUENCES = 64
# Padded tokens in one forward: ~0.12 s of all-MiniLM-L6-v2 on 2 CPU cores (4 rows of 128,
# engine/kernels' GELU and attention), about as fast per token as 8192, so a chat engine sharing
# the machine waits a tenth of a second, not seconds, behind another team's flood of embeddings.
MAX_BATCH_TOKENS = 512
# While another engine of the worker computes: forwards take turns with its steps
# (engine/core/turns.py), and pause between layers once they have held the device
# turns.PAUSE_AFTER_S, so one of its steps waits about that and a layer.
SHARED_BATCH_TOKENS = 128


class EmbeddingJob:
    """One request's inputs in an EmbeddingEngine.

    `future` resolves with their (n, dimensions) float32 vectors, or with the error that stopped
    them; cancelling it (asyncio does when the task awaiting it is cancelled) stops the job
    before the engine's next forward. `num_computed_tokens` counts the tokens of the inputs
    embedded so far; `ended` resolves with it, final, once the engine has let go of the job.
    """

    def __init__(self, token_ids: list, turn: int):
        self.rows: list = token_ids  # as submitted, until the engine has checked them (start)
        self.future: concurrent.futures.Future[np.ndarray] = concurrent.futures.Future()
        self.ended: concurrent.futures.Future[int] = concurrent.futures.Future()
        self.num_computed_tokens = 0
        self.turn = turn  # jobs take turns in this order (the engine's thread renews it)
        self.waiting: set[int] = set()  # rows without a vector yet
        self._vectors: dict[int, np.ndarray] = {}

    def start(self, rows: list[list[int]]) -> None:
        self.rows = rows
        self.waiting = set(range(len(rows)))

    def computed(self, row: int, vector: np.ndarray) -> None:
        self._vectors[row] = vector
        self.waiting.discard(row)
        self.num_computed_tokens += len(self.rows[row])

    def end(self, error: BaseException | None = None) -> None:
        """Let go of the job: its vectors, `error`, or (cancelled) nothing more."""
        try:
            if error is not None:
                self.future.set_exception(error)
            elif not self.future.cancelled():
                self.future.set_result(np.stack([self._vectors[r] for r in range(len(self.rows))]))
        except concurrent.futures.InvalidStateError:
            pass  # cancelled by its caller meanwhile
        self.ended.set_result(self.num_computed_tokens)


class EmbeddingEngine:
    """One embedding model served from its own thread, its jobs batched forward by forward.

    The EngineWorker drives it as it drives an EngineLoop: `start` loads the model on the
    thread (`ready` resolves with its info, or with the load's exception), `drain` refuses new
    requests and lets those submitted finish, `stop` fails them instead (those under way at
    their next forward), and `ended` resolves once the thread has ended (with the reason if it
    died).
    """

    def __init__(self, spec: ModelSpec, load: Callable[[], EmbeddingModel]):
        self.spec = spec
        self._load = load
        self.model: EmbeddingModel | None = None
        self.ready: concurrent.futures.Future[EmbeddingInfo] = concurrent.futures.Future()
        self.ended: concurrent.futures.Future[str | None] = concurrent.futures.Future()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closing = False  # set by drain, stop or the thread's end: submit refuses
        self._stopping = False  # set by stop: the jobs under way end at the next forward
        self._num_queued = 0  # jobs submitted and not yet taken by the thread
        self._jobs: list[EmbeddingJob] = []  # taken by the thread and not ended (its own)
        self._turns = itertools.count()
        self.num_forwards = 0
        self._num_tokens = 0
        self.cache_bytes: int | None = None  # its workspace in the worker's memory budget
        self.compute_turns = ComputeTurns()  # the worker's, shared by its engines (turns.py)
        self._thread = threading.Thread(
            target=self._main, name=f"orchard-embed-{spec.name}", daemon=True
        )

    @property
    def info(self) -> EmbeddingInfo:
        return self.ready.result()

    @property
    def is_serving(self) -> bool:
        """Loaded, and neither retired nor dead: new requests may be submitted."""
        return self.ready.done() and self.ready.exception() is None and not self._closing

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> concurrent.futures.Future[EmbeddingInfo]:
        self._thread.start()
        return self.ready

    def submit(self, token_ids: Sequence[Sequence[int]]) -> EmbeddingJob:
        """Queue inputs (thread-safe). The job's future fails with InvalidRequestError for
        inputs the model cannot take, or ModelNotLoadedError once the engine is retired."""
        job = EmbeddingJob(list(token_ids), next(self._turns))
        with self._lock:
            if not self._closing:
                self._num_queued += 1
                self._queue.put(job)
                return job
        job.end(ModelNotLoadedError(self._retired_message()))
        return job

    def tokenizer(self):
        """The model's `tokenizers.Tokenizer` (thread-safe), to tokenize away from this thread."""
        model = self.model
        if model is None:
            raise ModelNotLoadedError(self._retired_message())
        return model.tokenizer

    def has_requests(self) -> bool:
        with self._lock:
            return bool(self._num_queued or self._jobs)

    def stats(self) -> EngineStats:
        with self._lock:
            num_waiting, num_running = self._num_queued, len(self._jobs)
        return EngineStats(
            model=self.spec.name,
            num_waiting=num_waiting,
            num_running=num_running,
            num_steps=self.num_forwards,
            num_prompt_tokens=self._num_tokens,
        )

    def drain(self) -> None:
        """Refuse new requests; the thread ends once those submitted have run (returns at
        once)."""
        with self._lock:
            self._closing = True
            self._queue.put(None)

    def stop(self, timeout: float | None = None) -> None:
        """Fail the requests not yet taken at once and those under way at their next forward,
        and join the thread."""
        with self._lock:
            self._closing = self._stopping = True
        self._fail_queued()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _retired_message(self) -> str:
        return f"The embedding model {self.spec.name!r} was replaced or retired."

    def _fail_queued(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            if job is None:
                continue
            with self._lock:
                self._num_queued -= 1
            job.end(ModelNotLoadedError(self._retired_message()))

    def _main(self) -> None:
        try:
            self.model = self._load()
        except BaseException as exc:
            self.ready.set_exception(exc)
            self.ended.set_result(None)
            return
        self.ready.set_result(self.model.info)
        error = None
        try:
            self._serve()
        except BaseException as exc:
            logger.exception("embedding engine for %s died", self.spec.name)
            error = f"engine stopped: {type(exc).__name__}: {exc}"
        finally:
            with self._lock:
                self._closing = True
            self._fail_queued()
            self._end_jobs(list(self._jobs), ModelNotLoadedError(self._retired_message()))
            self.model = None  # its weights go now, not when the worker forgets the engine
            self.ended.set_result(error)

    def _serve(self) -> None:
        """schedule → run → update, one forward a step, until the end-of-queue marker came and
        the jobs taken before it have ended (or `stop`)."""
        last = False
        while True:
            if not last:
                last = self._take(wait=not self._jobs)
            if self._stopping:
                return  # _main fails the jobs left
            self._end_jobs([job for job in self._jobs if job.future.cancelled()])
            if self._jobs:
                anchor = min(self._jobs, key=lambda job: job.turn)
                self._step(self._next_batch(anchor))
                # To the back of the line, behind the jobs submitted during the forward.
                anchor.turn = next(self._turns)
            elif last:
                return

    def _take(self, *, wait: bool) -> bool:
        """Take the jobs submitted (waiting for one when `wait`); True at the end-of-queue
        marker."""
        while True:
            try:
                job = self._queue.get(block=wait)
            except queue.Empty:
                return False
            if job is None:
                return True
            wait = False
            with self._lock:
                self._num_queued -= 1
            try:
                job.start(self._checked(job.rows))
            except InvalidRequestError as exc:
                job.end(exc)
                continue
            with self._lock:
                self._jobs.append(job)

    def _end_jobs(self, jobs: list[EmbeddingJob], error: BaseException | None = None) -> None:
        for job in jobs:
            with self._lock:
                self._jobs.remove(job)
            job.end(error)

    def _checked(self, token_ids: list) -> list[list[int]]:
        """The inputs as lists of ids: InvalidRequestError for an id outside the vocabulary or
        an input outside the position table (they would index past the weights). The web side
        checks them first; this keeps a bad call from ever reaching the model."""
        info = self.model.info
        rows = []
        for index, ids in enumerate(token_ids):
            try:
                row = np.asarray(ids)
            except (TypeError, ValueError):
                row = np.zeros(0)
            if (
                row.ndim != 1
                or not 0 < len(row) <= info.context_length
                or row.dtype.kind not in "iu"
                or row.min() < 0
                or row.max() >= info.vocab_size
            ):
                raise InvalidRequestError(
                    f"input[{index}] must be 1 to {info.context_length} token ids from 0 to "
                    f"{info.vocab_size - 1}.",
                    param="input",
                )
            rows.append(row.tolist())
        if not rows:
            raise InvalidRequestError("No inputs to embed.", param="input")
        return rows

    def _next_batch(self, anchor: EmbeddingJob) -> list[tuple[EmbeddingJob, int]]:
        """The rows of the next forward: the shortest waiting row of `anchor` (the job whose
        turn it is), and around it the waiting rows of any job nearest it in length (longer
        first, then shorter, which add no padding), while the batch holds at most
        MAX_BATCH_SEQUENCES rows and MAX_BATCH_TOKENS padded tokens (SHARED_BATCH_TOKENS while
        another engine computes)."""
        waiting = sorted(
            (len(job.rows[row]), number, row)
            for number, job in enumerate(self._jobs)
            for row in job.waiting
        )
        number = self._jobs.index(anchor)
        lo = next(i for i, (_, n, _) in enumerate(waiting) if n == number)
        hi = lo + 1
        shared = self.compute_turns.others_active(self)
        budget = SHARED_BATCH_TOKENS if shared else MAX_BATCH_TOKENS

        def fits(lo: int, hi: int) -> bool:
            longest = waiting[hi - 1][0]
            return hi - lo <= MAX_BATCH_SEQUENCES and longest * (hi - lo) <= budget

        while hi < len(waiting) and fits(lo, hi + 1):
            hi += 1
        while lo > 0 and fits(lo - 1, hi):
            lo -= 1
        return [(self._jobs[n], row) for _, n, row in waiting[lo:hi]]

    def _step(self, batch: list[tuple[EmbeddingJob, int]]) -> None:
        jobs = list(dict.fromkeys(job for job, _ in batch))
        try:
            turns = self.compute_turns
            with turns.turn(self):
                vectors = self.model.embed(
                    [job.rows[row] for job, row in batch], lambda: turns.pause(self)
                )
        except Exception as exc:
            logger.exception("embedding forward failed")
            self._end_jobs(jobs, exc)
            return
        self.num_forwards += 1
        self._num_tokens += sum(len(job.rows[row]) for job, row in batch)
        for position, (job, row) in enumerate(batch):
            job.computed(row, vectors[position])
        self._end_jobs([job for job in jobs if not job.waiting])
