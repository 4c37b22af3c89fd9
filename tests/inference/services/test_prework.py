"""The preparation gate (inference/services/prework.py) without a model: jobs of two teams on
few workers, each team capped and queued, the next free worker to the next team in turn, a
cancelled caller's job kept counted until its work has really ended."""

import asyncio
import threading

import pytest

from inference.services.prework import FairGate, QueueFull


class Jobs:
    """Jobs that run until the test lets each one end, recording the order they started in."""

    def __init__(self, gate: FairGate):
        self.gate = gate
        self.started: list[str] = []
        self.release: dict[str, asyncio.Event] = {}

    def submit(self, team: str, name: str) -> asyncio.Task:
        self.release[name] = asyncio.Event()

        async def work() -> str:
            self.started.append(name)
            await self.release[name].wait()
            return name

        return asyncio.ensure_future(self.gate.run(team, work))

    async def finish(self, name: str) -> None:
        self.release[name].set()
        await settle()


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_a_second_team_goes_before_the_first_teams_backlog():
    gate = FairGate(workers=1, per_team=1, queue_per_team=10)
    jobs = Jobs(gate)
    a = [jobs.submit("a", f"a{i}") for i in range(3)]
    await settle()
    b = jobs.submit("b", "b0")
    await settle()
    assert jobs.started == ["a0"]
    await jobs.finish("a0")
    assert jobs.started == ["a0", "b0"]  # b's one job before a's second
    await jobs.finish("b0")
    await jobs.finish("a1")
    await jobs.finish("a2")
    assert jobs.started == ["a0", "b0", "a1", "a2"]
    assert await asyncio.gather(*a, b) == ["a0", "a1", "a2", "b0"]
    assert gate.running() == 0


async def test_teams_alternate_while_both_are_backlogged():
    gate = FairGate(workers=1, per_team=1, queue_per_team=10)
    jobs = Jobs(gate)
    tasks = [jobs.submit("a", f"a{i}") for i in range(3)]
    await settle()
    tasks += [jobs.submit("b", f"b{i}") for i in range(3)]
    await settle()
    while len(jobs.started) < 6:
        await jobs.finish(jobs.started[-1])
    await jobs.finish(jobs.started[-1])
    assert jobs.started == ["a0", "b0", "a1", "b1", "a2", "b2"]
    await asyncio.gather(*tasks)


async def test_one_team_runs_at_most_its_share_and_the_rest_go_to_others():
    gate = FairGate(workers=3, per_team=2, queue_per_team=10)
    jobs = Jobs(gate)
    tasks = [jobs.submit("a", f"a{i}") for i in range(4)]
    await settle()
    assert jobs.started == ["a0", "a1"] and gate.running("a") == 2 and gate.waiting("a") == 2
    tasks.append(jobs.submit("b", "b0"))
    await settle()
    assert jobs.started == ["a0", "a1", "b0"]  # the third worker was free for team b
    for name in ["a0", "a1", "b0", "a2", "a3"]:
        await jobs.finish(name)
    await asyncio.gather(*tasks)
    assert gate.running() == 0


async def test_a_full_queue_refuses_that_team_only():
    gate = FairGate(workers=1, per_team=1, queue_per_team=1)
    jobs = Jobs(gate)
    tasks = [jobs.submit("a", "a0"), jobs.submit("a", "a1")]
    await settle()
    refused = jobs.submit("a", "a2")
    await settle()
    with pytest.raises(QueueFull, match="1 running, 1 waiting"):
        await refused
    tasks.append(jobs.submit("b", "b0"))  # another team still queues
    await settle()
    assert gate.waiting("b") == 1
    for name in ["a0", "b0", "a1"]:
        await jobs.finish(name)
    await asyncio.gather(*tasks)
    assert jobs.started == ["a0", "b0", "a1"]


async def test_a_caller_that_leaves_the_queue_frees_its_place():
    gate = FairGate(workers=1, per_team=1, queue_per_team=1)
    jobs = Jobs(gate)
    first = jobs.submit("a", "a0")
    waiting = jobs.submit("a", "a1")
    await settle()
    waiting.cancel()
    await settle()
    assert gate.waiting("a") == 0
    again = jobs.submit("a", "a2")  # the queue has room again
    await jobs.finish("a0")
    await jobs.finish("a2")
    assert await asyncio.gather(first, again) == ["a0", "a2"]
    assert "a1" not in jobs.started


async def test_a_cancelled_running_job_holds_its_place_until_its_work_ends():
    gate = FairGate(workers=1, per_team=1, queue_per_team=10)
    jobs = Jobs(gate)
    running = jobs.submit("a", "a0")
    await settle()
    running.cancel()
    await settle()
    assert running.cancelled()
    assert gate.running("a") == 1  # the work goes on, so it still counts
    other = jobs.submit("b", "b0")
    await settle()
    assert jobs.started == ["a0"]
    await jobs.finish("a0")
    assert jobs.started == ["a0", "b0"]
    await jobs.finish("b0")
    assert await other == "b0"
    assert gate.running() == 0


async def test_threads_of_the_gate_run_blocking_work_off_the_event_loop():
    gate = FairGate(workers=2, per_team=2, queue_per_team=10)
    loop_thread = threading.get_ident()
    threads = await asyncio.gather(*(gate.in_thread("a", threading.get_ident) for _ in range(4)))
    assert loop_thread not in threads
    assert gate.running() == 0


def test_callers_on_two_event_loops_share_one_gate():
    """Web requests of one process run on several event loops (one per thread): a worker
    freed on one loop wakes a waiter on another."""
    gate = FairGate(workers=1, per_team=1, queue_per_team=10)
    holding = threading.Event()
    let_go = threading.Event()
    result: list[str] = []

    def hold() -> str:
        holding.set()
        let_go.wait(10)
        return "a"

    def team_a() -> None:
        result.append(asyncio.run(gate.in_thread("a", hold)))

    first = threading.Thread(target=team_a)
    first.start()
    assert holding.wait(10)

    async def team_b() -> str:
        waiting = asyncio.ensure_future(gate.in_thread("b", lambda: "b"))
        await settle()
        assert gate.waiting("b") == 1
        let_go.set()
        return await asyncio.wait_for(waiting, 10)

    result.append(asyncio.run(team_b()))
    first.join(10)
    assert sorted(result) == ["a", "b"]
