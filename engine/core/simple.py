"""The serialized engine: one request at a time, for models or settings that cannot batch.

Serialization is structural rather than a lock around `to_thread`: the model's one engine thread
takes requests from its inbox and runs each to its end before taking the next. A caller that is
cancelled only queues an abort, which the running generation sees between tokens; the next
request cannot start until that thread has returned from the current one (docs/architecture.md: a
lock released on cancellation let a second MLX thread start while the first still ran).
"""

from __future__ import annotations

import logging
from collections import deque

from engine.core.fairness import FairShare
from engine.core.loop import CLEAR, DRAIN, STOP, EngineLoop
from engine.core.request import Request
from engine.core.sequence_runner import SequenceRunner
from engine.protocol import RequestStatus, describe

logger = logging.getLogger(__name__)


class SimpleEngine(EngineLoop):
    def setup(self) -> None:
        self.setup_caches()
        hybrid = self.layout is not None and self.layout.hybrid
        self.runner = SequenceRunner(
            self.loaded.model, self.prefix_cache, hybrid=hybrid, quant=self.kv_quant
        )
        self._pending: deque[Request] = deque()
        self._stopping = False
        # The next request is the fair share's turn (engine/core/fairness.py), else the oldest.
        self.fairness = (
            FairShare(max_num_seqs=1, min_tier_share=0.0) if self.spec.fair_share else None
        )

    def run(self) -> None:
        while not self._stopping and not (self._draining and not self._pending):
            self._poll(current=None, block=not self._pending)
            if self._stopping or not self._pending:
                continue
            request = self._next()
            self._publish(len(self._pending), len(request.sequences), waiting=self._pending)
            for seq in request.sequences:
                seq.status = RequestStatus.RUNNING
            try:
                self.generate(request)
            except Exception as exc:
                logger.exception("request %s failed", request.request_id)
                self.finish(request, RequestStatus.FINISHED_ERROR, describe(exc))
            if self.fairness is not None:
                self.fairness.leave(request)
            self._publish(len(self._pending), 0, waiting=self._pending)

    def _next(self) -> Request:
        if self.fairness is None:
            return self._pending.popleft()
        request = min(self._pending, key=self.fairness.order)
        self._pending.remove(request)
        return request

    def generate(self, request: Request) -> None:
        """Run a request to its end, its choices one after another; aborts checked per token."""
        for seq in request.sequences:
            # Each choice after the first finds the prompt in the prefix cache.
            with self.compute_turns.turn(self):
                cache, first = self.runner.prefill(seq, self.spec.max_num_batched_tokens)
            seq.num_computed_tokens = request.num_prompt_tokens - (0 if first else 1)
            uncached = request.num_prompt_tokens - request.num_cached_tokens
            self._meter.num_prompt_tokens += uncached
            if self.fairness is not None:
                self.fairness.charge_prefill(request, uncached)
                self.fairness.charge_decode(request, len(first))
            for sampled in first:
                self.accept(sampled)
            while not seq.status.is_finished:
                if self._poll(current=request, block=False):
                    self.finish(request, RequestStatus.FINISHED_ABORTED)
                    return
                with self.compute_turns.turn(self):
                    (sampled,) = self.runner.step(cache, [seq])
                seq.num_computed_tokens += 1
                if self.fairness is not None:
                    self.fairness.charge_decode(request, 1)
                self.accept(sampled)
            self.runner.finished(seq, cache)

    def _poll(self, *, current: Request | None, block: bool) -> bool:
        """Apply inbox commands; True when `current` must stop (aborted, or engine stopping)."""
        stop_current = False
        for kind, payload in self._take(block=block):
            if kind is STOP:
                self._stopping = True
                stop_current = True
            elif kind is DRAIN:
                self._draining = True
            elif kind is CLEAR:
                self._clear_prefix_cache(payload)
            elif kind == "add":
                request = self.admit(payload)
                if request is not None:
                    self._pending.append(request)
                    if self.fairness is not None:
                        self.fairness.arrive(request)
            elif current is not None and payload == current.request_id:
                stop_current = True
            else:
                self._abort_pending(payload)
        self._publish(
            len(self._pending), len(current.sequences) if current else 0, waiting=self._pending
        )
        return stop_current

    def _abort_pending(self, request_id: str) -> None:
        for request in self._pending:
            if request.request_id == request_id:
                self._pending.remove(request)
                if self.fairness is not None:
                    self.fairness.leave(request)
                self.finish(request, RequestStatus.FINISHED_ABORTED)
                return

    def close(self, status: RequestStatus, error: str | None) -> None:
        while self._pending:
            self.finish(self._pending.popleft(), status, error)
        self.end_inbox(status, error)
        self._publish(0, 0)
