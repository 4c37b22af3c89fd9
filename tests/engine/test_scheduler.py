"""Scheduling policy without a model: budgets, slots, chunked prefill, FIFO, removal."""

import pytest

from engine.core.batched import PrefillPacer
from engine.core.request import Request, Sequence
from engine.core.scheduler import PrefillChunk, Scheduler, SchedulerOutput
from engine.protocol import GenerationRequest, RequestStatus, SamplingParams


class _State:
    def __init__(self, params):
        self.params = params


def request(rid: str, num_prompt: int, *, n: int = 1, max_tokens: int = 4) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, n=n)
    spec = GenerationRequest(rid, "m", tuple(range(1, num_prompt + 1)), params)
    req = Request(spec, emit=lambda output: None, max_tokens=max_tokens)
    req.sequences = [Sequence(req, i, _State(params), detokenizer=None) for i in range(n)]
    return req


def simulate_step(scheduler: Scheduler, chunks: list | None = None) -> dict[str, int]:
    """What the engine does after the runner: advance accounting, sample where caught up."""
    plan = scheduler.schedule()
    if chunks is not None:
        chunks += [(c.start, c.num_tokens, c.completes_prompt) for c in plan.prefill]
    return simulate_plan(scheduler, plan)


def simulate_plan(scheduler: Scheduler, plan) -> dict[str, int]:
    for seq in plan.decode:
        seq.num_computed_tokens += 1
    for chunk in plan.prefill:
        for seq in chunk.request.live_sequences():
            seq.num_computed_tokens += chunk.num_tokens
    sampled = {}
    for req in scheduler.running:
        for seq in req.live_sequences():
            if seq.num_computed_tokens == seq.num_tokens:
                seq.output_token_ids.append(7)
                sampled[req.request_id] = sampled.get(req.request_id, 0) + 1
                if len(seq.output_token_ids) >= req.max_tokens:
                    seq.status = RequestStatus.FINISHED_LENGTH
    scheduler.remove_finished()
    return sampled


def test_decode_first_then_prefill_chunks_within_budget():
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=10)
    scheduler.add(request("a", 3))
    simulate_step(scheduler)  # a prefilled and sampled its first token
    scheduler.add(request("b", 25))
    plan = scheduler.schedule()
    assert [s.request.request_id for s in plan.decode] == ["a"]
    assert [(c.request.request_id, c.start, c.num_tokens) for c in plan.prefill] == [("b", 0, 9)]
    assert plan.num_scheduled_tokens == 10


def test_long_prompt_is_prefilled_in_chunks_across_steps():
    scheduler = Scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    scheduler.add(request("a", 20, max_tokens=2))
    chunks, sampled = [], []
    while scheduler.has_work():
        sampled.append(simulate_step(scheduler, chunks))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert sampled == [{}, {}, {"a": 1}, {"a": 1}]


def test_max_num_seqs_caps_admission_and_finished_requests_free_their_slots():
    scheduler = Scheduler(max_num_seqs=2, max_num_batched_tokens=64)
    for rid in "abc":
        scheduler.add(request(rid, 2, max_tokens=2))
    simulate_step(scheduler)
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    assert [r.request_id for r in scheduler.waiting] == ["c"]
    simulate_step(scheduler)  # a and b reach max_tokens
    assert scheduler.running == [] and scheduler.num_waiting == 1
    assert simulate_step(scheduler) == {"c": 1}


def test_head_of_queue_is_not_overtaken_and_n_counts_sequences():
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    scheduler.add(request("a", 2, n=2, max_tokens=3))
    scheduler.add(request("b", 2, n=3))
    scheduler.add(request("c", 2, n=1))
    assert simulate_step(scheduler) == {"a": 2}
    assert scheduler.num_running_seqs == 2
    assert [r.request_id for r in scheduler.waiting] == ["b", "c"]  # c fits but must not pass b


def test_all_sequences_of_a_request_share_its_prefill():
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=64)
    req = request("a", 5, n=3)
    scheduler.add(req)
    plan = scheduler.schedule()
    assert len(plan.prefill) == 1 and plan.prefill[0].num_tokens == 5
    assert all(seq.status == RequestStatus.RUNNING for seq in req.sequences)


def test_remove_takes_waiting_or_running_requests():
    scheduler = Scheduler(max_num_seqs=1, max_num_batched_tokens=8)
    scheduler.add(request("a", 2))
    scheduler.add(request("b", 2))
    simulate_step(scheduler)
    assert scheduler.remove("b").request_id == "b"
    assert scheduler.remove("a").request_id == "a"
    assert scheduler.remove("a") is None
    assert not scheduler.has_work()


def test_rejects_budgets_that_cannot_decode_every_sequence():
    with pytest.raises(ValueError):
        Scheduler(max_num_seqs=8, max_num_batched_tokens=4)
    scheduler = Scheduler(max_num_seqs=2, max_num_batched_tokens=8)
    with pytest.raises(ValueError):
        scheduler.add(request("a", 2, n=3))


