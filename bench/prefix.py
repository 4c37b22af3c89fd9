"""Prefix cache and chunked prefill through HTTP: Orchard against mlx_lm.server, same models,
one run.

    .venv/bin/python bench/prefix.py [--repeat 3] [--prefix-words 750] [--no-write]

1. Time to first token of a streamed chat whose ~1000-token system prompt a previous request
   already sent (warm) against one nobody sent (cold), on the default model (SmolLM2-135M,
   float32) and on random-weight hybrid models (qwen3_next: ArraysCache + KVCache layers):
   the tests' tiny one and a small one (~100 M parameters, mostly its vocabulary). Each
   round uses a new system prompt; the warm request asks another question.
2. Four streams are generating when a ~2000-token prompt arrives: the gaps between their
   tokens until the new request's first token, with Orchard's chunked prefill (the default),
   without it (one chunk per step up to the 2048-token budget), and on mlx_lm.server.

Both servers run here as subprocesses (daphne with config.asgi, as `make serve` does; and
`python -m mlx_lm server`), serve one model at a time, and are measured with the same client
code (httpx, greedy). Results go in bench/RESULTS.md.
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
import itertools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402

import httpx  # noqa: E402

from bench.api import MODEL_DIR  # noqa: E402
from bench.results import (  # noqa: E402
    load_average,
    run_header,
    write_results,
)
from engine.kernels.blas import find_blas  # noqa: E402
from tests.fixtures.daphne import free_port, start_daphne, stop_daphne  # noqa: E402

WORDS = (
    "orchard apple pear plum cherry blossom branch root soil rain sun harvest basket ladder "
    "graft prune season spring summer autumn winter frost bee honey leaf bark seed tree row"
).split()


def words(count: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


class Server:
    """One model behind one server; `chat` streams and records when each text chunk arrives."""

    def __init__(self, name: str, base_url: str, model: str, key: str | None):
        self.name, self.base_url, self.model = name, base_url, model
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}

    async def chat(
        self,
        client: httpx.AsyncClient,
        messages: list[dict],
        max_tokens: int,
        arrivals: list[float] | None = None,
    ) -> list[float]:
        """perf_counter() at each streamed chunk (appended to `arrivals` if given): the
        first entry is the time the request was sent, the second the first token's (a chunk
        may carry no text: a reply can end at once)."""
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
        }
        arrivals = [] if arrivals is None else arrivals
        arrivals.append(time.perf_counter())
        async with client.stream(
            "POST", f"{self.base_url}/v1/chat/completions", json=body, headers=self.headers
        ) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                if json.loads(line[6:]).get("choices"):
                    arrivals.append(time.perf_counter())
        return arrivals


async def ttft(server: Server, rounds: int, prefix_words: int) -> dict[str, float]:
    cold, warm = [], []
    rng = random.Random(7)
    async with httpx.AsyncClient(timeout=600) as client:
        await server.chat(client, [{"role": "user", "content": "Warm up."}], 4)
        for _ in range(rounds):
            system = f"{uuid.uuid4().hex} " + words(prefix_words, rng)
            ask = [{"role": "system", "content": system}]
            first = await server.chat(client, [*ask, {"role": "user", "content": "Q1?"}], 4)
            second = await server.chat(client, [*ask, {"role": "user", "content": "Q2?"}], 4)
            cold.append(first[1] - first[0])
            warm.append(second[1] - second[0])
    cold_s, warm_s = statistics.median(cold), statistics.median(warm)
    return {"cold": cold_s, "warm": warm_s, "ratio": cold_s / warm_s}


async def admission(server: Server, prompt_words: int) -> dict[str, float]:
    """Gaps between the tokens of 4 running streams while a long prompt is admitted."""
    rng = random.Random(11)
    streams: list[list[float]] = [[] for _ in range(4)]
    async with httpx.AsyncClient(timeout=900) as client:
        tasks = [
            asyncio.create_task(
                server.chat(
                    client,
                    [{"role": "user", "content": f"{i}: tell a long story about trees."}],
                    2000,
                    streams[i],
                )
            )
            for i in range(4)
        ]
        await asyncio.sleep(4.0)  # all four are generating
        long = [{"role": "user", "content": f"{uuid.uuid4().hex} " + words(prompt_words, rng)}]
        sent, first = (await server.chat(client, long, 8))[:2]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    gaps = []
    for times in streams:
        inside = [t for t in times[1:] if sent <= t <= first]
        before = [t for t in times[1:] if t < sent]
        after = [t for t in times[1:] if t > first]
        points = before[-1:] + inside + after[:1]
        gaps += [b - a for a, b in itertools.pairwise(points)]
    gaps.sort()
    if not gaps:  # no running token arrived while the prompt was admitted
        gaps = [first - sent]
    p99 = gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))]
    return {
        "admitted_s": first - sent,
        "median": statistics.median(gaps),
        "p99": p99,
        "max": gaps[-1],
        "gaps": len(gaps),
    }


# The tests' tiny hybrid (hidden 64, 2 layers) prefills 1000 tokens in ~70 ms, so its time to
# first token is mostly each server's fixed per-request cost; this one is small enough to run
# here and large enough for the prefill to count (most of its ~100 M parameters are the
# 151k-token vocabulary).
SMALL_HYBRID = {
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "intermediate_size": 1536,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "linear_num_value_heads": 8,
    "linear_num_key_heads": 4,
    "linear_key_head_dim": 64,
    "linear_value_head_dim": 64,
}


def hybrid_model(overrides: dict | None = None) -> Path:
    from tests.fixtures.tiny_models import build_tiny_model

    return build_tiny_model(model_type="qwen3_next", tokenizer="qwen3", overrides=overrides)


def orchard_home(home: Path, models: dict[str, tuple[Path, dict]]) -> str:
    """Migrate a fresh database under `home`, register `models`; return an API key."""
    os.environ.update({"ORCHARD_HOME": str(home), "DJANGO_SETTINGS_MODULE": "config.settings"})
    os.environ.pop("DATABASE_URL", None)
    import django

    django.setup()
    from django.core.management import call_command

    from accounts.services import api_key_create, team_membership_ensure, user_get_or_create
    from inference.models import ModelEntry
    from inference.services.registry import model_register

    call_command("migrate", verbosity=0, interactive=False)
    for name, (path, fields) in models.items():
        model_register(name=name, path=path)
        ModelEntry.objects.filter(name=name).update(**fields)
    user = user_get_or_create(username="bench")
    team, _ = team_membership_ensure(user=user, team_name="bench")
    return api_key_create(user=user, team=team, name="bench")[1]


def start_mlx_lm(path: Path, port: int, log: Path) -> subprocess.Popen:
    # The same fast BLAS Orchard loads (engine/kernels/blas.py), or the comparison is with MLX's
    # reference BLAS, ~50x slower.
    env = dict(os.environ)
    blas = find_blas()
    if blas:
        env["LD_PRELOAD"] = blas
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "mlx_lm", "server", "--model", str(path), "--port", str(port)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1)
            return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"mlx_lm.server did not start:\n{log.read_text()}")


def run(args) -> dict:
    default_path = MODEL_DIR
    if not (default_path / "config.json").exists():
        from engine.models.gguf import convert_gguf, default_gguf_path

        convert_gguf(default_gguf_path(), default_path, dtype="float32")
    hybrid_path = hybrid_model()
    small_path = hybrid_model(SMALL_HYBRID)
    home = Path(tempfile.mkdtemp(prefix="orchard-bench-prefix-"))
    results: dict = {}
    processes = []
    try:
        key = orchard_home(
            home,
            {
                "smollm2": (default_path, {}),
                "smollm2-unchunked": (default_path, {"prefill_chunk_tokens": 2048}),
                "tiny-hybrid": (hybrid_path, {}),
                "small-hybrid": (small_path, {}),
            },
        )
        port = free_port()
        daphne = start_daphne(port=port, env=dict(os.environ), log_path=home / "daphne.log")
        processes.append(daphne)
        orchard = f"http://127.0.0.1:{port}"
        for label, model, path in (
            ("default model", "smollm2", default_path),
            ("tiny hybrid", "tiny-hybrid", hybrid_path),
            ("small hybrid", "small-hybrid", small_path),
        ):
            mlx_port = free_port()
            mlx = start_mlx_lm(path, mlx_port, home / f"mlx-{model}.log")
            try:
                for server in (
                    Server("Orchard", orchard, model, key),
                    Server("mlx_lm.server", f"http://127.0.0.1:{mlx_port}", "default_model", None),
                ):
                    row = asyncio.run(ttft(server, args.repeat, args.prefix_words))
                    print(f"TTFT {label} {server.name}: {row}", flush=True)
                    results[("ttft", label, server.name)] = row
                if model == "smollm2":
                    for name, server in (
                        ("Orchard, chunked prefill", Server("Orchard", orchard, model, key)),
                        (
                            "Orchard, no chunking",
                            Server("Orchard", orchard, "smollm2-unchunked", key),
                        ),
                        (
                            "mlx_lm.server",
                            Server(
                                "mlx_lm.server",
                                f"http://127.0.0.1:{mlx_port}",
                                "default_model",
                                None,
                            ),
                        ),
                    ):
                        row = asyncio.run(admission(server, args.long_words))
                        print(f"admission {name}: {row}", flush=True)
                        results[("admission", name)] = row
            finally:
                mlx.terminate()
                mlx.wait(30)
    finally:
        for process in processes:
            stop_daphne(process)
        shutil.rmtree(home, ignore_errors=True)
    return results


def report(args, results: dict, load: tuple[str, str]) -> str:
    lines = [
        *run_header(
            "prefix.py",
            f", mlx[cpu] with OpenBLAS. Load average before: {load[0]}; after: {load[1]}. Both "
            "servers run on this machine, one model each at a time; greedy; medians of "
            f"{args.repeat} rounds.",
        ),
        "",
        f"## Time to first token, ~{args.prefix_words}-word system prompt (≈1000 tokens)",
        "",
        "| model | server | cold (s) | warm (s) | cold / warm |",
        "|---|---|---:|---:|---:|",
    ]
    for label in ("default model", "tiny hybrid", "small hybrid"):
        for name in ("Orchard", "mlx_lm.server"):
            row = results[("ttft", label, name)]
            lines.append(
                f"| {label} | {name} | {row['cold']:.3f} | {row['warm']:.3f} | "
                f"{row['ratio']:.1f}x |"
            )
    lines += [
        "",
        f"## Four running streams while a {args.long_words}-word prompt (≈2000 tokens) is "
        "admitted (default model)",
        "",
        "| server | prompt's first token after (s) | median gap (s) | p99 gap (s) | longest "
        "gap (s) | gaps |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name in ("Orchard, chunked prefill", "Orchard, no chunking", "mlx_lm.server"):
        row = results[("admission", name)]
        lines.append(
            f"| {name} | {row['admitted_s']:.1f} | {row['median']:.3f} | {row['p99']:.3f} | "
            f"{row['max']:.3f} | {row['gaps']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--prefix-words", type=int, default=750)
    parser.add_argument("--long-words", type=int, default=1500)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    before = load_average()
    results = run(args)
    block = report(args, results, (before, load_average()))
    print("\n" + block)
    if not args.no_write:
        write_results("prefix.py", "Prefix cache and chunked prefill", block)


if __name__ == "__main__":
    main()
