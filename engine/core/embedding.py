"""EmbeddingEngine: one embedding model (engine/models/embeddings.py) served from its own thread.

The thread loads the model, so it is the only one that touches the model's MLX arrays. Requests
queue; the thread takes every request waiting (up to `MAX_BATCH_SEQUENCES` sequences), sorts
their sequences by length and runs them in padded batches of similar length (a mask hides the
padding), so concurrent callers share forwards, and hands each caller its own vectors.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable, Sequence

import numpy as np

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
MAX_BATCH_TOKENS = 8192  # padded tokens in one forward


class EmbeddingEngine:
    """One embedding model served from its own thread, batching whatever is waiting.

    The EngineWorker drives it as it drives an EngineLoop: `start` loads the model on the
    thread (`ready` resolves with its info, or with the load's exception), `drain` refuses new
    requests and lets the queued ones finish, `stop` fails those not yet running instead, and
    `ended` resolves once the thread has ended (with the reason if it died).
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
        self._num_queued = 0  # requests submitted and not yet taken by the thread
        self._num_running = 0  # requests in the forwards under way
        self.num_forwards = 0
        self._num_tokens = 0
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

    def submit(self, token_ids: Sequence[Sequence[int]]) -> concurrent.futures.Future:
        """Queue inputs (thread-safe); the future's result is their (n, dimensions) vectors,
        its exception InvalidRequestError for inputs the model cannot take, or
        ModelNotLoadedError once the engine is retired."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closing:
                future.set_exception(ModelNotLoadedError(self._retired_message()))
                return future
            self._num_queued += 1
            self._queue.put((list(token_ids), future))
        return future

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        if isinstance(texts, str) or not all(isinstance(text, str) for text in texts):
            raise InvalidRequestError("Only strings can be tokenized.", param="input")
        model = self.model
        if model is None:
            raise ModelNotLoadedError(self._retired_message())
        return model.tokenize(texts)  # the tokenizers library is thread-safe

    def has_requests(self) -> bool:
        with self._lock:
            return bool(self._num_queued or self._num_running)

    def stats(self) -> EngineStats:
        with self._lock:
            num_waiting, num_running = self._num_queued, self._num_running
        return EngineStats(
            model=self.spec.name,
            num_waiting=num_waiting,
            num_running=num_running,
            num_steps=self.num_forwards,
            num_prompt_tokens=self._num_tokens,
        )

    def drain(self) -> None:
        """Refuse new requests; the thread ends once the queued ones have run (returns at
        once)."""
        with self._lock:
            self._closing = True
            self._queue.put(None)

    def stop(self, timeout: float | None = None) -> None:
        """Fail the requests not yet running, and join the thread."""
        with self._lock:
            self._closing = True
        self._fail_queued()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _retired_message(self) -> str:
        return f"The embedding model {self.spec.name!r} was replaced or retired."

    def _fail_queued(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                continue
            with self._lock:
                self._num_queued -= 1
            if item[1].set_running_or_notify_cancel():
                item[1].set_exception(ModelNotLoadedError(self._retired_message()))

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
            self.model = None  # its weights go now, not when the worker forgets the engine
            self.ended.set_result(error)

    def _serve(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            work = [item]
            num_sequences = len(item[0])
            while num_sequences < MAX_BATCH_SEQUENCES:
                try:
                    more = self._queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                work.append(more)
                num_sequences += len(more[0])
            with self._lock:
                self._num_queued -= len(work)
                self._num_running = len(work)
            try:
                self._run([w for w in work if w[1].set_running_or_notify_cancel()])
            finally:
                with self._lock:
                    self._num_running = 0

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

    def _run(self, work: list[tuple[list, concurrent.futures.Future]]) -> None:
        checked = []
        for token_ids, future in work:
            try:
                checked.append((self._checked(token_ids), future))
            except InvalidRequestError as exc:
                future.set_exception(exc)
        work = checked
        flat = [(w, row) for w, (token_ids, _) in enumerate(work) for row in range(len(token_ids))]
        order = sorted(flat, key=lambda wr: len(work[wr[0]][0][wr[1]]))
        vectors: dict[tuple[int, int], np.ndarray] = {}
        try:
            start = 0
            while start < len(order):
                end = start + 1
                while end < len(order) and end - start < MAX_BATCH_SEQUENCES:
                    longest = len(work[order[end][0]][0][order[end][1]])
                    if longest * (end - start + 1) > MAX_BATCH_TOKENS:
                        break
                    end += 1
                batch = order[start:end]
                out = self.model.embed([work[w][0][row] for w, row in batch])
                self.num_forwards += 1
                self._num_tokens += sum(len(work[w][0][row]) for w, row in batch)
                for position, key in enumerate(batch):
                    vectors[key] = out[position]
                start = end
        except Exception as exc:
            logger.exception("embedding forward failed")
            for _, future in work:
                future.set_exception(exc)
            return
        for w, (token_ids, future) in enumerate(work):
            future.set_result(np.stack([vectors[(w, row)] for row in range(len(token_ids))]))
