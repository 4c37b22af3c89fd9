"""Engine throughput on the default model: Orchard's batched engine against mlx-lm's BatchGenerator.

    .venv/bin/python bench/engine.py [--model PATH] [--prompt-tokens 32] [--gen-tokens 32]

Both run on this thread with the same prompts (greedy, EOS ignored), one batch size at a time.
Then the cost of structured output: batch 1 and 16 with half the rows (at batch 1, the row)
under a JSON schema, against the same batch unconstrained. Then one decode step and one
prefill chunk at batch 16 are timed part by part against the machine's own measured fp32
matmul rate. Results go in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine  # noqa: F401  (first: OpenBLAS must load before mlx)

# isort: split
import llguidance
import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import make_prompt_cache

from engine.core.batched import BatchedEngine
from engine.core.sampled import sample
from engine.core.sampling import SamplingState, sample_batch
from engine.models.loader import LoadedModel, load_model
from engine.protocol import GenerationRequest, ModelSpec, SamplingParams

BATCH_SIZES = (1, 4, 8, 16, 32, 64)


def default_model() -> Path:
    from engine.models.gguf import convert_gguf, default_gguf_path

    folder = Path("var/cache/test-models/smollm2-135m-f32")
    if not (folder / "config.json").exists():
        convert_gguf(default_gguf_path(), folder, dtype="float32")
    return folder


def prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(batch)
    return [[rng.randrange(100, vocab) for _ in range(length)] for _ in range(batch)]


# Structured output's cost: half the rows under this schema (a string that cannot end within
# the bench's tokens, so every row generates all of them, as the unconstrained rows do).
BENCH_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 1000}},
    "required": ["text"],
}


def make_engine(
    loaded: LoadedModel, batch: list[list[int]], max_tokens: int, grammar: str | None = None
) -> BatchedEngine:
    """Orchard's batched engine with `batch` queued (greedy, EOS ignored), stepped by the caller;
    with `grammar`, every other row (from the first) is constrained by it."""
    # Every row decodes together (the engine's default batch is 64); no drafts, so this
    # compares the batched forward itself with mlx-lm's.
    spec = ModelSpec(
        name="bench", path="-", max_num_seqs=max(16, len(batch)), max_num_batched_tokens=2048
    )
    eng = BatchedEngine(spec, lambda: loaded)
    eng.loaded = loaded
    eng.ready.set_result(loaded.info)
    eng.setup()
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(batch):
        row_params = params if grammar is None or i % 2 else replace(params, grammar=grammar)
        request = GenerationRequest(f"r{i}", "bench", tuple(prompt), row_params)
        eng.scheduler.add(eng.make_request(request, lambda output: None))
    return eng


def run_orchard(
    loaded: LoadedModel, batch: list[list[int]], gen: int, grammar: str | None = None
) -> float:
    eng = make_engine(loaded, batch, gen, grammar)
    if grammar is not None:
        eng.compile_grammar(grammar)  # compiled once, as a schema sent again is
    start = time.perf_counter()
    while eng.scheduler.has_work():
        eng.step()
    return len(batch) * gen / (time.perf_counter() - start)


def structured_cost(loaded: LoadedModel, args: argparse.Namespace) -> None:
    grammar = llguidance.LLMatcher.grammar_from_json_schema(BENCH_SCHEMA)
    print("batch | unconstrained tok/s | half the rows under a JSON schema tok/s | ratio")
    for size in (1, 16):
        batch = prompts(size, args.prompt_tokens, loaded.info.vocab_size)
        free = constrained = 0.0
        for _ in range(args.repeat):
            free = max(free, run_orchard(loaded, batch, args.gen_tokens))
            constrained = max(constrained, run_orchard(loaded, batch, args.gen_tokens, grammar))
        print(f"{size:5d} | {free:19.1f} | {constrained:39.1f} | {constrained / free:5.2f}")


def run_mlx_lm(loaded: LoadedModel, batch: list[list[int]], gen: int) -> float:
    generator = BatchGenerator(
        loaded.model,
        max_tokens=gen,
        completion_batch_size=max(16, len(batch)),
        prefill_batch_size=16,
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
    return 2 * 1024**3 / timed(lambda: mx.eval(a @ b), repeat=10) / 1e6


def streaming_gbps(rows: int, cols: int) -> float:
    """fp32 weight-streaming rate: a matrix-vector product reads each weight once."""
    w, x = mx.random.normal((rows, cols)), mx.random.normal((1, cols))
    mx.eval(w, x)
    return rows * cols * 4 / timed(lambda: mx.eval(x @ w.T), repeat=10) / 1e6


def timed(fn, repeat: int = 5) -> float:
    """Milliseconds per call, after one warm-up call."""
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat * 1000


def matmuls_ms(model, num_rows: int, head: bool) -> float:
    """The forward's weight matmuls alone: projections, and the tied vocabulary head if `head`
    (prefill chunks never project through the vocabulary)."""
    weights = [w for name, w in tree_flatten(model.parameters()) if name.endswith("proj.weight")]
    if head:
        weights.append(model.model.embed_tokens.weight)
    x = mx.random.normal((num_rows, max(w.shape[1] for w in weights)))
    mx.eval(x, weights)
    return timed(lambda: mx.eval([x[:, : w.shape[1]] @ w.T for w in weights]), repeat=5)


def profile_decode(
    loaded: LoadedModel, size: int, prompt_tokens: int, gflops: float, gbps: float
) -> None:
    model, info = loaded.model, loaded.info
    num_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    eng = make_engine(loaded, prompts(size, prompt_tokens, info.vocab_size), max_tokens=1000)
    for _ in range(3):
        eng.step()
    step_ms = timed(eng.step, repeat=8)
    eng.scheduler.decodes_only_after = lambda plan: False  # lockstep: sync, then build next
    eng.step()
    lockstep_ms = timed(eng.step, repeat=8)
    rows, cache = eng.runner._rows, eng.runner._cache
    inputs = mx.array([seq.token_at(seq.num_tokens - 1) for seq in rows])
    forward_ms = timed(lambda: mx.eval(model(inputs[:, None], cache=cache)[:, -1, :]))
    graph_ms = timed(lambda: model(inputs[:, None], cache=cache))
    mx.eval([layer.state for layer in cache])  # the graphs built just above
    logits = model(inputs[:, None], cache=cache)[:, -1, :]
    started = time.perf_counter()
    mx.async_eval(logits)
    async_ms = (time.perf_counter() - started) * 1000
    greedy_ms = timed(lambda: sample(logits, rows), repeat=20)
    tempered = [
        SamplingState(
            SamplingParams(temperature=1.0),
            prompt_token_ids=(),
            eos_token_ids=(),
            vocab_size=info.vocab_size,
        )
        for _ in rows
    ]
    tempered_ms = timed(lambda: mx.eval(sample_batch(logits, tempered).token_ids), repeat=20)
    print(
        f"decode step, batch {size}: {step_ms:.1f} ms per engine step running ahead, "
        f"{lockstep_ms:.1f} ms in lockstep\n"
        f"  model forward, eval'd: {forward_ms:.1f} ms; its weight matmuls alone "
        f"{matmuls_ms(model, size, head=True):.1f} ms; Python graph building {graph_ms:.1f} ms; "
        f"mx.async_eval returned after {async_ms:.1f} ms\n"
        f"  sampling: greedy + host sync {greedy_ms:.2f} ms, temperature-only "
        f"{tempered_ms:.2f} ms\n"
        f"  limits: FLOPs at the 1024^3 matmul rate "
        f"{2 * num_params * size / (gflops * 1e9) * 1000:.1f} ms; weights read once at "
        f"the streaming rate {num_params * 4 / (gbps * 1e9) * 1000:.1f} ms",
        flush=True,
    )


def profile(loaded: LoadedModel, prompt_tokens: int) -> None:
    """Where a batch-16 decode step and a prefill chunk spend their time."""
    model, info = loaded.model, loaded.info
    num_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    gflops = matmul_gflops()
    gbps = streaming_gbps(info.vocab_size, model.args.hidden_size)
    print(
        f"\nfp32 matmul 1024^3: {gflops:.0f} GFLOP/s; fp32 weight streaming (matrix-vector, "
        f"{info.vocab_size}x{model.args.hidden_size}): {gbps:.1f} GB/s; "
        f"parameters {num_params / 1e6:.1f} M ({num_params * 4 / 1e6:.0f} MB)"
    )
    for size in (16, 1):
        profile_decode(loaded, size, prompt_tokens, gflops, gbps)

    chunk = prompts(1, 128, info.vocab_size)[0]

    def prefill_chunk():
        c = make_prompt_cache(model)
        model(mx.array(chunk)[None], cache=c)
        mx.eval([x.state for x in c])

    prefill_ms = timed(prefill_chunk, repeat=3)
    print(
        f"prefill chunk of {len(chunk)} tokens: {prefill_ms:.1f} ms; its weight matmuls alone "
        f"{matmuls_ms(model, len(chunk), head=False):.1f} ms; FLOPs at the 1024^3 matmul rate "
        f"{2 * num_params * len(chunk) / (gflops * 1e9) * 1000:.1f} ms"
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
    structured_cost(loaded, args)
    if not args.skip_profile:
        profile(loaded, args.prompt_tokens)


if __name__ == "__main__":
    main()
