"""The fast CPU SwiGLU (engine/kernels.py) against mlx-lm's, alone and in the default model.

    .venv/bin/python bench/kernels.py [--model PATH] [--rounds 4]

First the activation alone (silu(gate) * up) at a prefill chunk, a batch-16 decode step and a
batch-1 decode step of a 1.5B model's MLP width, float32 and bfloat16. Then a 128-token prefill
chunk and batch-1 / batch-16 decode forwards of the model loaded twice, with the fast kernels
and with ORCHARD_FAST_KERNELS=0, alternated so both see the same machine; best of each.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: F401  (first: OpenBLAS must load before mlx)

# isort: split
import mlx.core as mx
from mlx_lm.models import activations
from mlx_lm.models.cache import make_prompt_cache

from bench.engine import default_model
from engine import kernels
from engine.loader import load_model

SHAPES = ((128, 1536), (16, 1536), (1, 8960))


def best_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def activation_alone() -> None:
    print("shape       | dtype    | mlx-lm swiglu ms | fast ms | speedup")
    for dtype in (mx.float32, mx.bfloat16):
        for shape in SHAPES:
            gate = (mx.random.normal(shape) * 4).astype(dtype)
            up = mx.random.normal(shape).astype(dtype)
            mx.eval(gate, up)
            theirs, ours = (
                best_ms(lambda f=f, g=gate, u=up: mx.eval(f(g, u)), 50)
                for f in (activations.swiglu, kernels.swiglu)
            )
            print(
                f"{shape!s:11s} | {str(dtype).split('.')[-1]:8s} | {theirs:16.3f} | {ours:7.3f} | "
                f"{theirs / ours:6.1f}x",
                flush=True,
            )


def in_the_model(path: Path, rounds: int) -> None:
    fast = load_model(path).model
    os.environ[kernels.ENV_SWITCH] = "0"
    plain = load_model(path).model
    del os.environ[kernels.ENV_SWITCH]
    rng = random.Random(0)
    chunk = mx.array([[rng.randrange(100, 49000) for _ in range(128)]])

    def prefill(model):
        cache = make_prompt_cache(model)
        model(chunk, cache=cache)
        mx.eval([c.state for c in cache])

    def decode(model, batch: int):
        cache = make_prompt_cache(model)
        model(mx.array([[rng.randrange(100, 49000) for _ in range(32)]] * batch), cache=cache)
        mx.eval([c.state for c in cache])
        tokens = mx.array([[5]] * batch)
        return lambda: mx.eval(model(tokens, cache=cache))

    cases = {
        name: {
            "prefill 128 tokens": lambda m=model: prefill(m),
            "decode, batch 1": decode(model, 1),
            "decode, batch 16": decode(model, 16),
        }
        for name, model in (("plain", plain), ("fast", fast))
    }
    results = {name: dict.fromkeys(cases[name], float("inf")) for name in cases}
    for _ in range(rounds):
        for name, case in cases.items():
            for label, fn in case.items():
                results[name][label] = min(results[name][label], best_ms(fn, 2))
    print("\nforward            | mlx-lm SwiGLU ms | fast ms | speedup")
    for label in results["plain"]:
        theirs, ours = results["plain"][label], results["fast"][label]
        print(f"{label:18s} | {theirs:16.1f} | {ours:7.1f} | {theirs / ours:6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    if not kernels.fast_kernels_enabled():
        sys.exit("the fast kernels are off here (not the CPU, no g++, or ORCHARD_FAST_KERNELS=0)")
    activation_alone()
    in_the_model(args.model or default_model(), args.rounds)


if __name__ == "__main__":
    main()
