"""More streams in the same memory: the quantized KV cache's capacity, speed and quality cost.

    .venv/bin/python bench/capacity.py [--budget-mib 128] [--no-write]

The default model (SmolLM2-135M, float32) in Orchard's batched engine on its own thread, with a
fixed memory budget for its caches (`--budget-mib`, no prefix cache), at full precision and with
the KV cache quantized to 8 and 4 bits (ModelSpec.kv_cache_bits, groups of 64):

- Capacity: a burst of 64 conversations sent at once; the most streams the engine runs together
  (admitted without waiting for memory), on a uniform mix (every prompt 200 tokens) and on a
  mixed one (one 2,000-token conversation for every fifteen of 200; the most rows running
  beside a long one). Targets: with 8-bit KV at
  least 1.8x the streams on the uniform mix; on the mixed one, with length cohorts
  (engine/cache/cohorts.py), at least 3x one padded batch's (every row at its longest row's
  length, as before cohorts) at the same precision.
- Speed: 16 concurrent streams of 64 tokens (200-token prompts): tokens/s, not below full
  precision's.
- Quality, on a fixed English text (the docstrings of a few standard-library modules, the same
  for a Python version): perplexity over it, teacher-forced in 256-token chunks through the
  cache; and greedy agreement with full precision: 16 prompts of 64 tokens, 48 tokens each,
  the share of tokens generated before the first one that differs, and the prompts whose whole
  continuation is the same. Results go in bench/RESULTS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402, F401  (OpenBLAS before anything imports mlx)

# isort: split
import argparse  # noqa: E402
import inspect  # noqa: E402
import itertools  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

from bench.fairness import MODEL_DIR, model  # noqa: E402
from bench.results import load_average, run_header, write_results  # noqa: E402
from engine.cache.mlx_caches import KVQuant, make_cache  # noqa: E402
from engine.core.batched import BatchedEngine  # noqa: E402
from engine.models.loader import LoadedModel  # noqa: E402
from engine.protocol import GenerationOutput, GenerationRequest, ModelSpec, SamplingParams  # noqa: E402

# name -> (the KV cache's quantization, length cohorts): the first is the cache as it was
# before cohorts (every row at the batch's longest row's length), the baseline of the mixed mix.
PADDED = "full precision, one padded batch"
CONFIGS = {
    PADDED: (None, False),
    "full precision": (None, True),
    "8-bit KV": (KVQuant(8, 64), True),
    "4-bit KV": (KVQuant(4, 64), True),
}
TEXT_MODULES = ("argparse", "json", "logging", "unittest", "email", "typing", "asyncio", "csv")
# Each conversation's reply in the capacity bursts: 200 + 56 tokens fill one 256-token step of
# the cache exactly.
CAPACITY_TOKENS = 56
LONG = 2000  # the mixed burst's long prompts
_ids = itertools.count()


def start(loaded: LoadedModel, quant: KVQuant | None, budget: int, compact: bool) -> BatchedEngine:
    spec = ModelSpec(
        name="bench",
        path=str(MODEL_DIR),
        max_num_seqs=256,
        max_waiting=1024,
        memory_budget_bytes=budget,
        prefix_cache_bytes=0,
        kv_cache_bits=quant.bits if quant else None,
        kv_cache_group_size=quant.group_size if quant else 64,
        compact_kv=compact,
    )
    served = BatchedEngine(spec, lambda: loaded)
    served.start().result()
    return served


def run(served: BatchedEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Send `prompts` at once (greedy, EOS ignored); their tokens, the seconds until the last
    ended, and the most rows that ran together, at any time and while a long prompt's request
    ran (sampled every millisecond)."""
    done = threading.Event()
    tokens: dict[str, list[int]] = {}
    left = [len(prompts)]
    lock = threading.Lock()

    def emit_for(rid: str):
        def emit(output: GenerationOutput) -> None:
            tokens.setdefault(rid, []).extend(output.token_ids)
            if output.finish_reason is not None:
                with lock:
                    left[0] -= 1
                    if not left[0]:
                        done.set()

        return emit

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"r{next(_ids)}" for _ in prompts]
    began = time.perf_counter()
    for rid, prompt in zip(ids, prompts, strict=True):
        served.submit(GenerationRequest(rid, "bench", tuple(prompt), params), emit_for(rid))
    peak = beside_long = 0
    while not done.wait(0.001):
        running = list(served.scheduler.running)  # a copy: the engine thread changes it
        rows = sum(len(request.live_sequences()) for request in running)
        peak = max(peak, rows)
        if any(request.num_prompt_tokens >= LONG for request in running):
            beside_long = max(beside_long, rows)
    return {
        "tokens": [tokens[rid] for rid in ids],
        "seconds": time.perf_counter() - began,
        "peak": peak,
        "beside_long": beside_long,
    }


def fixed_text(loaded: LoadedModel) -> list[int]:
    text = "\n\n".join(inspect.cleandoc(__import__(name).__doc__ or "") for name in TEXT_MODULES)
    return loaded.tokenizer.encode(text)


