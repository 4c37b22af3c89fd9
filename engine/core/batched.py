"""The continuous-batching engine on the shared loop of engine/core/loop.py: the scheduler decides
who runs each step (engine/core/scheduler.py), the runner computes it (engine/core/runner.py)."""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from collections import deque

import mlx.core as mx

from engine.cache.memory import weights_bytes
from engine.core.draft_model import DraftModel, DraftModelError
from engine.core.fairness import FairShare
from engine.core.loop import CLEAR, DRAIN, STOP, EngineLoop
from engine.core.request import Emit
from engine.core.runner import BatchRunner
from engine.core.scheduler import Scheduler, SchedulerOutput
from engine.core.speculative import Speculator
from engine.models.loader import load_model
from engine.protocol import GenerationRequest, ModelInfo, RequestStatus, describe

logger = logging.getLogger(__name__)


class BatchedEngine(EngineLoop):
    """Continuous batching: requests join and leave the running batch at any step."""

    # Whether decode steps may run ahead (engine/core/runner.py); None: where the device overlaps.
    RUN_AHEAD: bool | None = None
    COHORTS = True
    IMAGES = True

    def setup(self) -> None:
        # Running ahead overlaps host work with the device's; MLX's CPU backend evaluates
        # synchronously, so there it would only hold each step's tokens back by one forward.
        self.overlaps = (
            self.RUN_AHEAD if self.RUN_AHEAD is not None else mx.default_device() != mx.cpu
        )
        self.setup_caches()
        self.pacer = PrefillPacer(
            fixed=self.spec.prefill_chunk_tokens, limit=self.spec.max_num_batched_tokens
        )
        # Drafts are checked in one forward and rejected positions trimmed from the batch's
        # attention caches; recurrent state cannot be trimmed, so hybrid models (and caches
        # of other kinds) never speculate.
        can_trim = self.layout is not None and set(self.layout.kinds) == {"kv"}
        speculating = can_trim and self.spec.speculative_tokens > 0
        # A draft model proposes the drafts where the registry names one (else prompt lookup).
        self.draft_model: DraftModel | None = None
        if self.spec.draft_path and speculating:
            draft = load_model(self.spec.draft_path)
            self.draft_model = DraftModel(draft, target=self.loaded)
            self.weights_bytes += weights_bytes(draft.model)
        elif self.spec.draft_path and self.spec.speculative_tokens > 0:
            raise DraftModelError(
                f"{self.spec.name} cannot take drafts: its cache has state other than "
                "attention keys and values, which a rejected draft cannot be cut from."
            )
        self.speculator = (
            Speculator(
                num_tokens=self.spec.speculative_tokens,
                draft_model=self.draft_model is not None,
            )
            if speculating
            else None
        )
        self.scheduler = Scheduler(
            # Every running row decodes each step, so the token budget also caps the rows.
            max_num_seqs=min(self.spec.max_num_seqs, self.spec.max_num_batched_tokens),
            max_num_batched_tokens=self.spec.max_num_batched_tokens,
            prefill_chunk_tokens=self.pacer.chunk_tokens,
            admission_chunk_tokens=self.pacer.admission_tokens,
            prefix_cache=self.prefix_cache,
            memory=self.memory,
            speculator=self.speculator,
            hybrid=self.layout is not None and self.layout.hybrid,
            fairness=(
                FairShare(
                    max_num_seqs=min(self.spec.max_num_seqs, self.spec.max_num_batched_tokens),
                    min_tier_share=self.spec.tier_min_share,
                    yield_share=self.spec.flex_yield_share,
                )
                if self.spec.fair_share
                else None
            ),
        )
        self.tenants: dict = {}
        hybrid = self.layout is not None and self.layout.hybrid
        self.runner = BatchRunner(
            self.loaded.model,
            self.prefix_cache,
            hybrid=hybrid,
            quant=self.kv_quant,
            cohort_pad=self.cohort_pad,
            vision=self.loaded.vision,
        )

    def prefill_chunk_tokens(self) -> int:
        return self.pacer.chunk_tokens

    def fair_share_stats(self) -> tuple[int, dict]:
        return self.scheduler.num_preemptions, self.tenants

    def draft_counts(self) -> tuple[int, int]:
        speculator = self.speculator
        return (speculator.num_drafted, speculator.num_accepted) if speculator else (0, 0)

    def run(self) -> None:
        while True:
            block = not (self.scheduler.has_work() or self._draining)
            commands = self._take(block=block)
            for index, (kind, payload) in enumerate(commands):
                if kind is STOP:
                    self.leftover = commands[index + 1 :]  # ended by close()
                    return
                if kind is DRAIN:
                    self._draining = True
                elif kind is CLEAR:
                    self._clear_prefix_cache(payload)
                elif kind == "add":
                    self._add(payload)
                else:
                    self._abort(payload)
            if self.scheduler.has_work():
                try:
                    with self.compute_turns.turn(self):
                        self.step()
                except Exception as exc:
                    logger.exception("engine step failed for %s", self.spec.name)
                    self._fail_running(describe(exc))
            elif self._draining:
                return
            self._publish(
                self.scheduler.num_waiting,
                self.scheduler.num_running_seqs,
                waiting=self.scheduler.waiting,
            )
            self.tenants = self.scheduler.tenant_stats()  # a new dict: read by stats()
            self.kv_cache_bytes = self.scheduler.kv_cache_bytes()

    def serving_info(self, info: ModelInfo) -> ModelInfo:
        # All choices of a request run together, so more than the batch holds could never start.
        info = super().serving_info(info)
        rows = min(self.spec.max_num_seqs, self.spec.max_num_batched_tokens)
        return dataclasses.replace(info, max_choices=min(info.max_choices, rows))

    def step(self) -> None:
        # The rows of a step already in flight cannot leave before it is collected.
        self.scheduler.allow_preemption = not self.runner.running_ahead
        plan = self.scheduler.schedule()
        started_at = time.perf_counter()  # drafting is part of what a step with drafts costs
        if plan.preempted:
            self.runner.preempt(plan.preempted)
            if self.speculator is not None:
                self._forget(plan.preempted)
        self._encode(plan)
        if self.runner.running_ahead:
            plan.drafts, plan.draft_lengths = {}, {}  # this step's decode already runs
        if plan.draft_lengths:
            self._draft(plan)
        run_ahead = (
            self.overlaps
            and not plan.drafts
            and self._inbox.empty()
            and not self.compute_turns.contended()  # another engine's step comes between
            and self.scheduler.decodes_only_after(plan)
        )
        sampled = self.runner.execute(plan, run_ahead=run_ahead)
        self.pacer.record(plan, self.runner.prefill_seconds)
        self.scheduler.prefill_chunk_tokens = self.pacer.chunk_tokens
        self.scheduler.admission_chunk_tokens = self.pacer.admission_tokens
        if self.speculator is not None:
            self.speculator.record(plan.decode, plan.drafts, plan.accepted)
            if plan.decode and not plan.prefill:
                self.speculator.record_step(
                    len(plan.decode),
                    bool(plan.drafts),
                    len(sampled),
                    time.perf_counter() - started_at,
                )
        _advance(plan)
        self.scheduler.account(sampled)
        for item in sampled:
            if item.seq.status.is_finished:
                continue  # its request failed on an earlier choice in this step
            try:
                self.accept(item)
            except Exception as exc:
                # Stop checks, detokenizing, a grammar and `emit` are per request:
                # a failure there ends that request only; the row leaves with the finished ones.
                logger.exception("request %s failed", item.seq.request.request_id)
                self.finish(item.seq.request, RequestStatus.FINISHED_ERROR, describe(exc))
        finished = self.scheduler.remove_finished()
        if self.speculator is not None:
            self._forget(finished)
        self.runner.release_finished()
        self._meter.record_step(time.perf_counter() - started_at, plan, len(sampled))

    def _encode(self, plan: SchedulerOutput) -> None:
        """Run the vision tower of prompts with images starting this step, before any forward:
        one that fails (a bug, memory) ends its own request, not the batch."""
        for chunk in [c for c in plan.prefill if c.request.spec.images]:
            try:
                self.runner.encode(chunk.request)
            except Exception as exc:
                logger.exception("the images of request %s failed", chunk.request.request_id)
                plan.prefill.remove(chunk)
                self._end(chunk.request.request_id, RequestStatus.FINISHED_ERROR, describe(exc))

    def _draft(self, plan: SchedulerOutput) -> None:
        """The draft model's proposals for the rows the scheduler chose; a failure there costs
        this step its drafts, not anyone's request."""
        seqs = [seq for seq in plan.decode if id(seq) in plan.draft_lengths]
        try:
            drafts = self.draft_model.draft(seqs, [plan.draft_lengths[id(s)] for s in seqs])
        except Exception:
            logger.exception("the draft model of %s failed; this step runs without", self.spec.name)
            self.draft_model.forget(seqs)
            return
        plan.drafts = {id(seq): draft for seq, draft in zip(seqs, drafts, strict=True) if draft}

    def _add(self, payload: tuple[GenerationRequest, Emit, int]) -> None:
        request = self.admit(payload)
        if request is None:
            return
        try:
            self.scheduler.add(request)
        except Exception as exc:
            logger.exception("could not queue request %s", request.request_id)
            self.finish(request, RequestStatus.FINISHED_ERROR, describe(exc))

    def _forget(self, requests: list) -> None:
        seqs = [seq for request in requests for seq in request.sequences]
        self.speculator.forget(seqs)
        if self.draft_model is not None:
            self.draft_model.forget(seqs)

    def _abort(self, request_id: str) -> None:
        self._end(request_id, RequestStatus.FINISHED_ABORTED)

    def _end(self, request_id: str, status: RequestStatus, error: str | None = None) -> None:
        request = self.scheduler.remove(request_id)
        if request is not None:
            if self.speculator is not None:
                self._forget([request])
            self._drop_hit(request)
            self.finish(request, status, error)
            self.runner.release(request_id)
            self.runner.release_finished()

    def _fail_running(self, error: str) -> None:
        for request in list(self.scheduler.running):
            self.scheduler.remove(request.request_id)
            if self.speculator is not None:
                self._forget([request])
            self._drop_hit(request)
            self.finish(request, RequestStatus.FINISHED_ERROR, error)
        self.runner.reset()

    def _drop_hit(self, request) -> None:
        # A prefix-cache hit the runner never used (the step failed first) holds its entries.
        hit, request.prefix_hit = request.prefix_hit, None
        if hit is not None and self.prefix_cache is not None:
            self.prefix_cache.unlock(hit)

    def close(self, status: RequestStatus, error: str | None) -> None:
        for request in self.scheduler.clear():
            self._drop_hit(request)
            self.finish(request, status, error)
        self.end_inbox(status, error)
        self._publish(0, 0)
        self.runner.reset()
        self.draft_model = None  # its weights go with the engine's (EngineLoop._release)


