"""Fair share between tenants, and service tiers: whom the scheduler serves next.

The Virtual Token Counter (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024):
each tenant (a team: `ServiceClass.tenant`) has a counter, the service it received divided by
its weight, where service is prefill tokens × PREFILL_COST plus decode tokens × DECODE_COST
(prompt tokens the prefix cache provides cost nothing, nor does recomputing a preempted
sequence). Among the tenants with work, the one with the smallest counter goes next. A tenant
that gets work after having none is lifted to the smallest counter among those that have some,
so an idle tenant banks no credit and one that was alone is not punished for it: a tenant that
uses less than its share loses nothing, and an idle server gives everything to whoever is there.
Within a tenant the same counters run per principal (an API key), unweighted.

Tiers (`ServiceClass.tier`, engine.protocol.SERVICE_TIERS) come before counters: a higher tier
is admitted first, and may preempt a lower tier's rows (engine/core/scheduler.py). So that the
lowest tier is never starved by a steady higher-tier load, each tier below the top keeps at
least `guaranteed_rows` of the batch while it has work: it is admitted first while under that,
and never preempted below it.

Slots within a tier: `fair_rows` divides a number of rows between tenants by weight, max-min fair
(a tenant that wants fewer than its share gets what it wants, the rest is shared by the others);
the scheduler preempts a tenant's row for another only when the first holds more than its fair
rows and the second fewer.

Pure bookkeeping over engine.core.request state: no model, no clock; tested without either.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from engine.core.request import Request
from engine.protocol import SERVICE_TIERS


@dataclass(frozen=True)
class TenantStats:
    """One tenant's place in an engine: requests waiting, rows running, tokens served."""

    waiting: int = 0
    running: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0

    def to_dict(self) -> dict[str, int]:
        return {
            "waiting": self.waiting,
            "running": self.running,
            "prefill_tokens": self.prefill_tokens,
            "decode_tokens": self.decode_tokens,
        }


