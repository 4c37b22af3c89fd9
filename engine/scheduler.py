"""Continuous-batching policy: who runs this step, and how many tokens each computes.

Pure policy over `engine.request` state: no arrays, no model, so it is tested without MLX.
Each step every running sequence that has caught up decodes one token; the rest of the
per-step token budget goes to prefill chunks, first to requests already prefilling, then to
newly admitted ones in arrival order while sequence slots remain.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.protocol import RequestStatus
from engine.request import Request, Sequence


@dataclass(frozen=True)
class PrefillChunk:
    """`num_tokens` prompt tokens of `request`, from `start`; shared by its sequences."""

    request: Request
    start: int
    num_tokens: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.num_tokens == self.request.num_prompt_tokens


@dataclass
class SchedulerOutput:
    decode: list[Sequence] = field(default_factory=list)
    prefill: list[PrefillChunk] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.decode) + sum(chunk.num_tokens for chunk in self.prefill)

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int):
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            # Every running sequence must be able to decode each step.
            raise ValueError("need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running_seqs(self) -> int:
        return sum(len(req.live_sequences()) for req in self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if len(request.sequences) > self.max_num_seqs:
            raise ValueError("a request cannot have more sequences than max_num_seqs")
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        for request in self.running:
            for seq in request.live_sequences():
                if not seq.is_prefilling:
                    assert seq.num_uncomputed_tokens == 1, seq.seq_id
                    output.decode.append(seq)
        budget -= len(output.decode)

        for request in self.running:
            if budget == 0:
                break
            chunk = self._chunk(request, budget)
            if chunk:
                output.prefill.append(chunk)
                budget -= chunk.num_tokens

        num_seqs = self.num_running_seqs
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if num_seqs + len(request.sequences) > self.max_num_seqs:
                break  # first come, first served: nobody overtakes the head of the queue
            self.waiting.popleft()
            self.running.append(request)
            for seq in request.sequences:
                seq.status = RequestStatus.RUNNING
            num_seqs += len(request.sequences)
            chunk = self._chunk(request, budget)
            output.prefill.append(chunk)
            budget -= chunk.num_tokens
        return output

    def decodes_only_after(self, plan: SchedulerOutput) -> bool:
        """Whether the step after `plan`, unless requests arrive or stop early, decodes the same
        sequences and prefills nothing: then it can start before this step's tokens are known.
        Not when every sequence reaches max_tokens in `plan`: that step would be wasted."""
        completing = [chunk.request for chunk in plan.prefill if chunk.completes_prompt]
        if self.waiting or any(
            request.sequences[0].is_prefilling and request not in completing
            for request in self.running
        ):
            return False
        sampling = plan.decode + [seq for request in completing for seq in request.sequences]
        return any(len(seq.output_token_ids) + 1 < seq.request.max_tokens for seq in sampling)

    @staticmethod
    def _chunk(request: Request, budget: int) -> PrefillChunk | None:
        lead = request.sequences[0]
        if not lead.is_prefilling:
            return None
        start = lead.num_computed_tokens
        return PrefillChunk(request, start, min(request.num_prompt_tokens - start, budget))

    def remove(self, request_id: str) -> Request | None:
        """Take a request out (finished or aborted); None when it is not here."""
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    return request
        return None

    def remove_finished(self) -> list[Request]:
        finished = [request for request in self.running if request.is_finished]
        if finished:
            self.running = [request for request in self.running if not request.is_finished]
        return finished
