"""The fast CPU kernels (engine/kernels/) against MLX's and mlx-lm's, alone and in the default
model.

    .venv/bin/python bench/kernels.py [--model PATH] [--rounds 4] [--context 160] [--clock cpu]

Alone, best of 50 calls each, the two sides alternated for several rounds (best of those):
- SwiGLU (silu(gate) * up) at a prefill chunk, a batch-16 and a batch-1 decode step of a 1.5B
  model's MLP width, float32 and bfloat16.
- Attention in the default model's shapes (9 query heads, 3 KV heads, head_dim 64): a 128-token
  causal prefill chunk, and batch-1 (at --context and 1000 keys) / batch-16 decode with the
  bool mask mlx-lm's BatchKVCache gives; with MLX's precise softmax alone on the same scores,
  which is most of its attention.
- `mx.fast.rms_norm` (on the CPU an unfused fallback) against the same compiled, not installed.
- RoPE (`nn.RoPE`: `mx.fast.rope`, on the CPU an unfused fallback) against the table of
  engine/kernels/rope.py: a forward's 60 calls (queries and keys of 30 layers) at a batch-16
  decode step (a position per row), a batch-1 step and a 128-token chunk.
Then the model loaded three times (ORCHARD_FAST_KERNELS=0, SwiGLU only, all fast kernels): a
128-token prefill chunk and batch-1 / batch-16 decode steps from --context tokens (each step
adds a key, as in serving), alternated so all see the same machine; best of each, by wall
time or (--clock cpu) by this process's CPU time.
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
import mlx.nn as nn
from mlx_lm.models import activations
from mlx_lm.models.cache import BatchKVCache, make_prompt_cache

from bench.engine import default_model
from engine.kernels import fast as kernels
from engine.kernels import rope as rope_kernel
from engine.models.loader import load_model

SHAPES = ((128, 1536), (16, 1536), (1, 8960))
HEADS, KV_HEADS, HEAD_DIM, HIDDEN = 9, 3, 64, 576  # SmolLM2-135M


def best_ms(fn, repeat: int, clock=time.perf_counter) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = clock()
        fn()
        times.append(clock() - start)
    return min(times) * 1000


def alternated(fns: dict, rounds: int, repeat: int = 50) -> dict:
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], best_ms(fn, repeat))
    return best


def dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).split(".")[-1]


def activation_alone(rounds: int) -> None:
    print("shape       | dtype    | mlx-lm swiglu ms | fast ms | speedup")
    for dtype in (mx.float32, mx.bfloat16):
        for shape in SHAPES:
            gate = (mx.random.normal(shape) * 4).astype(dtype)
            up = mx.random.normal(shape).astype(dtype)
            mx.eval(gate, up)
            t = alternated(
                {
                    f: lambda f=f, gate=gate, up=up: mx.eval(f(gate, up))
                    for f in (activations.swiglu, kernels.swiglu)
                },
                rounds,
            )
            theirs, ours = t[activations.swiglu], t[kernels.swiglu]
            print(
                f"{shape!s:11s} | {dtype_name(dtype):8s} | {theirs:16.3f} | {ours:7.3f} | "
                f"{theirs / ours:6.1f}x",
                flush=True,
            )


def attention_cases(batch: int, length: int, keys: int, dtype: mx.Dtype) -> dict:
    q = mx.random.normal((batch, HEADS, length, HEAD_DIM)).astype(dtype)
    k = mx.random.normal((batch, KV_HEADS, keys, HEAD_DIM)).astype(dtype)
    v = mx.random.normal((batch, KV_HEADS, keys, HEAD_DIM)).astype(dtype)
    mask = "causal" if length > 1 else mx.ones((batch, 1, 1, keys), dtype=mx.bool_)
    scores = mx.random.normal((batch, KV_HEADS, HEADS // KV_HEADS, length, keys)).astype(dtype)
    mx.eval(q, k, v, scores)
    return {
        "mlx": lambda: mx.eval(
            mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
        ),
        "softmax": lambda: mx.eval(mx.softmax(scores, axis=-1, precise=True)),
        "fast": lambda: mx.eval(kernels.scaled_dot_product_attention(q, k, v, None, 0.125, mask)),
    }


def attention_alone(rounds: int, context: int) -> None:
    print("\nattention           | dtype    | MLX sdpa ms | its softmax ms | fast ms | speedup")
    cases = {
        "prefill 128, causal": (1, 128, 128),
        f"decode b1, S={context}": (1, 1, context),  # below attention.MIN_SCORES: MLX's
        "decode b1, S=1000": (1, 1, 1000),
        f"decode b16, S={context}": (16, 1, context),
    }
    for dtype in (mx.float32, mx.bfloat16):
        for label, shape in cases.items():
            t = alternated(attention_cases(*shape, dtype), rounds)
            print(
                f"{label:19s} | {dtype_name(dtype):8s} | {t['mlx']:11.3f} | "
                f"{t['softmax']:14.3f} | {t['fast']:7.3f} | {t['mlx'] / t['fast']:6.2f}x",
                flush=True,
            )


def rms_norm_cases(shape: tuple) -> dict:
    def composed(x, w):
        return x * mx.rsqrt(mx.mean(mx.square(x), axis=-1, keepdims=True) + 1e-5) * w

    compiled = mx.compile(composed)
    x, w = mx.random.normal(shape), mx.random.normal((HIDDEN,))
    mx.eval(x, w)
    return {
        "mlx": lambda: mx.eval(mx.fast.rms_norm(x, w, 1e-5)),
        "compiled": lambda: mx.eval(compiled(x, w)),
        "add": lambda: mx.eval(x + 1.0),
    }


def rms_norm_alone(rounds: int) -> None:
    print("\nrms_norm      | mx.fast.rms_norm ms | compiled ms | an add, for scale ms")
    for shape in ((1, 128, HIDDEN), (16, 1, HIDDEN), (1, 1, HIDDEN)):
        t = alternated(rms_norm_cases(shape), rounds)
        print(
            f"{shape!s:13s} | {t['mlx']:19.3f} | {t['compiled']:11.3f} | {t['add']:8.3f}",
            flush=True,
        )


def rope_alone(rounds: int, context: int) -> None:
    print("\nRoPE, 60 calls        | mx.fast.rope ms | table ms | speedup")
    plain = nn.RoPE(HEAD_DIM, base=100000.0)  # the default model's
    fast = rope_kernel.fast_rope(plain, 8192)
    cases = {
        f"decode b16, S={context}": (16, 1, mx.array([context + i for i in range(16)])),
        f"decode b1, S={context}": (1, 1, context),
        "prefill 128": (1, 128, 0),
    }
    for label, (batch, length, offset) in cases.items():
        inputs = [
            mx.random.normal((batch, length, heads, HEAD_DIM)).transpose(0, 2, 1, 3)
            for _ in range(30)
            for heads in (HEADS, KV_HEADS)
        ]
        mx.eval(inputs)
        t = alternated(
            {
                name: lambda rope=rope, inputs=inputs, offset=offset: mx.eval(
                    [rope(x, offset=offset) for x in inputs]
                )
                for name, rope in (("mlx", plain), ("table", fast))
            },
            rounds,
            repeat=10,
        )
        print(
            f"{label:22s} | {t['mlx']:15.2f} | {t['table']:8.2f} | {t['mlx'] / t['table']:6.2f}x",
            flush=True,
        )


def load_variants(path: Path) -> dict:
    os.environ[kernels.ENV_SWITCH] = "0"
    plain = load_model(path).model
    del os.environ[kernels.ENV_SWITCH]
    # SwiGLU alone: install with the attention entry held back. `_fast_class` caches the
    # subclass per class, so clear it before and after.
    attention = kernels._REPLACEMENTS.pop("scaled_dot_product_attention")
    kernels._fast_class.cache_clear()
    fast_rope, kernels.fast_rope = kernels.fast_rope, lambda rope, positions: rope
    swiglu_only = load_model(path).model
    kernels.fast_rope = fast_rope
    kernels._REPLACEMENTS["scaled_dot_product_attention"] = attention
    kernels._fast_class.cache_clear()
    fast = load_model(path).model
    return {"off": plain, "SwiGLU": swiglu_only, "all": fast}


def in_the_model(path: Path, rounds: int, context: int, clock) -> None:
    models = load_variants(path)
    rng = random.Random(0)
    chunk = mx.array([[rng.randrange(100, 49000) for _ in range(128)]])
    prompt = mx.array([[rng.randrange(100, 49000) for _ in range(context)]])

    def prefill(model):
        cache = make_prompt_cache(model)
        model(chunk, cache=cache)
        mx.eval([c.state for c in cache])

    def decode(model, batch: int):
        # As the engine runs it: a prompt prefilled alone, its cache merged into the batch's.
        single = make_prompt_cache(model)
        model(prompt, cache=single)
        mx.eval([c.state for c in single])
        cache = [BatchKVCache.merge([layer] * batch) for layer in single]
        tokens = mx.array([[5]] * batch)
        return lambda: mx.eval(model(tokens, cache=cache))

    cases = {
        name: {
            "prefill 128 tokens": lambda m=model: prefill(m),
            "decode, batch 1": decode(model, 1),
            "decode, batch 16": decode(model, 16),
        }
        for name, model in models.items()
    }
    results = {name: dict.fromkeys(cases[name], float("inf")) for name in cases}
    for _ in range(rounds):
        for label in results["off"]:  # the variants of a case back to back: the same machine
            for name, case in cases.items():
                timed = best_ms(case[label], 2, clock)
                results[name][label] = min(results[name][label], timed)
    print(f"\nforward (context {context}) | all off ms | SwiGLU only ms | all fast ms | speedup")
    for label in results["off"]:
        off, swiglu, fast = (results[name][label] for name in ("off", "SwiGLU", "all"))
        print(f"{label:22s} | {off:10.1f} | {swiglu:14.1f} | {fast:11.1f} | {off / fast:6.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--context", type=int, default=160)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    if not kernels.fast_kernels_enabled():
        sys.exit("the fast kernels are off here (not the CPU, no g++, or ORCHARD_FAST_KERNELS=0)")
    print(f"load average at start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"clock: {args.clock}, OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}")
    activation_alone(args.rounds)
    attention_alone(args.rounds, args.context)
    rms_norm_alone(args.rounds)
    rope_alone(args.rounds, args.context)
    # --clock cpu times the forwards by this process's CPU time, which other work on a shared
    # machine inflates less than wall time (with OPENBLAS_NUM_THREADS=1, or BLAS threads'
    # spinning counts too).
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    in_the_model(args.model or default_model(), args.rounds, args.context, clock)
    print(f"\nload average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