class PrefillPacer:
    """How many prompt tokens a step may prefill while other sequences decode: `fixed` if the
    model sets it, else what the measured prefill speed computes in TARGET_STEP_S, so a long
    prompt arriving delays each running stream's next token by about that much.

    The speed comes from the runner's timing of each step's prefill alone (engine/core/runner.py),
    not from the step's time: a step beside many decoding rows spends much of it on them, and
    subtracting an estimate of their share failed where it mattered most (a burst admitted
    beside a growing batch: every step mixed, at batch sizes no decode-only step had
    measured, so the chunks shrank step after step, to 30 tokens beside 50 rows)."""

    TARGET_STEP_S = 0.25
    # While a burst of prompts is admitted and nothing decodes yet (fair admission in
    # engine/core/scheduler.py): long enough a step that few decode steps interleave, short
    # enough that the first prompts start streaming early.
    ADMISSION_STEP_S = 1.0
    MIN_TOKENS = 16
    START_TOKENS = 256
    # The speed is the median of the last few steps' figures: one step slowed by something
    # else (a burst of requests arriving keeps the rest of the process busy) is outvoted.
    WINDOW = 5

    def __init__(self, *, fixed: int | None, limit: int):
        self.fixed = fixed
        self.limit = limit
        self.chunk_tokens = fixed or min(limit, self.START_TOKENS)
        self.admission_tokens = min(limit, 4 * self.chunk_tokens)
        self._recent: deque[float] = deque(maxlen=self.WINDOW)  # seconds per prompt token

    def record(self, plan: SchedulerOutput, prefill_s: float | None) -> None:
        """After a step: `prefill_s`, the seconds its prefill took (None: it had none)."""
        num_prefill = sum(chunk.num_tokens for chunk in plan.prefill)
        if self.fixed or prefill_s is None or num_prefill < self.MIN_TOKENS:
            return
        self._recent.append(prefill_s / num_prefill)
        seconds_per_token = statistics.median(self._recent)
        tokens = int(self.TARGET_STEP_S / seconds_per_token)
        self.chunk_tokens = max(self.MIN_TOKENS, min(self.limit, tokens))
        tokens = int(self.ADMISSION_STEP_S / seconds_per_token)
        self.admission_tokens = max(self.MIN_TOKENS, min(self.limit, tokens))


def _advance(plan: SchedulerOutput) -> None:
    for seq in plan.decode:
        seq.num_computed_tokens += 1 + plan.accepted.get(id(seq), 0)
    for chunk in plan.prefill:
        for seq in chunk.request.live_sequences():
            seq.num_computed_tokens += chunk.num_tokens
