"""The prefix cache's disk tier after a restart (engine/cache/disk/).

    .venv/bin/python bench/prefix_disk.py [--rounds 5] [--prefix-tokens 2000] [--no-write]

The default model (SmolLM2-135M, float32) in Orchard's batched engine on its own thread, with
the disk tier in a throwaway folder. Each round a new shared prefix of `--prefix-tokens` random
token ids is sent with a question to an engine that then stops (what its prefix cache holds goes
to disk, as when the process stops or the model unloads); a new engine over the same folder (a
restart) then gets the prefix with another question. Its time to first token, served from the
disk tier, is compared with the same request on an engine without one (cold: the whole prompt
computed) and, for scale, with the prompt sent again (a memory hit). Also measured: the read on
the engine thread during the request's admission (what running streams wait for), the spill
at the engine's end and the index's rebuild at the next start. Target: from disk at least 5x
faster than cold. Results go in bench/RESULTS.md.

The restart is a new engine in this process: the files are in the OS's page cache, as they are
after a restart shortly after a stop; a read from a cold SSD adds its transfer time.
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
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

from bench.fairness import MODEL_DIR, model  # noqa: E402
from bench.results import load_average, run_header, write_results  # noqa: E402
from engine.cache.disk import PrefixDiskConfig  # noqa: E402
from engine.core.batched import BatchedEngine  # noqa: E402
from engine.models.loader import LoadedModel  # noqa: E402
from engine.protocol import GenerationOutput, GenerationRequest, ModelSpec, SamplingParams  # noqa: E402

QUESTION_TOKENS = 8
_ids = itertools.count()


def start(loaded: LoadedModel, disk: PrefixDiskConfig | None) -> tuple[BatchedEngine, float]:
    """A started engine (with the disk tier `disk`) and the seconds its start took."""
    began = time.perf_counter()
    served = BatchedEngine(ModelSpec(name="bench", path=str(MODEL_DIR)), lambda: loaded)
    served.prefix_disk = disk
    served.start().result()
    return served, time.perf_counter() - began


def first_token(served: BatchedEngine, prompt: list[int]) -> tuple[float, int]:
    """Seconds to the first token of a one-token greedy request, and its cached tokens."""
    done = threading.Event()
    seen: list = []

    def emit(output: GenerationOutput) -> None:
        if output.token_ids and not seen:
            seen.append((time.perf_counter(), output.num_cached_tokens))
        if output.finish_reason is not None:
            done.set()

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    request = GenerationRequest(f"r{next(_ids)}", "bench", tuple(prompt), params)
    sent = time.perf_counter()
    served.submit(request, emit)
    assert done.wait(600), "no reply"
    return seen[0][0] - sent, seen[0][1]


def timed_reads(served: BatchedEngine) -> list[float]:
    """Record the seconds each disk-tier read-back takes on the engine thread."""
    disk = served.prefix_cache.disk
    extend, seconds = disk.extend, []

    def timed(*args, **kwargs):
        began = time.perf_counter()
        try:
            return extend(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - began)

    disk.extend = timed
    return seconds


def one_round(
    loaded: LoadedModel, cold: BatchedEngine, disk: PrefixDiskConfig, tokens, length: int
) -> dict:
    """A new prefix of `length` tokens through an engine that stops, then a restart's request
    from disk, a memory hit, and a cold request of the same length (on `cold`)."""
    prefix = tokens(length)
    before, _ = start(loaded, disk)
    first_token(before, [*prefix, *tokens(QUESTION_TOKENS)])
    began = time.perf_counter()
    before.stop()  # its prefix cache goes to disk
    spill = time.perf_counter() - began
    after, rebuild = start(loaded, disk)
    stats = after.stats().prefix_cache
    reads = timed_reads(after)
    disk_s, disk_cached = first_token(after, [*prefix, *tokens(QUESTION_TOKENS)])
    again = [*prefix, *tokens(QUESTION_TOKENS)]
    first_token(after, again)
    memory_s, _ = first_token(after, again)  # the same prompt again: memory's hit
    after.stop()
    cold_s, cold_cached = first_token(cold, [*tokens(length), *tokens(QUESTION_TOKENS)])
    assert disk_cached >= length - 128 and cold_cached == 0
    return {
        "cold": cold_s,
        "disk": disk_s,
        "memory": memory_s,
        "read": reads[0],
        "cached": disk_cached,
        "spill": spill,
        "rebuild": rebuild,
        "files": stats["disk_entries"],
        "bytes": stats["disk_bytes"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prefix-tokens", type=int, default=2000)
    parser.add_argument("--no-write", action="store_true", help="leave bench/RESULTS.md as it is")
    args = parser.parse_args()
    started, load_before = time.monotonic(), load_average()
    loaded = model()
    vocab = loaded.info.vocab_size
    rng = random.Random(0)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(count)]

    cold_engine, _ = start(loaded, None)
    first_token(cold_engine, tokens(64))  # warm up the kernels
    rows = []
    for round_ in range(args.rounds + 1):  # the first round warms up (shapes, files, caches)
        with tempfile.TemporaryDirectory(prefix="orchard-prefix-disk-") as folder:
            disk = PrefixDiskConfig(Path(folder), 4 << 30)
            row = one_round(loaded, cold_engine, disk, tokens, args.prefix_tokens)
        print(
            f"{'warm-up: ' if not round_ else ''}cold {row['cold']:.3f} s, from disk "
            f"{row['disk']:.3f} s ({row['cached']} cached, read {row['read'] * 1000:.0f} ms), "
            f"memory hit {row['memory']:.3f} s; spill at stop {row['spill']:.2f} s, start "
            f"{row['rebuild']:.2f} s",
            flush=True,
        )
        if round_:
            rows.append(row)
    cold_engine.stop()

    def median(key: str) -> float:
        return statistics.median(row[key] for row in rows)

    ratio = median("cold") / median("disk")
    # What the first engine kept: its prompt and the token it generated.
    per_token = median("bytes") / (args.prefix_tokens + QUESTION_TOKENS + 1)
    lines = [
        *run_header(
            "prefix_disk.py",
            f"; load average {load_before} before the run, {load_average()} after; "
            f"{time.monotonic() - started:.0f} s.",
        ),
        "",
        f"A {args.prefix_tokens}-token shared prefix and an {QUESTION_TOKENS}-token question, "
        f"{args.rounds} rounds, medians:",
        "",
        "| time to first token | median (s) | best (s) |",
        "| --- | --- | --- |",
        *(
            f"| {name} | {median(key):.3f} | {min(r[key] for r in rows):.3f} |"
            for name, key in (
                ("cold (no disk tier)", "cold"),
                ("after a restart, from the disk tier", "disk"),
                ("the same prompt again (memory)", "memory"),
            )
        ),
        "",
        f"From disk / cold: {ratio:.1f}x faster (target >= 5x): "
        f"{'pass' if ratio >= 5 else 'FAIL'}. Tokens read back: {median('cached'):.0f}.",
        "",
        f"The read on the engine thread at admission: {median('read') * 1000:.0f} ms "
        f"({median('read') * 1000 / median('cached') * 1000:.0f} ms per 1,000 tokens); "
        f"{median('files'):.0f} files, {median('bytes') / 1e6:.1f} MB on disk "
        f"({per_token / 1024:.1f} KiB per token). The spill when the engine stops: "
        f"{median('spill'):.2f} s; the next engine's start, the index rebuilt: "
        f"{median('rebuild'):.2f} s.",
    ]
    block = "\n".join(lines)
    print(block)
    if not args.no_write:
        write_results("prefix_disk.py", "The prefix cache's disk tier", block)


if __name__ == "__main__":
    main()
