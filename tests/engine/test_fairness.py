"""Fair share between tenants, service tiers and preemption, as scheduling policy without a
model (engine/core/fairness.py, engine/core/scheduler.py)."""

from collections import Counter
from types import SimpleNamespace

import pytest

from engine.core.fairness import FairShare, fair_rows
from engine.core.request import Request, Sequence
from engine.core.scheduler import Scheduler
from engine.protocol import GenerationRequest, RequestStatus, SamplingParams, ServiceClass


class _State:
    def __init__(self, params):
        self.params = params


_clock = iter(range(10**9))


def request(
    rid: str,
    tenant: str,
    *,
    num_prompt: int = 4,
    max_tokens: int = 8,
    weight: float = 1.0,
    tier: str = "default",
    key: str = "",
    n: int = 1,
) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n)
    service = ServiceClass(tenant=tenant, weight=weight, principal=key, tier=tier)
    spec = GenerationRequest(rid, "m", tuple(range(1, num_prompt + 1)), params, service=service)
    req = Request(spec, emit=lambda output: None, max_tokens=max_tokens)
    req.arrived_at = next(_clock)  # arrival order without a clock
    req.sequences = [Sequence(req, i, _State(params), detokenizer=None) for i in range(n)]
    return req


def scheduler(max_num_seqs: int = 8, tokens: int = 256, **kwargs) -> Scheduler:
    fairness = FairShare(max_num_seqs=max_num_seqs, **kwargs)
    return Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=tokens, fairness=fairness)


def step(sched: Scheduler) -> tuple[Counter, object]:
    """Run one planned step as the engine would: advance, sample where caught up (token 7),
    charge the tokens, drop finished requests. Returns tokens generated per tenant."""
    plan = sched.schedule()
    for seq in plan.decode:
        seq.num_computed_tokens += 1
    for chunk in plan.prefill:
        for seq in chunk.request.live_sequences():
            seq.num_computed_tokens += chunk.num_tokens
    sampled = []
    for req in sched.running:
        for seq in req.live_sequences():
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(7)
                sampled.append(SimpleNamespace(seq=seq))
                if len(seq.output_token_ids) >= req.max_tokens:
                    seq.status = RequestStatus.FINISHED_LENGTH
    sched.account(sampled)
    sched.remove_finished()
    return Counter(item.seq.request.service.tenant for item in sampled), plan


def run(sched: Scheduler, steps: int, refill=None) -> Counter:
    served = Counter()
    for index in range(steps):
        if refill is not None:
            refill(sched, index)
        tokens, _ = step(sched)
        served += tokens
    return served


def backlog(sched: Scheduler, tenant: str, count: int, **kwargs) -> None:
    for i in range(count):
        sched.add(request(f"{tenant}{i}-{next(_clock)}", tenant, **kwargs))


def keep_backlogged(tenants: dict[str, dict]):
    """A refill that keeps each tenant's queue at least 16 requests deep."""

    def refill(sched: Scheduler, _index: int) -> None:
        for tenant, kwargs in tenants.items():
            queued = sum(1 for r in sched.waiting if r.service.tenant == tenant)
            if queued < 16:
                backlog(sched, tenant, 16 - queued, **kwargs)

    return refill


@pytest.mark.parametrize("weights", [(1, 1), (3, 1)])
def test_backlogged_tenants_are_served_in_proportion_to_their_weights(weights):
    wa, wb = weights
    sched = scheduler(max_num_seqs=8)
    served = run(
        sched,
        400,
        keep_backlogged({"A": {"weight": wa, "max_tokens": 16}, "B": {"weight": wb}}),
    )
    share = served["A"] / (served["A"] + served["B"])
    assert share == pytest.approx(wa / (wa + wb), abs=0.1 * wa / (wa + wb))


def test_an_idle_server_gives_everything_to_whoever_is_there():
    sched = scheduler(max_num_seqs=8)
    backlog(sched, "A", 40)
    step(sched)
    assert sched.num_running_seqs == 8
    served = run(sched, 20)
    assert set(served) == {"A"} and served["A"] >= 8 * 19