class FairShare:
    """The counters; the scheduler tells it who arrives, leaves and was served."""

    PREFILL_COST = 1.0
    # A decode token costs more than a prefill token: it holds a row of the batch for a step
    # (the paper's weights).
    DECODE_COST = 2.0

    def __init__(
        self, *, max_num_seqs: int, min_tier_share: float = 0.1, yield_share: float = 0.25
    ):
        """`yield_share`: the rows the lowest tier keeps while a higher tier has requests
        (`Yielding`; 1: all of them, it yields nothing)."""
        if not 0 <= min_tier_share < 1 or not 0 < yield_share <= 1:
            raise ValueError("min_tier_share must be in [0, 1), yield_share in (0, 1]")
        self.min_tier_share = min_tier_share
        self.guaranteed_rows = (
            max(1, math.floor(min_tier_share * max_num_seqs)) if min_tier_share else 0
        )
        self.yielding = Yielding(max(self.guaranteed_rows, math.floor(yield_share * max_num_seqs)))
        self._tenants: dict[str, float] = {}
        self._principals: dict[tuple[str, str], float] = {}
        self._active: Counter[str] = Counter()
        self._active_principals: Counter[tuple[str, str]] = Counter()
        # Totals since the engine started, per tenant: [prefill, decode] tokens (metrics).
        self.served: dict[str, list[int]] = {}

    # -- arrivals and departures ---------------------------------------------------------

    def arrive(self, request: Request) -> None:
        """A request joins the engine (queued): its tenant and principal become active."""
        service = request.spec.service
        tenant, principal = service.tenant, (service.tenant, service.principal)
        if not self._active[tenant]:
            _lift(self._tenants, tenant, self._active)
        self._active[tenant] += 1
        if not self._active_principals[principal]:
            peers = {p: n for p, n in self._active_principals.items() if p[0] == tenant}
            _lift(self._principals, principal, peers)
        self._active_principals[principal] += 1

    def leave(self, request: Request) -> None:
        """A request is gone (finished or aborted; a preempted one stays)."""
        service = request.spec.service
        tenant, principal = service.tenant, (service.tenant, service.principal)
        self._active[tenant] -= 1
        if self._active[tenant] <= 0:
            del self._active[tenant]
        self._active_principals[principal] -= 1
        if self._active_principals[principal] <= 0:
            del self._active_principals[principal]
        if not self._active:
            # An idle engine: the past no longer matters to anyone (arrivals are lifted to
            # the least active counter, and there is none).
            self._tenants.clear()
            self._principals.clear()
        else:
            _forget_idle(self._tenants, self._active)
            _forget_idle(self._principals, self._active_principals)

    # -- service --------------------------------------------------------------------------

    def charge_prefill(self, request: Request, num_tokens: int) -> None:
        self._charge(request, num_tokens * self.PREFILL_COST)
        self._served(request.spec.service.tenant)[0] += num_tokens

    def charge_decode(self, request: Request, num_tokens: int) -> None:
        self._charge(request, num_tokens * self.DECODE_COST)
        self._served(request.spec.service.tenant)[1] += num_tokens

    def _charge(self, request: Request, cost: float) -> None:
        service = request.spec.service
        self._tenants[service.tenant] = self._tenants.get(service.tenant, 0.0) + (
            cost / service.weight
        )
        key = (service.tenant, service.principal)
        self._principals[key] = self._principals.get(key, 0.0) + cost

    def _served(self, tenant: str) -> list[int]:
        served = self.served.get(tenant)
        if served is None:
            served = self.served[tenant] = [0, 0]
        return served

    # -- order ----------------------------------------------------------------------------

    def counter(self, tenant: str) -> float:
        return self._tenants.get(tenant, 0.0)

    def order(self, request: Request) -> tuple:
        """Sort key: who goes first (tier, tenant's counter, principal's, arrival)."""
        service = request.spec.service
        return (
            service.rank,
            self._tenants.get(service.tenant, 0.0),
            self._principals.get((service.tenant, service.principal), 0.0),
            request.arrived_at,
        )

    def protected(self, tier: str, rows_by_tier: Mapping[str, int], rows: int) -> bool:
        """Whether taking `rows` rows from `tier` would leave it under its guarantee."""
        if SERVICE_TIERS.index(tier) == 0:
            return False
        return rows_by_tier.get(tier, 0) - rows < self.guaranteed_rows


# While a higher tier has requests, the lowest tier (flex: batches' lines) holds at most its
# `yield_share` of the rows, and keeps to it for YIELD_HOLD_STEPS steps after the higher tiers
# last had any, so that requests arriving one after another do not make it grow and shrink in
# between.
YIELD_HOLD_STEPS = 32
LOWEST_RANK = len(SERVICE_TIERS) - 1


