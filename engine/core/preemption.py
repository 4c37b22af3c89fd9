"""Preemption, the scheduler's part that takes running requests out of the batch for waiting ones
(engine/core/scheduler.py's docstring says when): a mixin of `Scheduler`, kept apart so that
each file reads whole."""

from __future__ import annotations

import math
from typing import Protocol

from engine.core.fairness import Rows, Turns
from engine.core.request import Request
from engine.protocol import RequestStatus


class _Step(Protocol):
    """What preemption writes of a step's plan (a `SchedulerOutput`)."""

    preempted: list[Request]


class Preemption:
    MAX_ROOM_PER_STEP = 8  # waiting requests a step makes room for

    def _make_room(self, output: _Step, turns: Turns) -> None:
        """Preempt running requests for waiting ones that cannot be admitted (module docs)."""
        rows = turns.rows.copy()
        pending = list(self.waiting)
        victims: list[Request] = []
        for _ in range(self.MAX_ROOM_PER_STEP):
            candidate = turns.pick(pending, rows) if pending else None
            if candidate is None:
                break
            pending.remove(candidate)
            need = len(candidate.sequences)
            if rows.total + need <= self.max_num_seqs and self._fits(
                candidate, rows.total, excluding=victims
            ):
                rows.add(candidate, need)  # its turn comes without preempting anyone
                continue
            chosen = self._victims(candidate, rows, turns.alloc, victims)
            if chosen is None:
                break  # nobody overtakes the one whose turn it is
            for victim in chosen:
                rows.add(victim, -len(victim.live_sequences()))
                victims.append(victim)
            rows.add(candidate, need)
        for victim in victims:
            turns.rows.add(victim, -len(victim.live_sequences()))
            self._preempt(victim, output)

    def _victims(
        self,
        candidate: Request,
        rows: Rows,
        allocations: dict[str, dict[str, float]],
        taken: list[Request],
    ) -> list[Request] | None:
        """Running requests whose preemption lets `candidate` in, or None if none would."""
        fairness = self.fairness
        service = candidate.service
        need = len(candidate.sequences)
        running = [r for r in self.running if r.can_resume and not any(r is t for t in taken)]
        lower = sorted(
            (r for r in running if r.service.rank > service.rank),
            key=lambda r: (-r.service.rank, -fairness.counter(r.service.tenant), -r.arrived_at),
        )
        # The same tier: tenants over their fair rows, for a tenant under its own.
        alloc = allocations[service.tier]
        held = rows.by_tenant[service.tier]
        same: list[Request] = []
        if held.get(service.tenant, 0) + need <= math.ceil(alloc.get(service.tenant, 0)):
            same = sorted(
                (
                    r
                    for r in running
                    if r.service.tier == service.tier and r.service.tenant != service.tenant
                ),
                key=lambda r: (
                    -(held[r.service.tenant] - alloc.get(r.service.tenant, 0)) / r.service.weight,
                    -r.arrived_at,
                ),
            )
        trial = rows.copy()
        chosen: list[Request] = []
        for victim in [*lower, *same]:
            n = len(victim.live_sequences())
            tier, tenant = victim.service.tier, victim.service.tenant
            if victim.service.rank > service.rank:
                if fairness.protected(tier, trial.by_tier, n):
                    continue
            elif trial.by_tenant[tier].get(tenant, 0) - n < alloc.get(tenant, 0):
                continue
            chosen.append(victim)
            trial.add(victim, -n)
            if trial.total + need <= self.max_num_seqs and self._fits(
                candidate, trial.total, excluding=[*taken, *chosen]
            ):
                return chosen
        return None

    def _preempt(self, request: Request, output: _Step) -> None:
        self.running.remove(request)
        if len(request.sequences) == 1:
            request.resumed_token_ids = tuple(request.sequences[0].output_token_ids)
        for seq in request.live_sequences():
            seq.status = RequestStatus.WAITING
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(request)
        output.preempted.append(request)