def test_a_tenant_arriving_late_gets_its_share_but_no_credit_for_its_idle_time():
    sched = scheduler(max_num_seqs=8)
    refill = keep_backlogged({"A": {}})
    run(sched, 200, refill)  # A alone for a long time: a large counter
    both = keep_backlogged({"A": {}, "B": {}})
    first = run(sched, 20, both)
    assert first["B"] > 0, "B is served soon after it arrives"
    later = run(sched, 300, both)
    share = later["B"] / (later["A"] + later["B"])
    assert share == pytest.approx(0.5, abs=0.05), "B did not bank credit while it was idle"


def test_a_tenant_using_less_than_its_share_is_served_at_once():
    sched = scheduler(max_num_seqs=8)
    backlog(sched, "A", 30, max_tokens=50)
    for _ in range(3):
        step(sched)
    assert sched.num_running_seqs == 8
    sched.add(request("b1", "B", max_tokens=3))
    tokens, plan = step(sched)
    assert [r.request_id for r in plan.preempted] and all(
        r.service.tenant == "A" for r in plan.preempted
    )
    assert any(r.request_id == "b1" for r in sched.running), "B's request was admitted"
    for _ in range(2):
        tokens += step(sched)[0]
    assert tokens["B"] == 3 and not any(r.request_id == "b1" for r in sched.running)


def test_within_a_tenant_keys_share_as_tenants_do():
    sched = scheduler(max_num_seqs=4)
    backlog(sched, "A", 20, key="k1")
    backlog(sched, "A", 2, key="k2")
    step(sched)
    keys = Counter(r.spec.service.principal for r in sched.running)
    assert keys["k2"] == 2, keys


def test_fair_rows_is_max_min_fair_by_weight():
    assert fair_rows({"A": 96, "B": 4}, {"A": 1, "B": 1}, 64) == {"B": 4, "A": 60}
    assert fair_rows({"A": 96, "B": 96}, {"A": 3, "B": 1}, 64) == {"A": 48, "B": 16}
    assert fair_rows({"A": 2, "B": 2}, {"A": 1, "B": 1}, 64) == {"A": 2, "B": 2}


def test_preemption_settles_at_the_fair_rows_and_does_not_thrash():
    sched = scheduler(max_num_seqs=8)
    backlog(sched, "A", 40, max_tokens=1000)
    step(sched)
    backlog(sched, "B", 40, max_tokens=1000)
    preempted = Counter()
    for _ in range(60):
        _, plan = step(sched)
        preempted.update(r.service.tenant for r in plan.preempted)
    rows = Counter(r.service.tenant for r in sched.running)
    assert rows == {"A": 4, "B": 4}
    assert preempted == {"A": 4}, "only what the fair rows asked for"


def test_a_higher_tier_goes_first_and_preempts_a_lower_one():
    sched = scheduler(max_num_seqs=8, min_tier_share=0.25, yield_share=1.0)
    backlog(sched, "A", 20, tier="flex", max_tokens=1000)
    step(sched)
    assert sched.num_running_seqs == 8
    sched.add(request("p1", "B", tier="priority", max_tokens=4))
    sched.add(request("d1", "C", tier="default", max_tokens=4))
    _, plan = step(sched)
    assert len(plan.preempted) == 2 and {r.service.tier for r in plan.preempted} == {"flex"}
    running = {r.request_id for r in sched.running}
    assert {"p1", "d1"} <= running
    # The priority prompt is prefilled alone this step (the flex rows pause for it).
    assert [c.request.request_id for c in plan.prefill] == ["p1"] and plan.decode == []
    # Another flex request waits: the priority tier's does not.
    sched.add(request("p2", "B", tier="priority", max_tokens=4))
    _, plan = step(sched)
    assert "p2" in {r.request_id for r in sched.running}
    assert {r.service.tier for r in sched.waiting} == {"flex"}


def test_the_lowest_tier_keeps_its_minimum_share_under_a_steady_higher_load():
    sched = scheduler(max_num_seqs=8, min_tier_share=0.25)  # 2 rows of 8
    served = run(
        sched,
        300,
        keep_backlogged({"P": {"tier": "priority"}, "F": {"tier": "flex", "max_tokens": 4}}),
    )
    assert served["F"] > 0
    share = served["F"] / (served["F"] + served["P"])
    assert 0.15 <= share <= 0.35, share


# The preemption tests below take rows for a waiting request only (the lowest tier's yielding
# to a busy higher tier, which also preempts, is off: yield_share=1.0; its own test follows).


