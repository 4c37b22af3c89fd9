"""Engine throughput on the default model: Orchard's batched engine against mlx-lm's BatchGenerator.

    .venv/bin/python bench/engine.py [--model PATH] [--prompt-tokens 32] [--gen-tokens 32]

Both run on this thread with the same prompts (greedy, EOS ignored), one batch size at a time.
Then one decode step and one prefill chunk at batch 16 are timed part by part against the
machine's own measured fp32 matmul rate. Results go in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: F401, I001  (first: OpenBLAS must load before mlx)

# isort: split
import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from engine.batched import BatchedEngine
from engine.loader import LoadedModel, load_model
from engine.protocol import GenerationRequest, ModelSpec, SamplingParams
from engine.runner import sample

BATCH_SIZES = (1, 4, 8, 16)


def default_model() -> Path:
    from engine.gguf import convert_gguf, default_gguf_path

    folder = Path("var/cache/test-models/smollm2-135m-f32")
    if not (folder / "config.json").exists():
        convert_gguf(default_gguf_path(), folder, dtype="float32")
    return folder


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(batch)]


def run_orchard(loaded: LoadedModel, batch: list[list[int]], gen: int) -> float:
    spec = ModelSpec(name="bench", path="-", max_num_seqs=16, max_num_batched_tokens=2048)
    eng = BatchedEngine(spec, lambda: loaded)
    eng.loaded = loaded
    eng.ready.set_result(loaded.info)
    eng.setup()
    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    for i, prompt in enumerate(batch):
        request = GenerationRequest(f"r{i}", "bench", tuple(prompt), params)
        eng.scheduler.add(eng.make_request(request, lambda output: None))
    start = time.perf_counter()
    while eng.scheduler.has_work():
        eng.step()
    return len(batch) * gen / (time.perf_counter() - start)


def run_mlx_lm(loaded: LoadedModel, batch: list[list[int]], gen: int) -> float:
    generator = BatchGenerator(
        loaded.model, max_tokens=gen, completion_batch_size=16, prefill_batch_size=16
    )
    start = time.perf_counter()
    generator.insert(batch)
    num_tokens = 0
    while num_tokens < len(batch) * gen:
        num_tokens += len(generator.next_generated())
    elapsed = time.perf_counter() - start
    generator.close()
    return num_tokens / elapsed


def matmul_gflops() -> float:
    a, b = mx.random.normal((1024, 1024)), mx.random.normal((1024, 1024))
    mx.eval(a @ b)
    start = time.perf_counter()
    for _ in range(10):
        mx.eval(a @ b)
    return 10 * 2 * 1024**3 / (time.perf_counter() - start) / 1e9


def timed(fn, repeat: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1000


def profile(loaded: LoadedModel, prompt_tokens: int) -> None:
    """Where a batch-16 decode step and a prefill chunk spend their time."""
    from engine.runner import BatchRunner

    model, info = loaded.model, loaded.info
    num_params = sum(
        v.size for _, v in __import__("mlx.utils").utils.tree_flatten(model.parameters())
    )
    gflops = matmul_gflops()
    print(f"\nfp32 matmul 1024^3: {gflops:.1f} GFLOP/s; model parameters: {num_params / 1e6:.1f} M")

    eng_requests = prompts(16, prompt_tokens, info.vocab_size)
    spec = ModelSpec(name="bench", path="-", max_num_seqs=16, max_num_batched_tokens=2048)
    eng = BatchedEngine(spec, lambda: loaded)
    eng.loaded = loaded
    eng.ready.set_result(info)
    eng.setup()
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for i, prompt in enumerate(eng_requests):
        eng.scheduler.add(
            eng.make_request(GenerationRequest(f"p{i}", "b", tuple(prompt), params), lambda o: None)
        )
    for _ in range(3):
        eng.step()
    runner: BatchRunner = eng.runner
    rows = runner._rows
    cache = runner._cache
    inputs = mx.array([seq.token_at(seq.num_tokens - 1) for seq in rows])
    state = [c.state for c in cache]

    def forward_only():
        for c, s in zip(cache, state, strict=True):
            c.state = s
        mx.eval(model(inputs[:, None], cache=cache)[:, -1, :])

    def graph_only():
        for c, s in zip(cache, state, strict=True):
            c.state = s
        model(inputs[:, None], cache=cache)

    logits = model(inputs[:, None], cache=cache)[:, -1, :]
    mx.eval(logits)
    for c, s in zip(cache, state, strict=True):
        c.state = s
    step_ms = timed(lambda: eng.step())
    forward_ms = timed(forward_only)
    graph_ms = timed(graph_only)
    sample_ms = timed(lambda: sample(logits, rows))
    ideal_ms = 2 * num_params * 16 / (gflops * 1e9) * 1000
    print(f"decode step, batch 16: {step_ms:.1f} ms in all (Orchard's engine step)")
    print(
        f"  model forward (eval'd): {forward_ms:.1f} ms; "
        f"of which Python graph building {graph_ms:.1f} ms"
    )
    print(f"  sampling + one host sync: {sample_ms:.2f} ms")
    print(f"  matmul FLOPs at the measured rate: {ideal_ms:.1f} ms")
    print(f"  Orchard's own overhead (step - forward): {step_ms - forward_ms:.1f} ms")

    chunk = eng_requests[0][:prompt_tokens] * 4

    def prefill_chunk():
        c = make_prompt_cache(model)
        model(mx.array(chunk)[None], cache=c)
        mx.eval([x.state for x in c])

    prefill_ms = timed(prefill_chunk, repeat=3)
    ideal_prefill = 2 * num_params * len(chunk) / (gflops * 1e9) * 1000
    print(
        f"prefill chunk of {len(chunk)} tokens: {prefill_ms:.1f} ms; "
        f"matmul FLOPs at the measured rate {ideal_prefill:.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=BATCH_SIZES)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--skip-profile", action="store_true")
    args = parser.parse_args()
    loaded = load_model(args.model or default_model(), name="bench")
    print(
        f"model {loaded.info.name}: prompt {args.prompt_tokens} tokens, "
        f"{args.gen_tokens} generated each"
    )
    print("batch | Orchard tok/s | mlx-lm BatchGenerator tok/s")
    for size in args.batch_sizes:
        batch = prompts(size, args.prompt_tokens, loaded.info.vocab_size)
        # Alternate and keep the best of each: the machine is shared, so a single run can be
        # slowed by whatever else runs at that moment.
        baseline = orchard = 0.0
        for _ in range(args.repeat):
            baseline = max(baseline, run_mlx_lm(loaded, batch, args.gen_tokens))
            orchard = max(orchard, run_orchard(loaded, batch, args.gen_tokens))
        print(f"{size:5d} | {orchard:13.1f} | {baseline:10.1f}", flush=True)
    if not args.skip_profile:
        profile(loaded, args.prompt_tokens)


if __name__ == "__main__":
    main()
