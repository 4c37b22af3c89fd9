"""Speculative decoding by prompt lookup (engine/core/speculative.py) on the default model.

    .venv/bin/python bench/speculative.py [--repeat 2] [--streams 1 4]     # make bench-speculative

Two workloads at each stream count, each run with drafts of up to 4 tokens and without, the two
alternated, each keeping its best of `--repeat`: "edit" (the chat template around "fix the
typos in this text", a different ~150-word passage per stream; greedy, up to 200 tokens, EOS
ends a reply: the model copies most of its input) and "random" (random-token prompts, 64
tokens, EOS ignored: nothing to look up, so this measures what drafting costs when it fails).
With `--draft-model PATH` (or `self`: the default model drafting for itself) each row is also
run with that model proposing the drafts (engine/core/draft_model.py). Greedy outputs must be
identical with and without; the run stops if they are not. Orchard's
`BatchedEngine` is stepped on this thread (no HTTP). Results go in bench/RESULTS.md.
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
from bench.engine import default_model
from bench.results import run_header, write_results
from engine.core.batched import BatchedEngine
from engine.models.loader import LoadedModel, load_model
from engine.protocol import GenerationRequest, ModelSpec, SamplingParams

DRAFT_TOKENS = 4
WORDS = (
    "the river town kept its old mill working long after the railway came and every spring "
    "the miller opened the sluice to let the flood water through while children watched from "
    "the bridge and the baker sold bread still warm from the morning ovens to travellers who "
    "stopped on their way north along the valley road past orchards and stone walls"
).split()


def passage(seed: int, words: int = 150) -> str:
    """Shuffled sentences from WORDS with a few typos (swapped letters)."""
    rng = random.Random(seed)
    out = []
    while len(out) < words:
        start = rng.randrange(len(WORDS) - 12)
        out += WORDS[start : start + rng.randrange(8, 12)]
        out[-1] += "."
    for i in rng.sample(range(len(out)), 8):
        word = out[i]
        if len(word) > 3:
            out[i] = word[0] + word[2] + word[1] + word[3:]
    return " ".join(out[:words])


def workload(loaded: LoadedModel, kind: str, streams: int) -> list[GenerationRequest]:
    if kind == "edit":
        params = SamplingParams(temperature=0.0, max_tokens=200)
        prompts = [
            loaded.tokenizer.apply_chat_template(
                [
                    {
                        "role": "user",
                        "content": "Fix the typos in this text and write it out again:\n\n"
                        + passage(seed),
                    }
                ],
                add_generation_prompt=True,
                tokenize=True,
            )
            for seed in range(streams)
        ]
    else:
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        rng = random.Random(streams)
        prompts = [
            [rng.randrange(100, loaded.info.vocab_size) for _ in range(96)] for _ in range(streams)
        ]
    return [
        GenerationRequest(f"{kind}{i}", "bench", tuple(prompt), params)
        for i, prompt in enumerate(prompts)
    ]


def run(
    loaded: LoadedModel,
    requests: list[GenerationRequest],
    draft: int,
    draft_path: str | None = None,
):
    """(generated tokens, seconds, outputs, drafted, accepted) on a fresh engine; with
    `draft_path`, a draft model proposes the drafts."""
    spec = ModelSpec(name="bench", path="-", speculative_tokens=draft, draft_path=draft_path)
    eng = BatchedEngine(spec, lambda: loaded)
    eng.loaded = loaded
    eng.ready.set_result(loaded.info)
    eng.setup()
    outputs: dict[str, list[int]] = {}
    for request in requests:
        tokens = outputs.setdefault(request.request_id, [])
        eng.scheduler.add(
            eng.make_request(request, lambda output, t=tokens: t.extend(output.token_ids))
        )
    started = time.perf_counter()
    while eng.scheduler.has_work():
        eng.step()
    seconds = time.perf_counter() - started
    spec_stats = eng.speculator
    drafted = spec_stats.num_drafted if spec_stats else 0
    accepted = spec_stats.num_accepted if spec_stats else 0
    return sum(map(len, outputs.values())), seconds, outputs, drafted, accepted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--draft-model",
        default=None,
        help="also run with this model folder drafting ('self': the default model for itself)",
    )
    args = parser.parse_args()
    loaded = load_model(default_model(), name="bench")
    draft_path = str(default_model()) if args.draft_model == "self" else args.draft_model
    load_before = os.getloadavg()
    run(loaded, workload(loaded, "random", 1), DRAFT_TOKENS)  # warm up kernels and shapes
    rows = []
    for kind in ("edit", "random"):
        for streams in args.streams:
            requests = workload(loaded, kind, streams)
            best: dict[int, tuple] = {}
            for _ in range(args.repeat):
                for draft in (0, DRAFT_TOKENS):
                    result = run(loaded, requests, draft)
                    if draft not in best or result[1] < best[draft][1]:
                        best[draft] = result
            off, on = best[0], best[DRAFT_TOKENS]
            if on[2] != off[2]:
                raise SystemExit(f"{kind} x{streams}: outputs differ with speculation")
            variants = [(kind, on)]
            if draft_path:
                with_model = min(
                    (run(loaded, requests, DRAFT_TOKENS, draft_path) for _ in range(args.repeat)),
                    key=lambda result: result[1],
                )
                if with_model[2] != off[2]:
                    raise SystemExit(f"{kind} x{streams}: outputs differ with the draft model")
                variants.append((f"{kind}, draft model {args.draft_model}", with_model))
            for name, result in variants:
                row = (name, streams, off[0], off[0] / off[1], result[0] / result[1], *result[3:])
                rows.append(row)
                print(
                    f"{name:6} streams={streams}: {row[2]} tokens, {row[3]:.1f} -> "
                    f"{row[4]:.1f} tok/s ({row[4] / row[3]:.2f}x), drafted {row[5]}, "
                    f"accepted {row[6]}",
                    flush=True,
                )
    load_after = os.getloadavg()
    if args.no_write:
        return
    lines = [
        *run_header(
            "speculative.py",
            f". Load average (1, 5, 15 min) before: {', '.join(f'{x:.2f}' for x in load_before)}; "
            f"after: {', '.join(f'{x:.2f}' for x in load_after)}.",
        ),
        "",
        "SmolLM2-135M float32, greedy; best of the runs; outputs identical with and without.",
        "",
        "| workload | streams | tokens | without tok/s | with tok/s | speedup "
        "| drafted | accepted |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        *(
            f"| {k} | {s} | {n} | {a:.1f} | {b:.1f} | {b / a:.2f}x | {d} | {acc} |"
            for k, s, n, a, b, d, acc in rows
        ),
    ]
    write_results("speculative.py", "Speculative decoding", "\n".join(lines))


if __name__ == "__main__":
    main()
