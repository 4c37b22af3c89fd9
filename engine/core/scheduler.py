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
- Memory: admission waits while the batch's rows at their longest (prompt + max_tokens) would
  not fit beside the prefix cache, evicting cache entries first; a row costs its cohort's
  longest length (engine/cache/cohorts.py: rows within a few hundred tokens of one another),
  or without cohorts the batch's longest, plus recurrent state per row.
- Fair share and tiers (engine/core/fairness.py, with `fairness`; without it, arrival order):
  the waiting request admitted next is the one of the highest tier, then of the tenant (team)
  and principal (key) that received the least weighted service; prefill chunks of running
  requests go in the same order (a lower tier is guaranteed a share of each step's budget).
  Preemption: when the next request cannot be admitted (rows or memory), running requests of
  a lower tier, or of a tenant holding more than its fair rows of the same tier while the
  waiting one's tenant holds fewer, are preempted: taken out of the batch (the runner keeps
  what they computed in the prefix cache) and queued again with what they generated, which
  they prefill on their return (found in the prefix cache, or recomputed), so their output
  continues token for token. Never while the runner runs ahead. A step that prefills a
  higher tier than some decoding row's pauses the decode (`_pause_lower_tiers`), so the
  higher tier's first token does not wait for a batch's decode step. While a higher tier
  has requests, the lowest tier keeps only its yield share of the rows (`Yielding`, engine/core/
  fairness.py: admitted up to it, preempted down to it), so the steps stay short.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from engine.cache.budget import MemoryBudget
from engine.cache.prefix import PrefixCache
from engine.core.fairness import FairShare, TenantStats, Turns
from engine.core.preemption import Preemption
from engine.core.request import Request, Sequence
from engine.core.speculative import Speculator
from engine.protocol import SERVICE_TIERS, RequestStatus


@dataclass(frozen=True)
class PrefillChunk:
    """`num_tokens` prompt tokens of `request`, from `start`; shared by its sequences."""

    request: Request
    start: int
    num_tokens: int

    @property
    def completes_prompt(self) -> bool:
        return self.start + self.num_tokens == self.request.num_prefill_tokens


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
    # Requests taken out of the batch this step, queued again (the runner keeps their state in
    # the prefix cache and drops their rows before it runs the step).
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        drafted = sum(len(draft) for draft in self.drafts.values())
        return len(self.decode) + drafted + sum(chunk.num_tokens for chunk in self.prefill)

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill


class Scheduler(Preemption):
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
        fairness: FairShare | None = None,
        hybrid: bool = False,
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
        self.fairness = fairness
        # Cleared by the engine while the runner runs ahead (its rows are already in flight).
        self.allow_preemption = True
        self.num_preemptions = 0
        self.hybrid = hybrid  # recurrent layers: see _pause_lower_tiers
        self._paused = False  # the last step paused the decode for a higher tier's prefill
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
        if self.fairness is not None:
            self.fairness.arrive(request)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        turns = Turns(self) if self.fairness is not None and self.waiting else None
        if self.fairness is not None:
            self.fairness.yielding.step([*self.running, *self.waiting])
        if turns is not None and self.allow_preemption:
            self._make_room(output, turns)
            for victim in self.fairness.yielding.over(self.running):
                turns.rows.add(victim, -len(victim.live_sequences()))
                self._preempt(victim, output)
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

        prefilling = self._prefill_order()
        if turns is not None and prefilling:
            # A higher tier than every running prompt's is admitted before their chunks.
            above = min(request.service.rank for request, _ in prefilling)
            budget = self._admit(output, budget, turns, burst, above=above)
        for request, limit in prefilling:
            if budget == 0:
                break
            if any(chunk.request is request for chunk in output.prefill):
                continue
            chunk = self._chunk(request, min(budget, limit))
            if chunk:
                output.prefill.append(chunk)
                budget -= chunk.num_tokens
        self._admit(output, budget, turns, burst)
        if turns is not None or self._paused:
            self._pause_lower_tiers(output)
        return output

    def _pause_lower_tiers(self, output: SchedulerOutput) -> None:
        """A step that prefills a higher tier than some decoding row's runs that prefill alone:
        every row waits the step (on the CPU a decode step costs in proportion to its rows, a
        batch's flex rows several times a short prompt's prefill, and the higher tier's first
        token would wait for them; the runner decodes all of its rows or none, so the prompt's
        own tier waits the step too, as its rows would have carried the prompt's prefill).
        Never two steps running, so the lower tiers still advance at least every other step;
        never while running ahead, nor (on a hybrid model) where a prompt completes, whose
        last token goes in with the decode step (engine/core/runner.py)."""
        if self._paused or not output.decode or not output.prefill or not self.allow_preemption:
            self._paused = False
            return
        top = min(chunk.request.service.rank for chunk in output.prefill)
        if all(seq.request.service.rank <= top for seq in output.decode):
            return  # no lower tier rides along: the step stays mixed
        chunks = [c for c in output.prefill if c.request.service.rank == top]
        if self.hybrid and any(chunk.completes_prompt for chunk in chunks):
            return
        output.decode, output.drafts, output.draft_lengths = [], {}, {}
        # The step is theirs alone: their chunks get the step's whole budget, not what a step
        # beside the decode would have left them (a prompt split over paused and decoding steps
        # would wait for the decode steps in between).
        budget = self.max_num_batched_tokens
        output.prefill = []  # lower tiers' chunks come in later steps
        for chunk in chunks:
            whole = self._chunk(chunk.request, budget) if budget > 0 else None
            chunk = whole if whole is not None and whole.num_tokens > chunk.num_tokens else chunk
            output.prefill.append(chunk)
            budget -= chunk.num_tokens
        self._paused = True

    def _admit(
        self,
        output: SchedulerOutput,
        budget: int,
        turns: Turns | None,
        burst: bool,
        above: int | None = None,
    ) -> int:
        """Admit waiting requests in turn (those of a tier above rank `above` only, if set)
        while rows, memory and the step's token budget last; returns the budget left."""
        num_seqs = self.num_running_seqs
        just_preempted = {id(request) for request in output.preempted}
        yielding = self.fairness.yielding if self.fairness is not None else None
        yielded = yielding.rows(self.running) if yielding is not None else 0
        while self.waiting and budget > 0:
            request = self.waiting[0] if turns is None else turns.pick(self.waiting)
            if above is not None and request.service.rank >= above:
                break
            if yielding is not None and yielding.yields(request):
                if yielded + len(request.sequences) > yielding.max_rows:
                    break  # a higher tier has work: the lower ones hold their share only
                yielded += len(request.sequences)
            if id(request) in just_preempted:
                break  # its state reaches the prefix cache only when the runner has run
            if num_seqs + len(request.sequences) > self.max_num_seqs:
                break  # nobody overtakes the one whose turn it is
            if not self._fits(request, num_seqs):
                break
            if burst and output.prefill and request.num_prefill_tokens > budget:
                # Whole prompts while a burst is admitted: those that complete in one step
                # are prefilled as one batch (engine/core/runner.py), a split one alone twice.
                break
            self.waiting.remove(request)
            self.running.append(request)
            for seq in request.sequences:
                seq.status = RequestStatus.RUNNING
            num_seqs += len(request.sequences)
            if turns is not None:
                turns.rows.add(request, len(request.sequences))
            self._match(request)
            if self.fairness is not None and not request.num_preemptions:
                uncached = request.num_prompt_tokens - request.sequences[0].num_computed_tokens
                self.fairness.charge_prefill(request, uncached)
            chunk = self._chunk(request, budget)
            output.prefill.append(chunk)
            budget -= chunk.num_tokens
        return budget

    def account(self, sampled) -> None:
        """After a step: charge each generated token to its request's tenant."""
        if self.fairness is not None:
            for item in sampled:
                self.fairness.charge_decode(item.seq.request, 1)

    def kv_cache_bytes(self) -> int:
        """What the running sequences' caches hold now, as the memory budget counts a batch
        (every row at the longest row's length); 0 without a budget."""
        if self.memory is None:
            return 0
        return self.memory.need(
            [seq.num_tokens for r in self.running for seq in r.live_sequences()]
        )

    def tenant_stats(self) -> dict[str, dict[str, int]]:
        """Per tenant: requests waiting, rows running, tokens served (fairness.TenantStats)."""
        stats: dict[str, list[int]] = {}
        for request in self.waiting:
            stats.setdefault(request.service.tenant, [0, 0])[0] += 1
        for request in self.running:
            stats.setdefault(request.service.tenant, [0, 0])[1] += len(request.live_sequences())
        served = self.fairness.served if self.fairness is not None else {}
        return {
            tenant: TenantStats(*stats.get(tenant, (0, 0)), *served.get(tenant, (0, 0))).to_dict()
            for tenant in {*stats, *served}
        }

    def _prefill_order(self) -> list[tuple[Request, int]]:
        """Running requests still prefilling, each with the most tokens it may take first:
        arrival order, or with fair share, by turn, where the first of each lower tier has
        `min_tier_share` of the budget before the higher tiers' turns."""
        prefilling = [r for r in self.running if r.sequences[0].is_prefilling]
        unlimited = self.max_num_batched_tokens
        if self.fairness is None or len(prefilling) < 2:
            return [(request, unlimited) for request in prefilling]
        prefilling.sort(key=self.fairness.order)
        top = prefilling[0].service.rank
        share = self.fairness.min_tier_share
        reserve = max(1, math.ceil(share * self.max_num_batched_tokens)) if share else 0
        first_of_tier: dict[int, Request] = {}
        for request in prefilling:
            first_of_tier.setdefault(request.service.rank, request)
        lower = [r for rank, r in first_of_tier.items() if rank > top] if reserve else []
        order = [(request, reserve) for request in lower]
        order += [(r, unlimited) for r in prefilling if not any(r is x for x in lower)]
        return order

    def _num_prefilling(self) -> int:
        running = sum(1 for request in self.running if request.sequences[0].is_prefilling)
        return running + len(self.waiting)

    def _head_remaining(self) -> int:
        """Prompt tokens left of the first request in arrival order still prefilling."""
        for request in [*self.running, *self.waiting]:
            lead = request.sequences[0]
            if lead.is_prefilling:
                return request.num_prefill_tokens - lead.num_computed_tokens
        return 0

    def _match(self, request: Request) -> None:
        if self.prefix_cache is None:
            for seq in request.sequences:
                seq.num_computed_tokens = 0  # a preempted request computes its cache again
            return
        hit = self.prefix_cache.match(
            request.prefill_token_ids,
            limit=request.num_prefill_tokens - 1,
            scope=request.cache_scope,
        )
        if hit.length:
            self.prefix_cache.lock(hit)  # until the runner has seeded the request's cache
            request.prefix_hit = hit
        for seq in request.sequences:
            seq.num_computed_tokens = hit.length

    def _fits(self, request: Request, num_seqs: int, excluding: list[Request] = ()) -> bool:
        """Whether admitting `request` keeps the batch and the prefix cache within memory
        (without the running requests `excluding`); cache entries are evicted first. With
        nothing running a request is always admitted: validation refused the ones that can
        never fit."""
        running = [r for r in self.running if not any(r is x for x in excluding)]
        if self.memory is None or not running:
            return True
        lengths = [r.num_prompt_tokens + r.max_tokens for r in running for _ in r.live_sequences()]
        # Rows counted in `num_seqs` but not running yet (admitted in this plan) at this
        # request's length, as its own.
        more = max(0, num_seqs - len(lengths)) + len(request.sequences)
        need = self.memory.need(lengths + [request.num_prompt_tokens + request.max_tokens] * more)
        # What prompts hold while they prefill beyond their caches (an image's vision tower).
        need += request.prefill_bytes + sum(
            r.prefill_bytes for r in running if r.sequences[0].is_prefilling
        )
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
        end = min(request.num_prefill_tokens, start + budget)
        # End at the next checkpoint, so its state can be kept there.
        end = next((c for c in request.checkpoints if start < c < end), end)
        return PrefillChunk(request, start, end - start)

    def remove(self, request_id: str) -> Request | None:
        """Take a request out (finished or aborted); None when it is not here."""
        for queue in (self.running, self.waiting):
            for request in queue:
                if request.request_id == request_id:
                    queue.remove(request)
                    if self.fairness is not None:
                        self.fairness.leave(request)
                    return request
        return None

    def remove_finished(self) -> list[Request]:
        finished = [request for request in self.running if request.is_finished]
        if finished:
            self.running = [request for request in self.running if not request.is_finished]
            if self.fairness is not None:
                for request in finished:
                    self.fairness.leave(request)
        return finished

    def clear(self) -> list[Request]:
        """Take every request out (the engine is closing); returns them."""
        requests = [*self.running, *self.waiting]
        self.running.clear()
        self.waiting.clear()
        if self.fairness is not None:
            for request in requests:
                self.fairness.leave(request)
        return requests


def _rank(tier: str) -> int:
    return SERVICE_TIERS.index(tier)
