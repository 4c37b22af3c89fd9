"""A batch beside interactive traffic: what a batch costs the interactive streams' first tokens,
and how much of the capacity they leave free the batch puts to use.

    .venv/bin/python bench/batches.py [--lines 1000] [--seconds 20] [--no-write]

One self-contained run, as bench/api.py's (a throwaway ORCHARD_HOME and SQLite database, the
default model, SmolLM2-135M float32, with 64 rows: 64 lines at once with ORCHARD_BATCH_CONCURRENCY
unset), keys of an interactive team and a batch team, daphne with its batch runner on a free port.
ORCHARD_FLEX_YIELD_SHARE from the environment reaches daphne (the rows a batch keeps beside
the interactive streams; the header says which).

- Interactive: `--clients` (4) clients, each a closed loop of streamed chat completions of
  `--interactive-tokens` tokens (the official `openai` AsyncOpenAI, greedy, EOS ignored, a
  unique prompt each); time to first token is to the first chunk with content. The usage
  rows' `time_to_first_token_ms` (from the request's submission to the engine) tell the
  engine's wait from the web process's.
- A batch: `--lines` chat lines of `--batch-tokens` tokens (EOS ignored, unique prompts) uploaded
  with POST /v1/files and run with POST /v1/batches, polled (GET /v1/batches/{id}) until done.
  Its window is from `in_progress_at` to its last line's `finished_at` (the database's times,
  finer than the API's seconds); its tokens are its `usage.output_tokens`. Meanwhile the
  engine is sampled (GET /metrics): each team's rows running, preemptions; and the CPU.

Phases: A, the interactive clients alone for `--seconds`; B, a batch alone; M, another batch
(new prompts) with the interactive clients running from the moment it is in progress until its
last line ends; A again for `--seconds` (A's figures are both halves together, so a machine that
slows down during the run does not favour either side).

Targets (issue 31): M's interactive time to first token, p50 and p99, within 1.2x of A's; and
utilisation = batch tokens/s in M / free >= 0.8, where free, "the throughput the interactive
streams leave free", is C - I: C, the engine's capacity for batch work (B's tokens/s, a full
batch of rows), less I, the tokens/s the interactive streams generated in M's window. Not A's
interactive tokens/s: alone, the streams run 4-row steps far faster than beside 60 batch rows,
so subtracting that would understate what was free and flatter the batch.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402, F401  (OpenBLAS before anything imports mlx)

# isort: split
import argparse  # noqa: E402
import asyncio  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

from bench.api import MODEL, messages, setup_home, wait_for_quiet  # noqa: E402
from bench.results import load_average, run_header, write_results  # noqa: E402
from tests.fixtures.daphne import free_port, start_daphne, stop_daphne  # noqa: E402

TTFT_TARGET = 1.2
UTILISATION_TARGET = 0.8
POLL_S = 0.5
BATCH_TIMEOUT_S = 3600
WARM_LINES = 8
INTERACTIVE_TEAM = "bench"  # bench/api.py's setup_home: its keys' team
BATCH_TEAM = "batch"
METRICS_TOKEN = uuid.uuid4().hex  # daphne's ORCHARD_METRICS_TOKEN, for this run's scrapes


@dataclass
class Interactive:
    """What the interactive clients saw in one window."""

    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    seconds: float = 0.0
    opened_at: datetime.datetime | None = None
    engine_ttft: list[float] = field(default_factory=list)  # the usage rows' (engine_side)
    started: list[float] = field(default_factory=list)  # wall clock (time.time()) per ttft

    def add(self, other: Interactive) -> None:
        self.ttft += other.ttft
        self.started += other.started
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.engine_ttft += other.engine_ttft

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    def slowest(self) -> str:
        """The five slowest first tokens, each with when its request started (UTC), and the
        engine's five slowest: where to look in the server's log."""
        chats = sorted(zip(self.ttft, self.started, strict=True), reverse=True)[:5]
        utc = datetime.UTC
        return (
            "slowest TTFT "
            + ", ".join(
                f"{s:.3f} s @ {datetime.datetime.fromtimestamp(at, utc):%H:%M:%S.%f}"[:-3]
                for s, at in chats
            )
            + "; the engine's "
            + ", ".join(f"{s:.3f}" for s in sorted(self.engine_ttft, reverse=True)[:5])
        )


def p99(values: list[float]) -> float:
    if len(values) < 2:
        return max(values)
    return statistics.quantiles(values, n=100, method="inclusive")[98]


p50 = statistics.median


@dataclass
class BatchRun:
    """One batch, from its in_progress_at to its last line's end, and the engine sampled
    meanwhile (GET /metrics at each poll): each team's rows running, the batch's requests
    waiting in the engine's queue, the preemptions so far."""

    lines: int
    tokens: int
    seconds: float
    samples: list[tuple[float, ...]] = field(default_factory=list)

    def rows(self) -> str:
        batch, streams, waiting = (statistics.mean(s[i] for s in self.samples) for i in (0, 1, 2))
        return f"{batch:.1f} + {streams:.1f} | {waiting:.1f}"

    @property
    def preemptions(self) -> int:
        return int(self.samples[-1][3] - self.samples[0][3])

    @property
    def lines_per_s(self) -> float:
        return self.lines / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def openai_client(base_url: str, key: str, connections: int):
    import httpx
    import openai

    return openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key=key,
        max_retries=0,
        timeout=600,
        http_client=httpx.AsyncClient(
            limits=httpx.Limits(max_connections=connections), timeout=600
        ),
    )