def test_decodes_only_after_a_plan_when_nothing_waits_prefills_or_ends():
    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=8)
    first = request("a", 6, max_tokens=3)
    scheduler.add(first)
    plan = scheduler.schedule()
    assert scheduler.decodes_only_after(plan), "its prompt completes in this step"
    seq = first.sequences[0]
    seq.num_computed_tokens, seq.output_token_ids = 6, [7]
    scheduler.add(request("b", 12))
    assert not scheduler.decodes_only_after(scheduler.schedule()), "b still prefills"

    scheduler = Scheduler(max_num_seqs=4, max_num_batched_tokens=8)
    scheduler.running.append(first)
    seq.output_token_ids = [7, 7]
    seq.num_computed_tokens = 7
    assert not scheduler.decodes_only_after(scheduler.schedule()), "a samples its last token"


def test_admission_waits_while_the_batch_would_not_fit_in_memory():
    from engine.cache.budget import CACHE_STEP_TOKENS, MemoryBudget

    # Rows are as long as the longest one: two rows of 300 tokens (rounded up to two cache
    # steps) fit in 4 steps' worth; a third does not.
    step = CACHE_STEP_TOKENS
    budget = MemoryBudget(max_bytes=4 * step * 10, bytes_per_token=10)
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=2048, memory=budget)
    for rid in "abc":
        scheduler.add(request(rid, 200, max_tokens=100))
    scheduler.schedule()
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    scheduler.schedule()
    assert [r.request_id for r in scheduler.running] == ["a", "b"]  # c waits, nothing fails
    scheduler.remove("a")
    scheduler.schedule()
    assert [r.request_id for r in scheduler.running] == ["b", "c"]


