"""Streaming through a remote engine worker against the engine inside the web process.

    .venv/bin/python bench/workers.py [--max-tokens 64] [--streams 16] [--ttft-requests 20]

One self-contained run: a throwaway ORCHARD_HOME with a migrated SQLite database (shared by the
processes of the remote layout), the default model (SmolLM2-135M float32, as bench/api.py uses),
and two layouts on this machine, measured one after the other and alternated `--repeat` times:

- in-process: daphne with ORCHARD_ENGINE=local (what `make serve` runs);
- remote: daphne with ORCHARD_ENGINE=remote and one `manage.py runengine` worker, meeting on the
  Redis at 127.0.0.1:6379 (database 11, a namespace of its own).

For each: tokens/s with `--streams` concurrent streams (official `openai` client, stream=True,
tokens from `usage`), and time to first token of one stream at a time (`--ttft-requests`
sequential requests, median and p90: the added latency of the hop, without queueing). Targets:
remote tokens/s >= 90% of in-process, median TTFT less than 5 ms above it. bench/RESULTS.md.
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
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

sys.path.append(str(ROOT / "bench"))  # after `engine`: bench/engine.py would shadow it

from api import MODEL, Run, http_run, load_average, messages, setup_home, wait_for_quiet  # noqa: E402

from bench.results import run_header, write_results  # noqa: E402
from tests.fixtures.daphne import free_port, start_daphne, stop_daphne  # noqa: E402

REDIS_URL = "redis://127.0.0.1:6379/11"
THROUGHPUT_TARGET = 0.9
TTFT_TARGET_MS = 5.0


class Layout:
    def __init__(self, name: str, home: Path, env: dict[str, str], remote: bool):
        self.name, self.home, self.remote = name, home, remote
        self.env = {**env, "PYTHONUNBUFFERED": "1"}
        if remote:
            self.env.update(
                {
                    "ORCHARD_ENGINE": "remote",
                    "REDIS_URL": REDIS_URL,
                    "ORCHARD_WORKER_NAMESPACE": f"bench{uuid.uuid4().hex[:8]}",
                }
            )
        self.processes: list[subprocess.Popen] = []
        self.url = ""

    def start(self) -> None:
        if self.remote:
            log = open(self.home / f"{self.name}-worker.log", "wb")
            self.processes.append(
                subprocess.Popen(
                    [sys.executable, "manage.py", "runengine", "--worker-id", "bench"],
                    cwd=ROOT,
                    env=self.env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
            log.close()
        port = free_port()
        log_path = self.home / f"{self.name}-web.log"
        self.processes.append(start_daphne(port=port, env=self.env, log_path=log_path))
        self.url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.args[-1] == "config.asgi:application":
                stop_daphne(process)
            elif process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()


async def first_tokens(client, count: int) -> list[float]:
    """Milliseconds to the first chunk with a choice (the first token), one request at a time."""
    tag = uuid.uuid4().hex[:8]
    times = []
    for i in range(count):
        start = time.perf_counter()
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages(tag, i),
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        first = None
        async for chunk in stream:
            if first is None and chunk.choices:
                first = (time.perf_counter() - start) * 1000
        times.append(first)
    return times


async def measure_layout(layout: Layout, key: str, args) -> tuple[Run, list[float]]:
    import httpx
    import openai

    client = openai.AsyncOpenAI(
        base_url=f"{layout.url}/v1",
        api_key=key,
        max_retries=0,
        timeout=600,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=600),
    )
    try:
        await http_run(client, 2, 1, 8)  # warm: the model loads on the first request
        run = await http_run(client, args.streams, 1, args.max_tokens)
        ttft = await first_tokens(client, args.ttft_requests)
    finally:
        await client.close()
    return run, ttft


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--ttft-requests", type=int, default=20)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--max-load", type=float, default=1.0)
    parser.add_argument("--max-wait", type=float, default=600, help="seconds to wait for quiet")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()

    wait_for_quiet(args.max_load, args.max_wait)
    load_before = load_average()
    home = Path(tempfile.mkdtemp(prefix="orchard-bench-workers-"))
    best: dict[str, Run] = {}
    ttfts: dict[str, list[float]] = {"in-process": [], "remote": []}
    try:
        _, key = setup_home(home)
        env = {**os.environ, "DATABASE_URL": f"sqlite:///{home / 'db.sqlite3'}"}
        for round_ in range(args.repeat):
            for name in ("in-process", "remote"):
                layout = Layout(name, home, env, remote=name == "remote")
                layout.start()
                try:
                    run, ttft = asyncio.run(measure_layout(layout, key, args))
                finally:
                    layout.stop()
                print(
                    f"round {round_ + 1} {name:>10}: {run.tokens_per_s:.1f} tokens/s "
                    f"({args.streams} streams); first token median "
                    f"{statistics.median(ttft):.1f} ms",
                    flush=True,
                )
                if name not in best or run.tokens_per_s > best[name].tokens_per_s:
                    best[name] = run
                ttfts[name] += ttft
    finally:
        shutil.rmtree(home, ignore_errors=True)
    load_after = load_average()
    local, remote = best["in-process"], best["remote"]
    ratio = remote.tokens_per_s / local.tokens_per_s
    medians = {name: statistics.median(values) for name, values in ttfts.items()}
    added = medians["remote"] - medians["in-process"]
    rows = [
        "| layout | tokens/s, "
        f"{args.streams} streams | first token, median (ms) | first token, p90 (ms) |",
        "|---|---:|---:|---:|",
    ]
    for name, run in (("in-process", local), ("remote", remote)):
        rows.append(
            f"| {name} | {run.tokens_per_s:.1f} | {medians[name]:.1f} | "
            f"{percentile(ttfts[name], 0.9):.1f} |"
        )
    verdict = (
        f"Remote / in-process tokens/s: {ratio:.1%} (target >= {THROUGHPUT_TARGET:.0%}"
        f"{'' if ratio >= THROUGHPUT_TARGET else ': missed'}); added median time to first "
        f"token: {added:+.1f} ms (target < {TTFT_TARGET_MS:.0f} ms"
        f"{'' if added < TTFT_TARGET_MS else ': missed'})."
    )
    block = "\n".join(
        [
            *run_header(
                "workers.py",
                ", shared by daphne, the worker, Redis and the benchmark's clients. Load "
                f"average (1, 5, 15 min) before: {load_before}; after: {load_after}.",
            ),
            "",
            f"SmolLM2-135M float32, greedy, EOS ignored. Throughput: {args.streams} concurrent "
            f"streams of {args.max_tokens} tokens, best of {args.repeat} rounds. First token: "
            f"{args.ttft_requests} sequential one-stream requests per round (4 tokens each), "
            "all rounds pooled. Layouts alternate, each alone on the machine.",
            "",
            *rows,
            "",
            verdict,
        ]
    )
    print("\n" + block)
    if not args.no_write:
        write_results("workers.py", "Remote engine workers", block)


if __name__ == "__main__":
    main()