async def stream_one(api, content: list[dict[str, str]], max_tokens: int) -> tuple[float, int]:
    """One streamed chat completion: (seconds to its first content, tokens generated)."""
    start = time.perf_counter()
    stream = await api.chat.completions.create(
        model=MODEL,
        messages=content,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    first, usage = None, None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
    assert first is not None and usage is not None, "a stream without content or usage"
    assert usage.completion_tokens == max_tokens, usage
    return first, usage.completion_tokens


async def interactive(api, args, until) -> Interactive:
    """`args.clients` closed-loop streams, each starting requests while `until()` is false;
    the window ends when the last request started has finished."""
    tag = uuid.uuid4().hex[:8]
    result = Interactive()

    async def client(c: int) -> None:
        index = 0
        while not until():
            started = time.time()
            ttft, tokens = await stream_one(
                api, messages(f"{tag}-{c}", index), args.interactive_tokens
            )
            result.ttft.append(ttft)
            result.started.append(started)
            result.tokens += tokens
            index += 1

    result.opened_at = datetime.datetime.now(datetime.UTC)
    start = time.perf_counter()
    await asyncio.gather(*(client(c) for c in range(args.clients)))
    result.seconds = time.perf_counter() - start
    return result


def engine_side(seen: Interactive) -> Interactive:
    """`seen` with its requests' times to first token from the engine's side: from the
    request's submission to the engine, past HTTP, authentication, limits, rendering and
    tokenizing (the usage rows', read once the window has ended)."""
    from inference.models import UsageRecord

    rows = UsageRecord.objects.filter(
        team__name=INTERACTIVE_TEAM,
        batch_id="",
        status=UsageRecord.Status.COMPLETED,
        started_at__gte=seen.opened_at,
        time_to_first_token_ms__isnull=False,
    )
    deadline = time.monotonic() + 10
    while rows.count() < len(seen.ttft) and time.monotonic() < deadline:
        time.sleep(0.1)  # the server finishes a row right after the stream's last chunk
    seen.engine_ttft = [ms / 1000 for ms in rows.values_list("time_to_first_token_ms", flat=True)]
    assert len(seen.engine_ttft) == len(seen.ttft), (len(seen.engine_ttft), len(seen.ttft))
    return seen


async def interactive_alone(base_url: str, key: str, args) -> Interactive:
    api = openai_client(base_url, key, args.clients)
    try:
        await stream_one(api, messages("warm", 0), 4)  # the server loads its model
        deadline = time.monotonic() + args.seconds
        return await interactive(api, args, lambda: time.monotonic() >= deadline)
    finally:
        await api.close()


def batch_input(tag: str, lines: int, max_tokens: int) -> bytes:
    rows = (
        {
            "custom_id": f"{tag}-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": messages(tag, i),
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            },
        }
        for i in range(lines)
    )
    return "\n".join(json.dumps(row) for row in rows).encode()