def test_the_prefix_cache_makes_room_before_anyone_waits():
    import mlx.core as mx

    from engine.cache.budget import CACHE_STEP_TOKENS, MemoryBudget
    from engine.cache.prefix import PrefixCache

    cache = PrefixCache(max_bytes=10**9)
    for start in (5000, 6000):
        tokens = list(range(start, start + 100))
        cache.insert(
            tokens, lambda s, e: [(mx.zeros((1, 1, e - s, 25)), mx.zeros((1, 1, e - s, 25)))]
        )
    cached = cache.nbytes  # 2 × 100 tokens × 200 bytes
    budget = MemoryBudget(max_bytes=2 * CACHE_STEP_TOKENS * 200 + cached // 2, bytes_per_token=200)
    scheduler = Scheduler(
        max_num_seqs=8, max_num_batched_tokens=2048, memory=budget, prefix_cache=cache
    )
    scheduler.add(request("a", 100, max_tokens=50))
    scheduler.add(request("b", 100, max_tokens=50))
    scheduler.schedule()
    scheduler.schedule()
    assert [r.request_id for r in scheduler.running] == ["a", "b"]
    assert 0 < cache.nbytes <= cached // 2  # half the cache went, not the waiting request


def test_a_burst_is_admitted_in_arrival_order_and_streams_while_the_rest_prefill():
    """Sixteen 96-token prompts arriving together: with fair admission the first ones get
    their first token after a quarter of the burst is prefilled and decode while the rest
    prefill; the median first token comes after about half the prompts, not all of them."""

    def first_token_steps(scheduler):
        for i in range(16):
            scheduler.add(request(f"r{i}", 96, max_tokens=64))
        first, step = {}, 0
        while scheduler.has_work():
            step += 1
            for rid in simulate_step(scheduler):
                first.setdefault(rid, step)
        return [first[f"r{i}"] for i in range(16)]

    burst = first_token_steps(Scheduler(max_num_seqs=16, max_num_batched_tokens=2048))
    assert burst == [1] * 16  # one 1536-token step: everyone waits for all of it
    fair = first_token_steps(
        Scheduler(
            max_num_seqs=16,
            max_num_batched_tokens=2048,
            prefill_chunk_tokens=96,
            admission_chunk_tokens=384,
        )
    )
    assert fair == sorted(fair), "arrival order"
    # Four prompts a step (384 tokens), the first ones decoding beside the next chunks.
    assert fair == [1] * 4 + [2] * 4 + [3] * 4 + [4] * 4
    # A lone prompt beside running streams gets the smaller chunk.
    scheduler = Scheduler(
        max_num_seqs=16,
        max_num_batched_tokens=2048,
        prefill_chunk_tokens=96,
        admission_chunk_tokens=384,
    )
    scheduler.add(request("a", 3, max_tokens=64))
    simulate_step(scheduler)
    scheduler.add(request("b", 1000))
    assert [c.num_tokens for c in scheduler.schedule().prefill] == [96]


def test_a_burst_step_starts_only_prompts_that_fit_whole():
    """Prompts that complete in one step are prefilled as one batch; one split across steps
    costs a forward of its own in each, so a burst step leaves the rest of its budget."""
    scheduler = Scheduler(
        max_num_seqs=16,
        max_num_batched_tokens=2048,
        prefill_chunk_tokens=64,
        admission_chunk_tokens=220,
    )
    for i in range(8):
        scheduler.add(request(f"r{i}", 71, max_tokens=64))
    plans = []
    while scheduler.waiting or any(r.sequences[0].is_prefilling for r in scheduler.running):
        plan = scheduler.schedule()
        plans.append([(c.request.request_id, c.start, c.num_tokens) for c in plan.prefill])
        simulate_plan(scheduler, plan)
    assert plans == [
        [("r0", 0, 71), ("r1", 0, 71), ("r2", 0, 71)],
        [("r3", 0, 71), ("r4", 0, 71), ("r5", 0, 71)],
        [("r6", 0, 71), ("r7", 0, 71)],
    ]
    # A prompt longer than the budget still starts, alone, when the step holds no other.
    scheduler = Scheduler(
        max_num_seqs=16,
        max_num_batched_tokens=2048,
        prefill_chunk_tokens=64,
        admission_chunk_tokens=220,
    )
    scheduler.add(request("short", 3, max_tokens=64))
    simulate_step(scheduler)
    scheduler.add(request("long", 500))
    scheduler.add(request("next", 71))
    assert [(c.request.request_id, c.num_tokens) for c in scheduler.schedule().prefill] == [
        ("long", 220)
    ]


def test_a_lone_prompt_gets_the_whole_budget():
    scheduler = Scheduler(
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        prefill_chunk_tokens=64,
        admission_chunk_tokens=256,
    )
    scheduler.add(request("a", 1500))
    plan = scheduler.schedule()
    assert [(c.start, c.num_tokens) for c in plan.prefill] == [(0, 1500)]
    # Two waiting: the head prompt is still prefilled whole when longer than the chunk.
    scheduler = Scheduler(
        max_num_seqs=4,
        max_num_batched_tokens=2048,
        prefill_chunk_tokens=64,
        admission_chunk_tokens=256,
    )
    scheduler.add(request("a", 700))
    scheduler.add(request("b", 700))
    plan = scheduler.schedule()
    assert [(c.request.request_id, c.num_tokens) for c in plan.prefill] == [("a", 700)]


def test_the_pacer_sizes_chunks_from_the_prefills_own_time_whatever_decodes_beside_it():
    """The runner times each step's prefill alone: a burst admitted beside a growing batch
    (every step mixed, at batch sizes no decode-only step measured) keeps its chunk sizes."""
    pacer = PrefillPacer(fixed=None, limit=4096)
    prompt = request("p", 2000)
    for size in (0, 4, 10, 22, 40, 60):
        rows = [request(f"d{i}", 3).sequences[0] for i in range(size)]
        for _ in range(3):  # 1 ms a prompt token, however long the steps' decode takes
            pacer.record(SchedulerOutput(decode=rows, prefill=[PrefillChunk(prompt, 0, 200)]), 0.2)
        assert 230 <= pacer.chunk_tokens <= 260
        assert 950 <= pacer.admission_tokens <= 1010
    # A step without prefill, or with a few tokens only, says nothing about its speed.
    pacer.record(SchedulerOutput(decode=rows), None)
    pacer.record(SchedulerOutput(prefill=[PrefillChunk(prompt, 0, 3)]), 5.0)
    assert 230 <= pacer.chunk_tokens <= 260


def test_one_slow_step_is_forgotten_within_a_few():
    """A prefill slowed by something else (a burst of requests arriving keeps the web side of
    the process busy) must not leave the chunks small for the rest of the burst."""
    pacer = PrefillPacer(fixed=None, limit=4096)
    prompt = request("p", 2000)
    pacer.record(SchedulerOutput(prefill=[PrefillChunk(prompt, 0, 70)]), 1.3)  # 18 ms a token
    assert pacer.admission_tokens < 60
    for _ in range(2):
        pacer.record(SchedulerOutput(prefill=[PrefillChunk(prompt, 0, 140)]), 0.42)  # 3 ms
    assert 320 <= pacer.admission_tokens <= 340


def test_a_prompts_prefill_memory_counts_while_it_prefills():
    """An image request's vision tower forward (Request.prefill_bytes) counts toward the
    memory budget while its prompt prefills, and no longer once it decodes."""
    from engine.cache.budget import CACHE_STEP_TOKENS, MemoryBudget

    step = CACHE_STEP_TOKENS
    budget = MemoryBudget(max_bytes=3 * step * 10, bytes_per_token=10)
    scheduler = Scheduler(max_num_seqs=8, max_num_batched_tokens=64, memory=budget)
    image = request("image", 100, max_tokens=8)
    image.prefill_bytes = 2 * step * 10
    scheduler.add(image)
    scheduler.schedule()  # admitted, its prompt prefills 64 tokens a step
    assert image.sequences[0].is_prefilling
    text = request("text", 100, max_tokens=8)
    assert not scheduler._fits(text, scheduler.num_running_seqs)  # 1 + 2 + 1 steps > 3
    image.sequences[0].num_computed_tokens = 100  # its prompt is in: the forward is over
    assert scheduler._fits(text, scheduler.num_running_seqs)
    image.sequences[0].num_computed_tokens = 0
    image.prefill_bytes = 0  # a text prompt as long holds only its cache
    assert scheduler._fits(text, scheduler.num_running_seqs)