def perplexity(loaded: LoadedModel, quant: KVQuant | None, text: list[int]) -> float:
    """exp(mean negative log-likelihood) of `text` after its first token, fed through the
    cache in 256-token chunks (each chunk attends to the earlier ones through the cache)."""
    cache = make_cache(loaded.model, quant)
    total, count = 0.0, 0
    for start_ in range(0, len(text) - 1, 256):
        chunk = text[start_ : start_ + 256 + 1]
        logits = loaded.model(mx.array([chunk[:-1]]), cache=cache)[0].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        targets = mx.array(chunk[1:])
        nll = -mx.take_along_axis(logprobs, targets[:, None], axis=-1).sum()
        total += nll.item()
        count += len(chunk) - 1
    return math.exp(total / count)


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[float, int]:
    """The share of tokens before each row's first difference, and the rows all the same."""
    before = []
    for a, b in zip(ours, theirs, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        before.append(same / len(a))
    return sum(before) / len(before), sum(share == 1 for share in before)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget-mib", type=int, default=128, help="the caches' memory budget")
    parser.add_argument("--no-write", action="store_true", help="leave bench/RESULTS.md as it is")
    args = parser.parse_args()
    began, load_before = time.monotonic(), load_average()
    loaded = model()
    vocab = loaded.info.vocab_size
    rng = random.Random(0)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(count)]

    uniform = [tokens(200) for _ in range(64)]
    mixed = [tokens(LONG if i % 16 == 0 else 200) for i in range(64)]
    speed = [tokens(200) for _ in range(16)]
    text = fixed_text(loaded)
    starts = list(range(0, len(text) - 64, max(1, (len(text) - 64) // 16)))[:16]
    asks = [text[s : s + 64] for s in starts]
    budget = args.budget_mib << 20
    rows = {}
    for name, (quant, compact) in CONFIGS.items():
        served = start(loaded, quant, budget, compact)
        run(served, [tokens(16)], 4)  # warm up
        burst = run(served, mixed, CAPACITY_TOKENS)
        row = {
            "bytes": served.layout.kv_bytes_per_token,
            "uniform": run(served, uniform, CAPACITY_TOKENS)["peak"],
            "mixed": burst["beside_long"],
            "mixed_s": burst["seconds"],
        }
        fast = run(served, speed, 64)
        row["tokens_s"] = sum(map(len, fast["tokens"])) / fast["seconds"]
        if name != PADDED:  # the same numbers as full precision's: not measured twice
            row["greedy"] = run(served, asks, 48)["tokens"]
        served.stop()
        row["ppl"] = perplexity(loaded, quant, text) if name != PADDED else None
        rows[name] = row
        print(
            f"{name}: {row['bytes']} B/token, uniform {row['uniform']} streams, mixed "
            f"{row['mixed']} ({row['mixed_s']:.1f} s), {row['tokens_s']:.1f} tokens/s, "
            f"perplexity {row['ppl']}",
            flush=True,
        )
    full = rows["full precision"]
    table = [
        "| cache | bytes per token | streams admitted, uniform | streams admitted, mixed | "
        "mixed burst served in (s) | tokens/s at 16 streams | perplexity | greedy agreement "
        "(tokens before the first difference) | prompts all the same |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, row in rows.items():
        quality = "– | – | –"
        if row["ppl"] is not None:
            share, whole = agreement(row["greedy"], full["greedy"])
            quality = f"{row['ppl']:.3f} | {share:.1%} | {whole} of {len(asks)}"
        table.append(
            f"| {name} | {row['bytes']:,} | {row['uniform']} | {row['mixed']} | "
            f"{row['mixed_s']:.1f} | {row['tokens_s']:.1f} | {quality} |"
        )
    eight, padded = rows["8-bit KV"], rows[PADDED]
    uniform_ratio = eight["uniform"] / full["uniform"]
    mixed_ratio = full["mixed"] / padded["mixed"]
    speed_ratio = eight["tokens_s"] / full["tokens_s"]
    cohort_speed = full["tokens_s"] / padded["tokens_s"]

    def verdict(ok: bool) -> str:
        return "pass" if ok else "FAIL"

    lines = [
        *run_header(
            "capacity.py",
            f"; load average {load_before} before the run, {load_average()} after; "
            f"{time.monotonic() - began:.0f} s.",
        ),
        "",
        f"SmolLM2-135M float32, the caches' budget {args.budget_mib} MiB (no prefix cache), "
        "greedy, EOS ignored. Streams admitted: the most rows running together while a burst "
        f"of 64 conversations of {CAPACITY_TOKENS} tokens is served (uniform: 200-token "
        "prompts; mixed: one 2,000-token prompt for every fifteen of 200, the most rows "
        "running beside a long one). Quality: "
        f"{len(text):,} tokens of standard-library docstrings ({', '.join(TEXT_MODULES)}).",
        "",
        *table,
        "",
        f"- Uniform mix, 8-bit against full precision: {uniform_ratio:.2f}x the streams "
        f"(target >= 1.8x): {verdict(uniform_ratio >= 1.8)}.",
        f"- Mixed, length cohorts against one padded batch at the same precision: "
        f"{mixed_ratio:.2f}x the streams beside a long conversation (target >= 3x): "
        f"{verdict(mixed_ratio >= 3)}.",
        f"- Tokens/s at 16 streams, 8-bit against full precision: {speed_ratio:.2f}x (target: "
        f"not below): {verdict(speed_ratio >= 1)}; length cohorts against one padded batch: "
        f"{cohort_speed:.2f}x.",
    ]
    block = "\n".join(lines)
    print(block)
    if not args.no_write:
        write_results("capacity.py", "Capacity: more streams in the same memory", block)


if __name__ == "__main__":
    main()
