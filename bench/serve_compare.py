"""Orchard against mlx_lm.server: streamed chat tokens/s and time to first token at 1, 16 and
64 concurrent streams, same model directory, one run.

    .venv/bin/python bench/serve_compare.py [--streams 1 16 64] [--max-tokens 64] [--repeat 2]

(`make bench-serve`: these defaults.) Both servers run here for the whole run, on free ports:
daphne with config.asgi (as `make serve`) over a throwaway ORCHARD_HOME, the default model
registered with the registry's defaults and a key without limits (bench/api.py's setup_home);
and `mlx_lm.server --model DIR --port P` on the same folder, with its defaults. Both preload
engine/kernels/blas.py's BLAS (RTLD_GLOBAL, before mlx): Orchard by `import engine`, mlx_lm.server
by a `python -c` bootstrap; the run checks both have it mapped. Per level, that many concurrent
streamed chats (`openai` client), each its own ~96-token prompt (seeded random words, the same
for both, new each round), max_tokens 64, greedy. Orchard ignores EOS (`ignore_eos`);
mlx_lm.server cannot, so the prompts ask for a long story and tokens per stream (`usage`) are
reported. The servers alternate level by level, each keeping its best round by tokens/s;
TTFT p50/p99, failures, ratios and PASS/MISS against the issue's targets go in bench/RESULTS.md.
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
import importlib.metadata  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import httpx  # noqa: E402

from bench.api import MODEL, MODEL_DIR, setup_home, wait_for_quiet  # noqa: E402
from bench.prefix import WORDS  # noqa: E402
from bench.results import (  # noqa: E402
    load_average,
    run_header,
    write_results,
)
from engine.kernels.blas import fast_sgemm_wanted, find_blas  # noqa: E402
from tests.fixtures.daphne import free_port, start_daphne, stop_daphne  # noqa: E402

PEER = "mlx_lm.server"
PROMPT_WORDS = 50  # with the instruction and SmolLM2's chat template: ~96 prompt tokens
# The targets, Orchard / mlx_lm.server, at the levels they name.
TOKENS_PER_S_MIN = {1: 1.2, 16: 1.5, 64: 1.5}
TTFT_P50_MAX = {16: 0.5}
NO_FAILURES_AT = (64,)
# mlx_lm.server's process: the BLAS loaded globally before anything imports mlx, then the
# server as `python -m mlx_lm.server` runs it (`-c` leaves the arguments in sys.argv[1:]).
PEER_BOOTSTRAP = """\
import ctypes, runpy, sys
assert "mlx.core" not in sys.modules
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
sys.argv = ["mlx_lm.server", *sys.argv[2:]]
runpy.run_module("mlx_lm.server", run_name="__main__", alter_sys=True)
"""


@dataclass
class Side:
    name: str
    process: subprocess.Popen
    port: int
    model: str
    key: str
    extra_body: dict
    client: object = None  # openai.AsyncOpenAI, made inside the event loop


@dataclass
class Level:
    seconds: float = 0.0
    tokens: list[int] = field(default_factory=list)  # per successful stream, from usage
    ttfts: list[float] = field(default_factory=list)  # seconds to the first content delta
    prompt_tokens: list[int] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return sum(self.tokens) / self.seconds

    def ttft(self, q: float) -> float:
        ordered = sorted(self.ttfts)  # nearest rank
        return ordered[max(0, math.ceil(q * len(ordered)) - 1)]

    def cells(self) -> tuple[str, ...]:
        ttfts = f"{self.ttft(0.5):.3f}", f"{self.ttft(0.99):.3f}"
        return f"{self.tokens_per_s:.1f}", *ttfts, span(self.tokens)


def span(values: list[int]) -> str:
    low, high = min(values, default=0), max(values, default=0)
    return str(low) if low == high else f"{low}-{high}"


def prompt(round_: int, streams: int, index: int) -> str:
    rng = random.Random(f"serve-compare {round_} {streams} {index}")
    words = " ".join(rng.choice(WORDS) for _ in range(PROMPT_WORDS))
    # The words first: what the prompts share is the chat template's system prompt alone.
    return (
        f"{words.capitalize()}. Write a long story about an orchard that uses all of these words."
    )


def start_peer(blas: str, port: int, log_path: Path, processes: list) -> subprocess.Popen:
    """mlx_lm.server on `port`, in `processes` (to be stopped) before it is waited for."""
    args = ["--model", str(MODEL_DIR), "--port", str(port)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-c", PEER_BOOTSTRAP, blas, *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    processes.append(process)
    deadline = time.monotonic() + 180
    while process.poll() is None and time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).raise_for_status()
            return process
        except httpx.HTTPError:
            time.sleep(0.5)
    raise RuntimeError(f"{PEER} did not start (exit status {process.poll()})")


def has_mapped(pid: int, library: str) -> bool:
    target = os.path.realpath(library)
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return any(os.path.realpath(line.split()[-1]) == target for line in lines if "/" in line)


async def stream_one(side: Side, content: str, max_tokens: int) -> tuple[int, float, int]:
    """(generated tokens, seconds to the first content delta, prompt tokens) of one stream."""
    start = time.perf_counter()
    stream = await side.client.chat.completions.create(
        model=side.model,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=side.extra_body,
    )
    first = usage = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - start
        if chunk.usage is not None:
            usage = chunk.usage
    if first is None or usage is None:
        raise RuntimeError(f"no {'content' if first is None else 'usage'} in the stream")
    return usage.completion_tokens, first, usage.prompt_tokens


async def run_level(side: Side, round_: int, streams: int, max_tokens: int) -> Level:
    prompts = [prompt(round_, streams, i) for i in range(streams)]
    start = time.perf_counter()
    results = await asyncio.gather(
        *(stream_one(side, p, max_tokens) for p in prompts), return_exceptions=True
    )
    level = Level(seconds=time.perf_counter() - start)
    for result in results:
        if isinstance(result, Exception):
            cause = f" ({result.__cause__!r})" if result.__cause__ else ""
            level.failures.append(f"{type(result).__name__}: {result}{cause}"[:300])
        elif isinstance(result, BaseException):
            raise result  # cancelled: Ctrl-C
        else:
            level.tokens.append(result[0])
            level.ttfts.append(result[1])
            level.prompt_tokens.append(result[2])
    return level


async def measure(args, sides: list[Side], blas: str) -> tuple[dict, dict]:
    import openai

    connections = max(args.streams) + 8
    for side in sides:
        side.client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{side.port}/v1",
            api_key=side.key,
            max_retries=0,
            timeout=900,
            http_client=httpx.AsyncClient(
                limits=httpx.Limits(max_connections=connections), timeout=900
            ),
        )
    best: dict[tuple[str, int], Level] = {}
    failures: dict[tuple[str, int], list[str]] = {}
    try:
        for side in sides:  # warm-up: models load, kernels compile
            warm = await run_level(side, -1, 2, 8)
            if warm.failures:
                raise RuntimeError(f"{side.name} warm-up failed: {warm.failures}")
            if not has_mapped(side.process.pid, blas):
                raise RuntimeError(f"{side.name} (pid {side.process.pid}) has no {blas} mapped")
        for round_ in range(args.repeat):
            for streams in args.streams:
                for side in sides:
                    level = await run_level(side, round_, streams, args.max_tokens)
                    rate, p50, p99, tokens = level.cells() if level.tokens else ("-",) * 4
                    print(
                        f"round {round_ + 1}, {streams} streams, {side.name}: {rate} tokens/s, "
                        f"TTFT p50 {p50} s, p99 {p99} s, {tokens} tokens per stream, "
                        f"{len(level.failures)} failures",
                        flush=True,
                    )
                    key = (side.name, streams)
                    failures.setdefault(key, []).extend(level.failures)
                    kept = best.get(key)
                    if level.tokens and (kept is None or level.tokens_per_s > kept.tokens_per_s):
                        best[key] = level
    finally:
        for side in sides:
            await side.client.close()
    return best, failures


def verdict(streams: int, orchard: Level, peer: Level, orchard_failures: int) -> str:
    tokens, ttft = orchard.tokens_per_s / peer.tokens_per_s, orchard.ttft(0.5) / peer.ttft(0.5)
    out = []
    if streams in TOKENS_PER_S_MIN:
        target = TOKENS_PER_S_MIN[streams]
        out.append(f"{'PASS' if tokens >= target else 'MISS'} tokens/s >= {target}x")
    if streams in TTFT_P50_MAX:
        target = TTFT_P50_MAX[streams]
        out.append(f"{'PASS' if ttft <= target else 'MISS'} TTFT p50 <= {target}x")
    if streams in NO_FAILURES_AT:
        out.append(f"{'MISS' if orchard_failures else 'PASS'} no failures")
    return f"{tokens:.2f}x | {ttft:.2f}x | {'; '.join(out) or 'none set'}"


def report(args, best: dict, failures: dict) -> list[str]:
    """One row per level; a cell with two figures is Orchard's / mlx_lm.server's."""
    rows = [
        "| streams | tokens/s | TTFT p50 (s) | TTFT p99 (s) | tokens per stream | failures "
        "(all rounds) | tokens/s, Orchard / peer | TTFT p50, Orchard / peer | targets |",
        "|--:|--:|--:|--:|--:|--:|--:|--:|---|",
    ]
    notes = []
    for streams in args.streams:
        orchard, peer = best.get(("Orchard", streams)), best.get((PEER, streams))
        failed = [failures.get((name, streams), []) for name in ("Orchard", PEER)]
        notes += [
            f"{name}, {streams} streams: `{errors[0]}`"
            for name, errors in zip(("Orchard", PEER), failed, strict=True)
            if errors
        ]
        count = f"{len(failed[0])} / {len(failed[1])}"
        if orchard is None or peer is None:
            rows.append(f"| {streams} | n/a | n/a | n/a | n/a | {count} | n/a | n/a | MISS |")
            continue
        cells = " | ".join(
            " / ".join(pair) for pair in zip(orchard.cells(), peer.cells(), strict=True)
        )
        rows.append(
            f"| {streams} | {cells} | {count} | {verdict(streams, orchard, peer, len(failed[0]))} |"
        )
    return [*rows, *(["", "First failures:", *notes] if notes else [])]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--max-load", type=float, default=1.0)
    parser.add_argument("--max-wait", type=float, default=600, help="seconds to wait for quiet")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    blas = find_blas()
    if blas is None:
        parser.error("no BLAS library to preload (engine/kernels/blas.py found none, or it is off)")
    # SIGTERM unwinds like Ctrl-C, through the `finally` that stops both servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))

    wait_for_quiet(args.max_load, args.max_wait)
    load_before = load_average()
    home = Path(tempfile.mkdtemp(prefix="orchard-bench-serve-"))
    processes: list[subprocess.Popen] = []
    try:
        key, _ = setup_home(home)
        from inference.models import ModelEntry
        from inference.services.registry import model_spec

        spec = model_spec(ModelEntry.objects.get(name=MODEL)).to_dict()
        registry = ", ".join(f"{k} {v}" for k, v in spec.items() if k not in ("name", "path"))
        orchard_port = peer_port = free_port()
        while peer_port == orchard_port:
            peer_port = free_port()
        peer = start_peer(blas, peer_port, home / "peer.log", processes)
        daphne = start_daphne(port=orchard_port, env=dict(os.environ), log_path=home / "daphne.log")
        processes.append(daphne)
        print(f"Orchard pid {daphne.pid}, {PEER} pid {peer.pid}; {registry}", flush=True)
        sides = [
            Side("Orchard", daphne, orchard_port, MODEL, key, {"ignore_eos": True}),
            Side(PEER, peer, peer_port, "default_model", "none", {}),
        ]
        best, failures = asyncio.run(measure(args, sides, blas))
    except Exception:
        for log in ("daphne.log", "peer.log"):
            if (home / log).exists():
                print(f"--- end of {log}:\n{(home / log).read_text()[-3000:]}", file=sys.stderr)
        raise
    finally:
        for process in reversed(processes):
            stop_daphne(process)  # terminate, then kill after 20 s: any server process
        shutil.rmtree(home, ignore_errors=True)
    load_after = load_average()
    version = importlib.metadata.version
    prompt_tokens = [n for level in best.values() for n in level.prompt_tokens]
    block = "\n".join(
        [
            *run_header(
                "serve_compare.py",
                ", both servers up all run, one generating at a time. Load average before: "
                f"{load_before}; after: {load_after}. mlx {version('mlx')}, mlx-lm "
                f"{version('mlx-lm')}, openai {version('openai')}; both servers preload "
                f"`{blas}` (RTLD_GLOBAL, before mlx); Orchard "
                + (
                    "puts its own cblas_sgemm in front of it (engine/kernels/native/sgemm.c)."
                    if fast_sgemm_wanted()
                    else "without its own cblas_sgemm (ORCHARD_FAST_SGEMM=0)."
                ),
                note=" (`make bench-serve` runs it with the defaults)",
            ),
            "",
            f"Orchard: daphne + config.asgi, `{MODEL}` with the registry's defaults ({registry}), "
            f"a key without limits, `ignore_eos: true`. {PEER}: `--model "
            f"{MODEL_DIR.relative_to(ROOT)} --port <free port>`, no other flags (mlx-lm 0.32.2's "
            "defaults: --decode-concurrency 32, --prompt-concurrency 8, --prefill-step-size 2048, "
            "--prompt-cache-size 10); it cannot ignore EOS: the prompts ask for a long story. "
            f"Per level, that many concurrent streamed chats (`openai` client), each its own "
            f"prompt ({span(prompt_tokens)} tokens, seeded random words, the same for both, new "
            f"each round), max_tokens {args.max_tokens}, temperature 0, tokens from `usage`. "
            "tokens/s: generated tokens / the level's wall time; TTFT: request start to first "
            f"content delta (p99: nearest rank). Best of {args.repeat} rounds by tokens/s (TTFT "
            "from that round), the servers alternating level by level.",
            "",
            *report(args, best, failures),
        ]
    )
    print("\n" + block)
    if not args.no_write:
        write_results("serve_compare.py", "Orchard against mlx_lm.server", block)


if __name__ == "__main__":
    main()