def test_a_preempted_request_resumes_with_what_it_generated_and_pays_once():
    sched = scheduler(max_num_seqs=2, min_tier_share=0, yield_share=1.0)
    fairness = sched.fairness
    victim = request("v", "A", tier="flex", num_prompt=10, max_tokens=20)
    other = request("w", "A", tier="flex", num_prompt=10, max_tokens=20)
    sched.add(victim)
    sched.add(other)
    for _ in range(5):
        step(sched)
    generated = list(victim.sequences[0].output_token_ids)
    assert len(generated) == 5
    charged = fairness.counter("A")
    sched.add(request("p", "B", tier="priority", max_tokens=2))
    _, plan = step(sched)
    (preempted,) = plan.preempted
    assert preempted is other  # the newest of the lower tier
    assert preempted.resumed_token_ids == tuple(preempted.sequences[0].output_token_ids)
    assert preempted.num_prefill_tokens == 10 + 5
    assert preempted.sequences[0].status == RequestStatus.WAITING
    while any(r.service.tenant == "B" for r in [*sched.running, *sched.waiting]):
        step(sched)
    while sched.has_work():
        step(sched)
    assert len(other.sequences[0].output_token_ids) == 20
    # A paid for its prompts once and for its 40 tokens, not for recomputing `other`.
    expected = (2 * 10) * FairShare.PREFILL_COST + 40 * FairShare.DECODE_COST
    assert fairness.served["A"] == [20, 40]
    assert charged < expected


def test_requests_with_several_generated_choices_are_never_preempted():
    sched = scheduler(max_num_seqs=2, min_tier_share=0)
    sched.add(request("n2", "A", tier="flex", n=2, max_tokens=50))
    for _ in range(3):
        step(sched)
    sched.add(request("p", "B", tier="priority"))
    _, plan = step(sched)
    assert plan.preempted == []
    assert [r.request_id for r in sched.waiting] == ["p"]


def test_no_preemption_while_the_runner_runs_ahead():
    sched = scheduler(max_num_seqs=2, min_tier_share=0, yield_share=1.0)
    backlog(sched, "A", 2, tier="flex", max_tokens=50)
    step(sched)
    sched.add(request("p", "B", tier="priority"))
    sched.allow_preemption = False
    _, plan = step(sched)
    assert plan.preempted == []
    sched.allow_preemption = True
    _, plan = step(sched)
    assert len(plan.preempted) == 1


def test_the_lowest_tier_yields_rows_while_a_higher_tier_has_work():
    """A batch's flex rows fill the engine alone; while interactive requests run, flex keeps
    its yield share (4 of 16 rows here: a step's time follows its rows), and takes the batch
    back some steps after they have ended."""
    sched = scheduler(max_num_seqs=16, min_tier_share=0.1, yield_share=0.25)
    backlog(sched, "A", 40, tier="flex", max_tokens=1000)
    step(sched)
    assert sched.num_running_seqs == 16
    sched.add(request("d1", "B", tier="default", max_tokens=20))
    _, plan = step(sched)
    assert len(plan.preempted) == 12 and {r.service.tier for r in plan.preempted} == {"flex"}
    assert all(not r.sequences[0].output_token_ids or r.resumed_token_ids for r in plan.preempted)
    for _ in range(10):
        _, plan = step(sched)
        flex = [s for s in plan.decode if s.request.service.tier == "flex"]
        assert len(flex) <= 4 and sum(r.service.tier == "flex" for r in sched.running) == 4
    while any(r.service.tier == "default" for r in [*sched.running, *sched.waiting]):
        step(sched)
    step(sched)
    assert sum(r.service.tier == "flex" for r in sched.running) == 4  # held a while
    for _ in range(40):
        step(sched)
    assert sched.num_running_seqs == 16  # alone again: the batch fills the engine


def test_counters_are_forgotten_when_the_engine_is_idle():
    sched = scheduler(max_num_seqs=2)
    backlog(sched, "A", 3, max_tokens=2)
    while sched.has_work():
        step(sched)
    assert sched.fairness._tenants == {} and sched.fairness._principals == {}
    assert sched.fairness.served["A"] == [12, 6]