def engine_sample(text: str) -> tuple[float, float, float, float]:
    """From a scrape of /metrics: the batch team's rows running, the interactive team's, the
    batch team's requests waiting, and the engine's preemptions so far."""
    from prometheus_client.parser import text_string_to_metric_families

    seen = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            seen[(sample.name, sample.labels.get("team"))] = sample.value
    running, preempted = "orchard_team_running_sequences", "orchard_engine_preemptions_total"
    return (
        seen.get((running, BATCH_TEAM), 0.0),
        seen.get((running, INTERACTIVE_TEAM), 0.0),
        seen.get(("orchard_team_waiting_requests", BATCH_TEAM), 0.0),
        seen.get((preempted, None), 0.0),
    )


async def batch(
    base_url: str, keys: tuple[str, str], args, *, beside: bool, lines: int, max_tokens: int
) -> tuple[str, Interactive | None, list[tuple[float, ...]]]:
    """Run one batch to its end (with the interactive clients beside it while it is in
    progress, if `beside`); its id, what the clients saw, and the engine sampled while it
    was in progress."""
    import httpx

    interactive_key, batch_key = keys
    api = openai_client(base_url, batch_key, 4)
    scrape = httpx.AsyncClient(
        base_url=base_url, headers={"Authorization": f"Bearer {METRICS_TOKEN}"}
    )
    samples = []
    tag = uuid.uuid4().hex[:8]
    upload = await api.files.create(
        file=("bench.jsonl", batch_input(tag, lines, max_tokens)), purpose="batch"
    )
    created = await api.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    deadline = time.monotonic() + BATCH_TIMEOUT_S
    lines_done = asyncio.Event()  # every line has ended: the clients start no more requests
    clients = None
    try:
        while True:
            current = await api.batches.retrieve(created.id)
            counts = current.request_counts
            if counts.total > 0 and counts.completed + counts.failed == counts.total:
                lines_done.set()
            elif current.status == "in_progress":
                samples.append(engine_sample((await scrape.get("/metrics")).text))
            if beside and clients is None and current.status != "validating":
                stream_api = openai_client(base_url, interactive_key, args.clients)
                clients = asyncio.create_task(interactive(stream_api, args, lines_done.is_set))
            if current.status in ("completed", "failed", "expired", "cancelled"):
                break
            assert time.monotonic() < deadline, f"batch still {current.status} after an hour"
            await asyncio.sleep(POLL_S)
        seen = await clients if clients is not None else None
    finally:
        if clients is not None:
            await stream_api.close()
        await api.close()
        await scrape.aclose()
    assert current.status == "completed", current
    assert (counts.completed, counts.failed) == (lines, 0), counts
    assert current.usage.output_tokens == lines * max_tokens, current.usage
    return created.id, seen, samples


def batch_window(batch_id: str, samples: list[tuple[float, ...]]) -> BatchRun:
    """The batch's lines and tokens, and its seconds from in_progress_at to its last line."""
    from django.db.models import Max

    from inference.batch_models import Batch

    row = Batch.objects.annotate(last=Max("lines__finished_at")).get(pk=batch_id)
    return BatchRun(
        lines=row.num_completed,
        tokens=row.output_tokens,
        seconds=(row.last - row.in_progress_at).total_seconds(),
        samples=samples,
    )


def batch_key() -> str:
    """A key of a team of its own for the batches (the interactive streams use bench/api.py's
    unlimited key)."""
    from accounts.services import api_key_create, team_membership_ensure, user_get_or_create

    user = user_get_or_create(username="bench")
    team, _ = team_membership_ensure(user=user, team_name=BATCH_TEAM)
    return api_key_create(user=user, team=team, name="batch")[1]


def cpu_ticks(server_pid: int) -> tuple[int, int] | None:
    """CPU time so far (clock ticks): the machine's busy time and daphne's (all its threads);
    None without Linux's /proc. Where daphne had much less than the machine, work outside the
    run shared it."""
    try:
        with open("/proc/stat") as machine, open(f"/proc/{server_pid}/stat") as daphne:
            ticks = [int(v) for v in machine.readline().split()[1:9]]
            fields = daphne.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return sum(ticks) - ticks[3] - ticks[4], int(fields[11]) + int(fields[12])


