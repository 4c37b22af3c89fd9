"""Continuous-batching policy: who runs this step, and how many tokens each computes.

Policy over `engine.core.request` state: no model, so it is tested without one. Each step every
running sequence that has caught up decodes one token; the rest of the per-step token budget
goes to prefill chunks, first to requests already prefilling, then to newly admitted ones in
arrival order while sequence slots and memory remain.

- While any sequence decodes, prefill gets at most `prefill_chunk_tokens` a step, so a long
  prompt arriving never stalls the running streams for long.
- Fair admission: while several prompts wait (a burst arriving together), a step prefills at
  most `admission_chunk_tokens` (while nothing decodes, the head prompt whole if longer), in
  arrival order, starting only prompts that fit whole once it holds one (the runner prefills
  the prompts that complete in a step as one batch); prompts that complete start streaming
  at once, their decode interleaved with the next chunks. So the median first token comes
  after about half the prompts, not after all of them, as it would if the whole burst were
  prefilled as one batch; and the chunks stay large, so few decode steps interleave. A lone
  prompt gets the whole budget, or `prefill_chunk_tokens` a step beside running streams.
- Speculative decoding (engine/core/speculative.py): decode rows may carry a draft, checked in the
  same forward; the drafts count against the token budget.
- A chunk ends at the request's next checkpoint (a boundary its recurrent state is worth
  keeping at, on a hybrid model), so the runner can snapshot it there.
- At admission a request is matched against the prefix cache: its sequences start with the
  hit already computed (`num_computed_tokens`), and the hit is held (locked) until the runner
  has seeded the request's cache from it.
- Memory: a batch holds every row at the length of its longest one, so admission waits while
  rows × longest × bytes per token (plus recurrent state per row) would not fit beside the
  prefix cache, evicting cache entries first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.cache.budget import MemoryBudget
from engine.cache.prefix import PrefixCache
from engine.core.request import Request, Sequence
from engine.core.speculative import Speculator
from engine.protocol import RequestStatus


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
    # Draft tokens per decode row, by id(seq); the runner fills `accepted` (by id(seq)): how
    # many of a row's draft tokens it kept.
    drafts: dict[int, tuple[int, ...]] = field(default_factory=dict)
    accepted: dict[int, int] = field(default_factory=dict)
    # With a draft model: the rows it drafts for this step and how far, by id(seq); the
    # engine fills `drafts` from it before the runner runs the step.
    draft_lengths: dict[int, int] = field(default_factory=dict)

    @property
    def num_scheduled_tokens(self) -> int:
        drafted = sum(len(draft) for draft in self.drafts.values())
        return len(self.decode) + drafted + sum(chunk.num_tokens for chunk in self.prefill)

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        prefill_chunk_tokens: int | None = None,
        prefix_cache: PrefixCache | None = None,
        memory: MemoryBudget | None = None,
        admission_chunk_tokens: int | None = None,
        speculator: Speculator | None = None,
    ):
        if max_num_seqs < 1 or max_num_batched_tokens < max_num_seqs:
            # Every running sequence must be able to decode each step.
            raise ValueError("need max_num_seqs >= 1 and max_num_batched_tokens >= max_num_seqs")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Prefill tokens per step while sequences decode (None: the whole budget).
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # Prefill tokens per step while a burst is admitted and nothing decodes yet (None:
        # the whole budget).
        self.admission_chunk_tokens = admission_chunk_tokens
        self.speculator = speculator
        self.prefix_cache = prefix_cache
        self.memory = memory
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
        if self.speculator is not None and output.decode:
            output.drafts = self.speculator.drafts(output.decode)
            output.draft_lengths = self.speculator.draft_lengths(output.decode)
            drafted = sum(len(d) for d in output.drafts.values())
            drafted += sum(output.draft_lengths.values())
            if drafted > budget:
                output.drafts, output.draft_lengths = {}, {}
                drafted = 0
            budget -= drafted
        burst = bool(self.admission_chunk_tokens) and self._num_prefilling() > 1
        if burst:
            # A burst: bigger steps than a lone prompt gets beside the decode, so few decode
            # steps interleave; the head prompt is never split (while nothing decodes).
            head = 0 if output.decode else self._head_remaining()
            budget = min(budget, max(self.admission_chunk_tokens, head))
        elif output.decode and self.prefill_chunk_tokens:
            budget = min(budget, self.prefill_chunk_tokens)

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
            if not self._fits(request, num_seqs):
                break
            if burst and output.prefill and request.num_prompt_tokens > budget:
                # Whole prompts while a burst is admitted: those that complete in one step
                # are prefilled as one batch (engine/core/runner.py), a split one alone twice.
                break
            self.waiting.popleft()
            self.running.append(request)
            for seq in request.sequences:
                seq.status = RequestStatus.RUNNING
            num_seqs += len(request.sequences)
            self._match(request)
            chunk = self._chunk(request, budget)
            output.prefill.append(chunk)
            budget -= chunk.num_tokens
        return output

    def _num_prefilling(self) -> int:
        running = sum(1 for request in self.running if request.sequences[0].is_prefilling)
        return running + len(self.waiting)

    def _head_remaining(self) -> int:
        """Prompt tokens left of the first request in arrival order still prefilling."""
        for request in [*self.running, *self.waiting]:
            lead = request.sequences[0]
            if lead.is_prefilling:
                return request.num_prompt_tokens - lead.num_computed_tokens
        return 0

    def _match(self, request: Request) -> None:
        if self.prefix_cache is None:
            return
        hit = self.prefix_cache.match(
            request.prompt_token_ids,
            limit=request.num_prompt_tokens - 1,
            scope=request.cache_scope,
        )
        if hit.length:
            self.prefix_cache.lock(hit)  # until the runner has seeded the request's cache
            request.prefix_hit = hit
            for seq in request.sequences:
                seq.num_computed_tokens = hit.length

    def _fits(self, request: Request, num_seqs: int) -> bool:
        """Whether admitting `request` keeps the batch and the prefix cache within memory;
        cache entries are evicted first. With nothing running a request is always admitted:
        validation refused the ones that can never fit."""
        if self.memory is None or not self.running:
            return True
        longest = max(r.num_prompt_tokens + r.max_tokens for r in [*self.running, request])
        need = self.memory.need(num_seqs + len(request.sequences), longest)
        cached = self.prefix_cache.nbytes if self.prefix_cache is not None else 0
        over = need + cached - self.memory.max_bytes
        if over > 0 and cached:
            over -= self.prefix_cache.evict(over)
        return over <= 0

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
        end = min(request.num_prompt_tokens, start + budget)
        # End at the next checkpoint, so its state can be kept there.
        end = next((c for c in request.checkpoints if start < c < end), end)
        return PrefillChunk(request, start, end - start)

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
