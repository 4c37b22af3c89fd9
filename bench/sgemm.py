"""Orchard's cblas_sgemm (engine/kernels/native/sgemm.c) against the BLAS library alone, in one
process.

    .venv/bin/python bench/sgemm.py [--rounds 5]        # make bench-sgemm

The default model (SmolLM2-135M float32) is loaded once; every figure is taken with Orchard's
sgemm taking products of up to `--max-rows` rows and with it handing every product to the
library (`engine.kernels.blas.sgemm_max_rows`), the two alternated round by round, best of
`--rounds`:
- the model's weight matmuls (its 210 Linear layers and the tied vocabulary head) for M rows;
- one sequence's attention in a decode step, as MLX calls it (each sequence and KV head its own
  product): 3 query heads by 64 against 160 keys, scores then values;
- whole forwards: decode steps at 1 to 64 rows over a 128-token cache, and a 128-token prefill.
Results go in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: F401  (first: the BLAS and Orchard's sgemm before mlx)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from bench.api import wait_for_quiet
from bench.engine import default_model
from bench.results import load_average, run_header, write_results
from engine.cache.mlx_caches import make_cache, merge
from engine.kernels import blas
from engine.models.loader import load_model

ROWS = (1, 2, 4, 8, 16, 32, 48, 64)
DECODE_BATCHES = (1, 4, 16, 32, 64)
CONTEXT = 128


def best_ms(fn, calls: int = 3) -> float:
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def both_ways(fn, rounds: int, max_rows: int) -> tuple[float, float]:
    """(library alone, with Orchard's sgemm) milliseconds of `fn`, alternated, best of each."""
    library = orchard = float("inf")
    for _ in range(rounds):
        blas.sgemm_max_rows(0)
        library = min(library, best_ms(fn))
        blas.sgemm_max_rows(max_rows)
        orchard = min(orchard, best_ms(fn))
    return library, orchard


def weight_matmuls(model: nn.Module, rows: int):
    linears = [
        m
        for _, m in tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module))
        if isinstance(m, nn.Linear)
    ]
    head = model.model.embed_tokens
    inputs = {w: mx.random.normal((rows, w)) for w in {m.weight.shape[1] for m in linears}}
    mx.eval(list(inputs.values()))

    def run():
        outs = [m(inputs[m.weight.shape[1]]) for m in linears]
        outs.append(head.as_linear(inputs[head.weight.shape[1]]))
        mx.eval(outs)

    return run


def attention_products():
    queries, keys, values = (mx.random.normal(s) for s in ((3, 64), (160, 64), (160, 64)))
    mx.eval(queries, keys, values)

    def run():
        # One sequence's KV head as MLX computes it per step; 1440 of them make a batch-16 step
        # of the default model (16 sequences x 3 KV heads x 30 layers).
        mx.eval([(queries @ keys.T) @ values for _ in range(1440)])

    return run


def decode_cache(model: nn.Module, batch: int):
    """A decode batch's cache: `batch` rows of `CONTEXT` tokens each, prefilled and merged."""
    caches = []
    for row in range(batch):
        cache = make_cache(model)
        model(mx.array([[100 + row + i for i in range(CONTEXT)]]), cache=cache)
        mx.eval([layer.state for layer in cache])
        caches.append(cache)
    cache = merge(caches)
    mx.eval([layer.state for layer in cache])
    return cache


def decode_step(model: nn.Module, batch: int):
    cache = decode_cache(model, batch)
    tokens = mx.array([[5]] * batch)

    def run():
        mx.eval(model(tokens, cache=cache))
        for layer in cache:
            layer.trim(1)

    return run


def prefill(model: nn.Module):
    tokens = mx.array([[100 + i for i in range(CONTEXT)]])

    def run():
        cache = make_cache(model)
        mx.eval(model(tokens, cache=cache)[:, -1])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-rows", type=int, default=blas.DEFAULT_MAX_ROWS)
    parser.add_argument("--max-load", type=float, default=1.0)
    parser.add_argument("--max-wait", type=float, default=300, help="seconds to wait for quiet")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if not blas.sgemm_fast():
        parser.error("Orchard's sgemm is not loaded here (engine/kernels/blas.py)")
    wait_for_quiet(args.max_load, args.max_wait)
    load_before = load_average()
    model = load_model(default_model(), name="smollm2").model
    measure_rows = max(args.max_rows, max(ROWS))

    lines = [
        "| rows (M) | library ms | Orchard's sgemm ms | speedup |",
        "|--:|--:|--:|--:|",
    ]
    for rows in ROWS:
        library, orchard = both_ways(weight_matmuls(model, rows), args.rounds, measure_rows)
        lines.append(f"| {rows} | {library:.1f} | {orchard:.1f} | {library / orchard:.2f}x |")
        print(lines[-1], flush=True)
    library, orchard = both_ways(attention_products(), args.rounds, measure_rows)
    attention = (
        f"One sequence's decode attention for one KV head (3 x 64 queries, 160 keys: scores, "
        f"then values), 1440 times (a batch-16 step of this model): library "
        f"{library:.1f} ms, Orchard's sgemm {orchard:.1f} ms ({library / orchard:.2f}x; "
        f"{library / 1440 * 1000:.1f} against {orchard / 1440 * 1000:.1f} us a sequence)."
    )
    print(attention, flush=True)
    forwards = [
        f"| forward | library ms | Orchard's sgemm (up to {args.max_rows} rows) ms | speedup |",
        "|---|--:|--:|--:|",
    ]
    for batch in DECODE_BATCHES:
        library, orchard = both_ways(decode_step(model, batch), args.rounds, args.max_rows)
        forwards.append(
            f"| decode, batch {batch} | {library:.1f} | {orchard:.1f} | {library / orchard:.2f}x |"
        )
        print(forwards[-1], flush=True)
    library, orchard = both_ways(prefill(model), args.rounds, args.max_rows)
    forwards.append(
        f"| prefill, {CONTEXT} tokens | {library:.1f} | {orchard:.1f} | {library / orchard:.2f}x |"
    )
    print(forwards[-1], flush=True)
    blas.sgemm_max_rows(args.max_rows)

    threads = os.environ.get(blas.SGEMM_THREADS_ENV) or len(os.sched_getaffinity(0))
    block = "\n".join(
        [
            *run_header(
                "sgemm.py",
                f", {threads} sgemm threads. Load average before: {load_before}; after: "
                f"{load_average()}. Library: `{blas.sgemm_backend()}`.",
            ),
            "",
            "SmolLM2-135M float32. Best of "
            f"{args.rounds} alternated rounds (3 calls each). The model's weight matmuls "
            "(210 Linear layers + the 576 x 49152 vocabulary head) for M rows:",
            "",
            *lines,
            "",
            attention,
            "",
            f"Whole forwards, decode steps over a {CONTEXT}-token cache:",
            "",
            *forwards,
        ]
    )
    print(block)
    if not args.no_write:
        write_results("sgemm.py", "Small-M sgemm", block)


if __name__ == "__main__":
    main()
