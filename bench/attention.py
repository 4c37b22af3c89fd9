"""Orchard's fused decode attention (engine/kernels/native/attention.c, an MLX primitive) against
the path of MLX ops it replaces (engine/kernels/attention.py with the fused kernel off), in one
process.

    .venv/bin/python bench/attention.py [--rounds 20]        # make bench-attention

The default model (SmolLM2-135M float32: 9 query heads over 3 KV heads of 64) is loaded once:
- one layer's attention alone, as a decode step calls it (a bool mask from mlx-lm's
  BatchKVCache), at batch 1 to 64 over 160 and 1000 keys: best of 50 calls, the two paths
  alternated round by round (its inputs stay in cache here, unlike in a forward);
- whole decode steps at batch 1 to 64 over a 128-token cache, the two paths alternated step by
  step for --rounds rounds: median and best of each (a shared machine's noise is ±20% a step);
- the nodes of a batch-16 decode step's graph either way (`mx.export_to_dot`), views included.
Results go in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: F401  (first: the BLAS and Orchard's sgemm before mlx)

# isort: split
import mlx.core as mx
from mlx_lm.models import base

from bench.api import wait_for_quiet
from bench.engine import default_model
from bench.results import load_average, run_header, write_results
from bench.sgemm import decode_cache, decode_step
from engine.kernels import attention
from engine.models.loader import load_model

BATCHES = (1, 4, 16, 32, 64)
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def one_layer(batch: int, keys: int):
    q = mx.random.normal((batch, HEADS, 1, HEAD_DIM))
    k, v = (mx.random.normal((batch, KV_HEADS, keys, HEAD_DIM)) for _ in range(2))
    mask = base.create_causal_mask(1, keys - 1, left_padding=mx.array([0] * batch))
    mx.eval(q, k, v, mask)
    return lambda: mx.eval(attention.scaled_dot_product_attention(q, k, v, None, 0.125, mask))


def best_of_calls(fn, calls: int = 50) -> float:
    fn()
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000


def both_ways(fn, rounds: int, measure) -> tuple[list[float], list[float]]:
    """Times of `fn` with the fused kernel off and on, alternated round by round."""
    times = {False: [], True: []}
    for _ in range(rounds):
        for fused in (False, True):
            attention.FUSED = fused
            times[fused].append(measure(fn))
    attention.FUSED = True
    return times[False], times[True]


def graph_nodes(model, batch: int) -> dict[bool, int]:
    """Primitives in one decode step's graph (built, not evaluated), without and with the fused
    kernel, from `mx.export_to_dot`."""
    cache = decode_cache(model, batch)
    counts = {}
    for fused in (False, True):
        attention.FUSED = fused
        logits = model(mx.array([[5]] * batch), cache=cache)
        with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
            mx.export_to_dot(dot.name, logits)
            counts[fused] = dot.read().count("shape=rectangle")
        mx.eval(logits)
        for layer in cache:
            layer.trim(1)
    attention.FUSED = True
    return counts


def one_step_ms(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--max-load", type=float, default=1.0)
    parser.add_argument("--max-wait", type=float, default=300, help="seconds to wait for quiet")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    if attention.fused_kernel() is None:
        parser.error("the fused kernel is not available here (see the log above)")
    wait_for_quiet(args.max_load, args.max_wait)
    load_before = load_average()
    model = load_model(default_model(), name="smollm2").model

    alone = ["| batch | keys | MLX ops ms | fused ms | speedup |", "|--:|--:|--:|--:|--:|"]
    for batch in BATCHES:
        for keys in (160, 1000):
            ops, fused = both_ways(one_layer(batch, keys), max(4, args.rounds // 4), best_of_calls)
            ops_ms, fused_ms = min(ops), min(fused)
            alone.append(
                f"| {batch} | {keys} | {ops_ms:.3f} | {fused_ms:.3f} | {ops_ms / fused_ms:.2f}x |"
            )
            print(alone[-1], flush=True)
    steps = [
        "| decode step | MLX ops ms, median (best) | fused ms, median (best) | median speedup |",
        "|---|--:|--:|--:|",
    ]
    for batch in BATCHES:
        ops, fused = both_ways(decode_step(model, batch), args.rounds, one_step_ms)
        ops_mid, fused_mid = statistics.median(ops), statistics.median(fused)
        steps.append(
            f"| batch {batch} | {ops_mid:.1f} ({min(ops):.1f}) | {fused_mid:.1f} "
            f"({min(fused):.1f}) | {ops_mid / fused_mid:.2f}x |"
        )
        print(steps[-1], flush=True)

    nodes = graph_nodes(model, 16)
    per_layer = (nodes[False] - nodes[True]) / len(model.layers)
    print(nodes, flush=True)

    block = "\n".join(
        [
            *run_header(
                "attention.py",
                f". Load average before: {load_before}; after: {load_average()}. mlx "
                f"{mx.__version__}.",
            ),
            "",
            "One layer's attention alone (9 query heads, 3 KV heads of 64, float32, the bool "
            f"mask of a BatchKVCache), best of 50 calls in each of {max(4, args.rounds // 4)} "
            "alternated rounds:",
            "",
            *alone,
            "",
            "SmolLM2-135M float32, whole decode steps over a 128-token cache, the two paths "
            f"alternated step by step, {args.rounds} steps each:",
            "",
            *steps,
            "",
            f"A batch-16 decode step's graph: {nodes[False]} nodes with MLX ops, {nodes[True]} "
            f"with the fused kernel ({per_layer:.1f} fewer a layer, "
            "views included).",
        ]
    )
    print(block)
    if not args.no_write:
        write_results("attention.py", "Fused decode attention", block)


if __name__ == "__main__":
    main()