def test_without_fair_share_admission_is_arrival_order():
    sched = Scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    backlog(sched, "A", 4, max_tokens=100)
    sched.add(request("p", "B", tier="priority"))
    for _ in range(3):
        _, plan = step(sched)
        assert plan.preempted == []
    assert [r.request_id for r in sched.waiting][-1] == "p"


def test_a_higher_tiers_prefill_runs_alone_but_never_two_steps_running():
    sched = scheduler(max_num_seqs=8, min_tier_share=0, yield_share=1.0)
    backlog(sched, "A", 4, tier="flex", max_tokens=100)
    step(sched)
    sched.add(request("p1", "B", tier="priority", num_prompt=20, max_tokens=4))
    sched.add(request("p2", "B", tier="priority", num_prompt=20, max_tokens=4))
    sched.prefill_chunk_tokens = sched.admission_chunk_tokens = 10
    _, plan = step(sched)
    assert plan.decode == [] and {c.request.request_id for c in plan.prefill} <= {"p1", "p2"}
    # The paused step is the priority prompts' alone: they get its whole budget, not the
    # 10-token chunks a step beside the decode leaves.
    assert [(c.request.request_id, c.num_tokens) for c in plan.prefill] == [("p1", 20)]
    _, plan = step(sched)
    flex = [seq for seq in plan.decode if seq.request.service.tier == "flex"]
    assert len(flex) == 4, "the flex rows decode the next step"
    # With priority rows decoding beside the flex ones, a priority prompt still runs alone
    # (the flex rows would ride along in its step), its own tier's rows waiting that step too.
    while any(r.sequences[0].is_prefilling for r in sched.running):
        step(sched)
    sched.add(request("p3", "B", tier="priority", num_prompt=20, max_tokens=4))
    _, plan = step(sched)
    assert plan.decode == [] and [c.request.request_id for c in plan.prefill] == ["p3"]
    _, plan = step(sched)
    assert {seq.request.service.tier for seq in plan.decode} == {"priority", "flex"}


def test_a_prompt_beside_rows_of_its_own_tier_only_shares_their_step():
    sched = scheduler(max_num_seqs=8, min_tier_share=0, yield_share=1.0)
    backlog(sched, "A", 3, tier="priority", max_tokens=100)
    while sched.waiting or any(r.sequences[0].is_prefilling for r in sched.running):
        step(sched)
    sched.add(request("p", "B", tier="priority", num_prompt=20, max_tokens=4))
    _, plan = step(sched)
    assert len(plan.decode) == 3 and [c.request.request_id for c in plan.prefill] == ["p"]


def test_a_full_waiting_queue_still_takes_another_teams_requests(tiny_llama):
    """max_waiting is shared fairly: past it a tenant may queue its share (engine/core/loop.py);
    one team's flood does not lock the others out."""
    from engine.core.batched import BatchedEngine
    from engine.protocol import EngineOverloadedError
    from tests.engine.conftest import manual_engine

    engine = manual_engine(tiny_llama, BatchedEngine, max_waiting=4)  # no thread: all stay queued

    def submit(rid: str, tenant: str) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=2)
        spec = GenerationRequest(rid, "tiny", (1, 2, 3), params, service=ServiceClass(tenant))
        engine.submit(spec, lambda output: None)

    for i in range(4):
        submit(f"a{i}", "A")
    with pytest.raises(EngineOverloadedError):
        submit("a4", "A")
    submit("b0", "B")  # B holds nothing: under its share of the queue (4 / 2)
    submit("b1", "B")
    with pytest.raises(EngineOverloadedError):
        submit("b2", "B")
    submit("c0", "C")  # a third team: its share is 4 / 3
    submit("c1", "C")
    with pytest.raises(EngineOverloadedError):
        submit("c2", "C")


def test_the_running_caches_bytes_are_counted_as_the_budget_counts_them():
    from engine.cache.budget import MemoryBudget

    memory = MemoryBudget(max_bytes=10**9, bytes_per_token=10, bytes_per_sequence=100)
    sched = Scheduler(max_num_seqs=4, max_num_batched_tokens=64, memory=memory)
    assert sched.kv_cache_bytes() == 0
    sched.add(request("a", "A", num_prompt=4))
    sched.add(request("b", "B", num_prompt=9))
    step(sched)
    assert sched.kv_cache_bytes() == memory.need([4, 9]) == 2 * (256 * 10 + 100)