def measure(base_url: str, keys: tuple[str, str], args, server_pid: int) -> dict:
    def say(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", flush=True)

    full = {"lines": args.lines, "max_tokens": args.batch_tokens}
    cpu = {}

    def batch_phase(name: str, beside: bool) -> tuple[BatchRun, Interactive | None]:
        before, start = cpu_ticks(server_pid), time.monotonic()
        batch_id, seen, samples = asyncio.run(batch(base_url, keys, args, beside=beside, **full))
        after, seconds = cpu_ticks(server_pid), time.monotonic() - start
        if before is not None and after is not None:
            tick = os.sysconf("SC_CLK_TCK") * seconds
            cpu[name] = tuple((b - a) / tick for a, b in zip(before, after, strict=True))
            say(f"{name}: cores busy, machine {cpu[name][0]:.2f}, daphne {cpu[name][1]:.2f}")
        return batch_window(batch_id, samples), seen

    # The first batch of a process is slower (its runner's first claim, the batch code paths
    # and tables' first use): a small one first, so that B measures the steady state.
    asyncio.run(batch(base_url, keys, args, beside=False, lines=WARM_LINES, max_tokens=4))
    alone = engine_side(asyncio.run(interactive_alone(base_url, keys[0], args)))
    say(f"A (first half): {len(alone.ttft)} requests, p50 {p50(alone.ttft):.3f} s")
    capacity, _ = batch_phase("B", beside=False)
    say(f"B: {capacity.lines} lines in {capacity.seconds:.1f} s, {capacity.tokens_per_s:.1f} tok/s")
    beside, mixed = batch_phase("M", beside=True)
    mixed = engine_side(mixed)
    say(
        f"M: batch {beside.tokens_per_s:.1f} tok/s in {beside.seconds:.1f} s; interactive "
        f"{len(mixed.ttft)} requests, p50 {p50(mixed.ttft):.3f} s, {mixed.tokens_per_s:.1f} tok/s"
    )
    say(f"M: {mixed.slowest()}")
    alone.add(engine_side(asyncio.run(interactive_alone(base_url, keys[0], args))))
    say(f"A (both halves): {len(alone.ttft)} requests, p50 {p50(alone.ttft):.3f} s")
    say(f"A: {alone.slowest()}")
    return {"alone": alone, "capacity": capacity, "mixed": mixed, "beside": beside, "cpu": cpu}


def verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def summary(results: dict) -> list[str]:
    """The table and the verdicts (see the module docstring for the definitions)."""
    alone: Interactive = results["alone"]
    mixed: Interactive = results["mixed"]
    capacity: BatchRun = results["capacity"]
    beside: BatchRun = results["beside"]
    free = capacity.tokens_per_s - mixed.tokens_per_s
    utilisation = beside.tokens_per_s / free
    p50_ratio, p99_ratio = p50(mixed.ttft) / p50(alone.ttft), p99(mixed.ttft) / p99(alone.ttft)

    def streams(seen: Interactive) -> str:
        return (
            f"{len(seen.ttft)} | {p50(seen.ttft):.3f} | {p99(seen.ttft):.3f} "
            f"| {p50(seen.engine_ttft):.3f} | {p99(seen.engine_ttft):.3f} "
            f"| {seen.tokens_per_s:.1f}"
        )

    def batch_cells(run: BatchRun) -> str:
        return f"{run.lines_per_s:.2f} | {run.tokens_per_s:.1f} | {run.rows()} | {run.preemptions}"

    none = " | ".join(["–"] * 6)
    return [
        "| phase | seconds | interactive requests | TTFT p50 (s) | TTFT p99 (s) "
        "| engine's TTFT p50 (s) | engine's TTFT p99 (s) | interactive tokens/s "
        "| batch lines/s | batch tokens/s | rows running, batch + interactive (mean) "
        "| batch lines waiting in the engine (mean) | preemptions |",
        "| --- " + "| ---: " * 12 + "|",
        f"| A: interactive alone | {alone.seconds:.1f} | {streams(alone)} | – | – | – | – | – |",
        f"| B: batch alone | {capacity.seconds:.1f} | {none} | {batch_cells(capacity)} |",
        f"| M: batch + interactive | {beside.seconds:.1f} | {streams(mixed)} "
        f"| {batch_cells(beside)} |",
        "",
        f"- Interactive time to first token beside the batch: p50 {p50_ratio:.2f}x, p99 "
        f"{p99_ratio:.2f}x of alone (target <= {TTFT_TARGET}x): p50 "
        f"{verdict(p50_ratio <= TTFT_TARGET)}, p99 {verdict(p99_ratio <= TTFT_TARGET)}.",
        f"- Free = C - I = {capacity.tokens_per_s:.1f} - {mixed.tokens_per_s:.1f} = {free:.1f} "
        f"tokens/s; the batch used {beside.tokens_per_s:.1f}: {utilisation:.1%} (target >= "
        f"{UTILISATION_TARGET:.0%}): {verdict(utilisation >= UTILISATION_TARGET)}.",
        f"- The engine's output in M (batch + interactive) against B's: "
        f"{(beside.tokens_per_s + mixed.tokens_per_s) / capacity.tokens_per_s:.1%}; the "
        f"interactive streams' tokens/s beside the batch against alone: "
        f"{mixed.tokens_per_s / alone.tokens_per_s:.1%}.",
        *(
            f"- CPU while {name} ran, in cores busy of {os.cpu_count()}: the machine "
            f"{machine:.2f}, daphne's process {daphne:.2f}."
            for name, (machine, daphne) in results.get("cpu", {}).items()
        ),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=1000, help="lines in each batch")
    parser.add_argument("--batch-tokens", type=int, default=32, help="max_tokens of a line")
    parser.add_argument("--clients", type=int, default=4, help="interactive streams")
    parser.add_argument("--interactive-tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20, help="each half of phase A")
    parser.add_argument("--max-load", type=float, default=1.0)
    parser.add_argument("--max-wait", type=float, default=600, help="seconds to wait for quiet")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()

    wait_for_quiet(args.max_load, args.max_wait)
    load_before = load_average()
    started = time.monotonic()
    home = Path(tempfile.mkdtemp(prefix="orchard-bench-batches-"))
    server = None
    try:
        interactive_key, _ = setup_home(home)
        keys = (interactive_key, batch_key())
        port = free_port()
        env = {**os.environ, "ORCHARD_METRICS_TOKEN": METRICS_TOKEN}
        server = start_daphne(port=port, env=env, log_path=home / "server.log")
        print(f"daphne pid {server.pid} on port {port}; load {load_before}", flush=True)
        results = measure(f"http://127.0.0.1:{port}", keys, args, server.pid)
    except BaseException:
        if (home / "server.log").exists():
            print((home / "server.log").read_text()[-4000:], file=sys.stderr)
        raise
    finally:
        if server is not None:
            stop_daphne(server)
        shutil.rmtree(home, ignore_errors=True)
    concurrency = os.environ.get("ORCHARD_BATCH_CONCURRENCY") or "0 (the model's 64 rows)"
    yield_share = os.environ.get("ORCHARD_FLEX_YIELD_SHARE") or "0.25 (the default)"
    block = "\n".join(
        [
            *run_header(
                "batches.py",
                f", shared by daphne (engine and batch runner inside) and the benchmark's own "
                f"clients. Load average (1, 5, 15 min) before: {load_before}; after: "
                f"{load_average()}; {time.monotonic() - started:.0f} s.",
                note=" (= `make bench-batches`)",
            ),
            "",
            f"SmolLM2-135M float32, greedy, EOS ignored, 64 rows, ORCHARD_BATCH_CONCURRENCY "
            f"{concurrency}, ORCHARD_FLEX_YIELD_SHARE {yield_share}. Interactive: "
            f"{args.clients} closed-loop streams of "
            f"{args.interactive_tokens} tokens (`openai`, stream=True, standard tier). Batch: "
            f"{args.lines} chat lines of {args.batch_tokens} tokens (flex tier). A: the streams "
            f"alone, {args.seconds:g} s before the batches and {args.seconds:g} s after. B: a "
            "batch alone (C = its tokens/s). M: another batch with the streams beside it (I = "
            "their tokens/s). Free = C - I; utilisation = M's batch tokens/s / free.",
            "",
            *summary(results),
        ]
    )
    print("\n" + block)
    if not args.no_write:
        write_results("batches.py", "Batches beside interactive traffic", block)


if __name__ == "__main__":
    main()