class Yielding:
    """The lowest tier yields rows to the higher ones while they have work: a step's time grows
    with its rows (on the CPU nearly in proportion), and a higher tier's first token waits for
    the step in flight, so a full batch of flex rows (a /v1/batches run) would slow every
    interactive request several times over although the rows are not needed. While a higher
    tier has requests the lowest is admitted up to `max_rows` rows, and held to it (preempted:
    engine/core/scheduler.py); alone, it fills the batch again."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.active = False  # a higher tier has (or just had) requests
        self._hold = 0

    def step(self, requests: list[Request]) -> bool:
        """Whether the lowest tier yields this step, given the requests in the engine."""
        if any(request.spec.service.rank < LOWEST_RANK for request in requests):
            self._hold = YIELD_HOLD_STEPS
            self.active = True
        elif self._hold > 0:
            self._hold -= 1
        else:
            self.active = False
        return self.active

    def yields(self, request: Request) -> bool:
        return self.active and request.spec.service.rank == LOWEST_RANK

    def rows(self, requests: list[Request]) -> int:
        """Rows the yielding requests of `requests` hold."""
        return sum(len(r.live_sequences()) for r in requests if self.yields(r))

    def over(self, running: list[Request]) -> list[Request]:
        """Running requests to preempt so that the yielding ones hold at most `max_rows`: the
        latest arrivals first (the earliest keep going and finish)."""
        held = self.rows(running)
        victims = []
        for request in sorted(running, key=lambda r: -r.arrived_at):
            if held <= self.max_rows:
                break
            if self.yields(request) and request.can_resume:
                victims.append(request)
                held -= len(request.live_sequences())
        return victims


def fair_rows(
    demands: Mapping[str, int], weights: Mapping[str, float], capacity: int
) -> dict[str, float]:
    """Max-min fair division of `capacity` rows among tenants wanting `demands`, by weight."""
    share: dict[str, float] = {}
    left = dict(demands)
    room = float(capacity)
    while left and room > 0:
        total = sum(weights[t] for t in left)
        satisfied = {t: d for t, d in left.items() if d <= room * weights[t] / total}
        if not satisfied:
            for tenant in left:
                share[tenant] = room * weights[tenant] / total
            return share
        for tenant, demand in satisfied.items():
            share[tenant] = demand
            room -= demand
            del left[tenant]
    for tenant in left:
        share[tenant] = 0.0
    return share


def _lift(counters: dict, key, active: Mapping) -> None:
    floor = min((counters.get(other, 0.0) for other, n in active.items() if n > 0), default=None)
    if floor is not None:
        counters[key] = max(counters.get(key, 0.0), floor)


def _forget_idle(counters: dict, active: Mapping) -> None:
    # An idle entry at or under the least active counter would be lifted to it on return:
    # keeping it changes nothing, so it goes (the dict stays as small as the active set plus
    # those who were served more than the rest).
    floor = min(counters.get(key, 0.0) for key in active)
    for key in [k for k, value in counters.items() if k not in active and value <= floor]:
        del counters[key]


class Turns:
    """Whose turn it is, for one step's admissions: a lower tier under its guaranteed rows
    first, then by tier; within a tier, tenants under their fair rows (engine/core/fairness.py
    `fair_rows`, from the rows running and the requests waiting) before those at or over
    them, then by the fair-share counters."""

    def __init__(self, scheduler):
        self.fairness = scheduler.fairness
        self.rows = Rows(scheduler.running)
        demands: dict[str, Counter[str]] = {tier: Counter() for tier in SERVICE_TIERS}
        weights: dict[str, float] = {}
        queued = [(r, len(r.sequences)) for r in scheduler.waiting]
        for request, n in [*((r, len(r.live_sequences())) for r in scheduler.running), *queued]:
            service = request.service
            demands[service.tier][service.tenant] += n
            weights[service.tenant] = service.weight
        self.alloc: dict[str, dict[str, float]] = {}
        room = scheduler.max_num_seqs
        for tier in SERVICE_TIERS:
            self.alloc[tier] = fair_rows(demands[tier], weights, room)
            room = max(0, room - sum(demands[tier].values()))

    def pick(self, pending, rows: Rows | None = None) -> Request:
        rows = rows or self.rows
        fairness = self.fairness
        guaranteed = fairness.guaranteed_rows
        starved = [
            r
            for r in pending
            if r.service.rank > 0 and rows.by_tier.get(r.service.tier, 0) < guaranteed
        ]

        def turn(request: Request) -> tuple:
            service = request.service
            held = rows.by_tenant[service.tier].get(service.tenant, 0)
            at_share = held >= math.ceil(self.alloc[service.tier].get(service.tenant, 0))
            return (service.rank, at_share, *fairness.order(request)[1:])

        return min(starved or pending, key=turn)


class Rows:
    """Rows of the batch by tier and by (tier, tenant), as admission plans change them."""

    def __init__(self, running: list[Request] = ()):
        self.total = 0
        self.by_tier: Counter[str] = Counter()
        self.by_tenant: dict[str, Counter[str]] = {tier: Counter() for tier in SERVICE_TIERS}
        for request in running:
            self.add(request, len(request.live_sequences()))

    def add(self, request: Request, n: int) -> None:
        self.total += n
        self.by_tier[request.service.tier] += n
        self.by_tenant[request.service.tier][request.service.tenant] += n

    def copy(self) -> Rows:
        rows = Rows()
        rows.total = self.total
        rows.by_tier = Counter(self.by_tier)
        rows.by_tenant = {tier: Counter(c) for tier, c in self.by_tenant.items()}
        return rows
