"""Fair share between teams, service tiers and preemption in the engine (engine/core/fairness.py).

    .venv/bin/python bench/fairness.py [--seconds 30] [--rounds 6] [--no-write]

The default model (SmolLM2-135M, float32) in Orchard's batched engine on its own thread, 64
rows, fed GenerationRequests with their ServiceClass as the web side sends them (what the
scheduler decides does not depend on HTTP; bench/api.py measures that layer). A "stream" is a
closed loop: a request of 32 prompt tokens, and when it finishes, the next. Greedy, EOS ignored.

1. Team B's time to first token (4 requests of 16 tokens at once, `--rounds` times) alone,
   beside 32 of team A's streams (128 tokens each: free rows), beside 96 (more than the rows),
   and beside 96 in arrival order (the policy off: ORCHARD_FAIR_SHARE=0). Target: beside 96
   within 2x of beside 32.
2. Both teams backlogged (64 streams each, more than the rows together), weights 1:1 and 3:1:
   each team's generated tokens/s over `--seconds`. Target: within 10% of its weighted share.
3. A `priority` request's time to first token (one at a time, `--rounds` times) while 96
   `flex` streams fill the batch, against the idle engine's. Target: within 1.5x.
4. Total throughput of 96 streams of two teams with the policy against arrival order (three runs
   of each, alternated). Target: at least 95%.

Results go in bench/RESULTS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402, F401  (OpenBLAS before anything imports mlx)

# isort: split
import argparse  # noqa: E402
import itertools  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections import Counter  # noqa: E402

from bench.results import load_average, run_header, write_results  # noqa: E402
from engine.core.batched import BatchedEngine  # noqa: E402
from engine.models.loader import LoadedModel, load_model  # noqa: E402
from engine.protocol import (  # noqa: E402
    GenerationOutput,
    GenerationRequest,
    ModelSpec,
    SamplingParams,
    ServiceClass,
)

MODEL_DIR = ROOT / "var" / "cache" / "test-models" / "smollm2-135m-f32"
PROMPT_TOKENS = 32
ROWS = 64
_ids = itertools.count()


def model() -> LoadedModel:
    if not (MODEL_DIR / "config.json").exists():
        from engine.models.gguf import convert_gguf, default_gguf_path

        convert_gguf(default_gguf_path(), MODEL_DIR, dtype="float32")
    return load_model(MODEL_DIR, name="bench")


class Bench:
    """One engine and the streams and probes sent to it; every callback runs on the engine
    thread and only records."""

    def __init__(self, loaded: LoadedModel, *, fair_share: bool = True):
        spec = ModelSpec(
            name="bench", path=str(MODEL_DIR), max_num_seqs=ROWS, fair_share=fair_share
        )
        self.engine = BatchedEngine(spec, lambda: loaded)
        self.engine.start().result()
        self.vocab = loaded.info.vocab_size
        self.rng = random.Random(0)
        self.lock = threading.Lock()
        self.tokens: Counter[str] = Counter()  # generated tokens per tenant
        self.streaming = False
        self.open: set[str] = set()

    def prompt(self) -> tuple[int, ...]:
        return tuple(self.rng.randrange(100, self.vocab - 100) for _ in range(PROMPT_TOKENS))

    def send(self, service: ServiceClass, max_tokens: int, on_first=None, on_end=None) -> str:
        rid = f"r{next(_ids)}"
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        request = GenerationRequest(rid, "bench", self.prompt(), params, service=service)
        sent = time.perf_counter()
        first = []

        def emit(output: GenerationOutput) -> None:
            with self.lock:
                self.tokens[service.tenant] += len(output.token_ids)
            if output.token_ids and not first:
                first.append(True)
                if on_first is not None:
                    on_first(time.perf_counter() - sent)
            if output.finish_reason is not None:
                with self.lock:
                    self.open.discard(rid)
                if on_end is not None:
                    on_end()

        with self.lock:
            self.open.add(rid)
        self.engine.submit(request, emit)
        return rid

    def streams(self, count: int, service: ServiceClass, max_tokens: int) -> None:
        """`count` closed-loop streams until `stop_streams`."""
        self.streaming = True

        def again() -> None:
            if self.streaming:
                self.send(service, max_tokens, on_end=again)

        for _ in range(count):
            self.send(service, max_tokens, on_end=again)

    def stop_streams(self) -> None:
        self.streaming = False
        with self.lock:
            open_ids = list(self.open)
        for rid in open_ids:
            self.engine.abort(rid)
        deadline = time.monotonic() + 60
        while self.engine.has_requests() and time.monotonic() < deadline:
            time.sleep(0.05)

    def wait_running(self, rows: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            stats = self.engine.stats()
            if stats.num_running >= rows:
                return
            time.sleep(0.05)

    def first_tokens(self, service: ServiceClass, count: int, max_tokens: int) -> list[float]:
        """Send `count` requests at once; their times to first token (s)."""
        done = threading.Event()
        times: list[float] = []
        ended = []

        def on_first(seconds: float) -> None:
            times.append(seconds)

        def on_end() -> None:
            ended.append(True)
            if len(ended) == count:
                done.set()

        for _ in range(count):
            self.send(service, max_tokens, on_first=on_first, on_end=on_end)
        done.wait(600)
        return times

    def close(self) -> None:
        self.stop_streams()
        self.engine.stop()


A = ServiceClass(tenant="team:A", principal="key:a")
B = ServiceClass(tenant="team:B", principal="key:b")


def ttft_beside(loaded, streams: int, rounds: int, *, fair_share: bool = True) -> list[float]:
    bench = Bench(loaded, fair_share=fair_share)
    try:
        if streams:
            bench.streams(streams, A, 128)
            bench.wait_running(min(streams, ROWS))
            time.sleep(1.0)
        times = []
        for _ in range(rounds):
            times += bench.first_tokens(B, 4, 16)
        return times
    finally:
        bench.close()


def shares(loaded, weights: tuple[float, float], seconds: float) -> dict[str, float]:
    bench = Bench(loaded)
    a = ServiceClass(tenant="team:A", weight=weights[0])
    b = ServiceClass(tenant="team:B", weight=weights[1])
    try:
        bench.streams(64, a, 64)
        bench.streams(64, b, 64)
        bench.wait_running(ROWS)
        time.sleep(seconds / 3)  # settle: the first admissions went in arrival order
        with bench.lock:
            before = Counter(bench.tokens)
        time.sleep(seconds)
        with bench.lock:
            after = Counter(bench.tokens)
        served = after - before
        total = served["team:A"] + served["team:B"]
        return {
            "A_tps": served["team:A"] / seconds,
            "B_tps": served["team:B"] / seconds,
            "A_share": served["team:A"] / total if total else 0.0,
        }
    finally:
        bench.close()


def priority_ttft(loaded, rounds: int, *, busy: bool) -> list[float]:
    bench = Bench(loaded)
    try:
        if busy:
            bench.streams(96, ServiceClass(tenant="team:A", tier="flex"), 128)
            bench.wait_running(ROWS)
            time.sleep(1.0)
        times = []
        for _ in range(rounds):
            times += bench.first_tokens(ServiceClass(tenant="team:B", tier="priority"), 1, 8)
            time.sleep(0.3)
        return times
    finally:
        bench.close()


def throughput(loaded, seconds: float, *, fair_share: bool) -> float:
    bench = Bench(loaded, fair_share=fair_share)
    try:
        bench.streams(48, A, 64)
        bench.streams(48, B, 64)
        bench.wait_running(ROWS)
        time.sleep(seconds / 3)
        with bench.lock:
            before = sum(bench.tokens.values())
        time.sleep(seconds)
        with bench.lock:
            after = sum(bench.tokens.values())
        return (after - before) / seconds
    finally:
        bench.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    loaded = model()
    started = time.monotonic()
    load_before = load_average()
    p50 = statistics.median

    ttft = {
        "alone": ttft_beside(loaded, 0, args.rounds),
        "beside 32": ttft_beside(loaded, 32, args.rounds),
        "beside 96": ttft_beside(loaded, 96, args.rounds),
        "beside 96, arrival order": ttft_beside(loaded, 96, 1, fair_share=False),
    }
    for name, times in ttft.items():
        print(f"B's first token {name}: p50 {p50(times):.3f} s  max {max(times):.3f} s", flush=True)
    split = {w: shares(loaded, w, args.seconds) for w in ((1, 1), (3, 1))}
    for w, row in split.items():
        print(f"weights {w}: {row}", flush=True)
    idle = priority_ttft(loaded, args.rounds, busy=False)
    busy = priority_ttft(loaded, args.rounds, busy=True)
    print(f"priority first token idle {p50(idle):.3f} s, beside flex {p50(busy):.3f} s", flush=True)
    # Alternated, three times each: runs of the same configuration here differ by up to 20%.
    fair_runs, fifo_runs = [], []
    for _ in range(3):
        fair_runs.append(throughput(loaded, args.seconds, fair_share=True))
        fifo_runs.append(throughput(loaded, args.seconds, fair_share=False))
    fair_tps, fifo_tps = statistics.mean(fair_runs), statistics.mean(fifo_runs)
    print(f"throughput fair {fair_tps:.1f} tok/s, arrival order {fifo_tps:.1f}", flush=True)

    ratio_96 = p50(ttft["beside 96"]) / p50(ttft["beside 32"])
    lines = [
        *run_header(
            "fairness.py",
            f"; load average {load_before} before the run, {load_average()} after; "
            f"{time.monotonic() - started:.0f} s.",
        ),
        "",
        "| team B's 4 requests (time to first token) | p50 (s) | max (s) |",
        "| --- | --- | --- |",
        *(f"| {name} | {p50(t):.3f} | {max(t):.3f} |" for name, t in ttft.items()),
        "",
        f"Beside 96 / beside 32 (p50): {ratio_96:.2f}x (target <= 2x): "
        f"{'pass' if ratio_96 <= 2 else 'FAIL'}.",
        "",
        "| weights A:B | A tokens/s | B tokens/s | A's share | A's weighted share | within 10% |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for (wa, wb), row in split.items():
        want = wa / (wa + wb)
        ok = abs(row["A_share"] - want) <= 0.1 * want
        lines.append(
            f"| {wa}:{wb} | {row['A_tps']:.1f} | {row['B_tps']:.1f} | {row['A_share']:.3f} "
            f"| {want:.3f} | {'pass' if ok else 'FAIL'} |"
        )
    ratio_tier = p50(busy) / p50(idle)
    ratio_tps = fair_tps / fifo_tps
    lines += [
        "",
        f"A `priority` request's first token: idle engine p50 {p50(idle):.3f} s, beside 96 "
        f"`flex` streams p50 {p50(busy):.3f} s (max {max(busy):.3f} s): {ratio_tier:.2f}x "
        f"(target <= 1.5x): {'pass' if ratio_tier <= 1.5 else 'FAIL'}.",
        "",
        f"Throughput of 96 streams (48 per team), three runs each, alternated: fair share "
        f"{' / '.join(f'{t:.1f}' for t in fair_runs)} tokens/s, arrival order "
        f"{' / '.join(f'{t:.1f}' for t in fifo_runs)}; means {ratio_tps:.1%} (target >= 95%): "
        f"{'pass' if ratio_tps >= 0.95 else 'FAIL'}.",
    ]
    block = "\n".join(lines)
    print(block)
    if not args.no_write:
        write_results("fairness.py", "Fair share, tiers and preemption", block)


if __name__ == "__main__":
    main()
