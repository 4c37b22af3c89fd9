"""The server's own overhead: streamed tokens/s through HTTP against the engine alone, and
/v1/models requests/s (authentication and limits only).

    .venv/bin/python bench/api.py [--max-tokens 64] [--requests-per-client 2] [--repeat 1]

One self-contained run: a throwaway ORCHARD_HOME with a migrated SQLite database, the default model
(SmolLM2-135M converted to float32 once, reused from var/cache/test-models), an unlimited and a
limited API key, and daphne serving config.asgi on a free port (as `make serve` does). Then, at each
concurrency, the engine alone (LocalEngineClient in this process, while the server is idle)
alternates with the same requests through HTTP (the official `openai` client, stream=True, tokens
counted from `usage`), each side keeping its best of `--repeat`. Results go in bench/RESULTS.md.
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
import logging  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from dataclasses import dataclass  # noqa: E402

from bench.results import load_average, run_header, write_results  # noqa: E402
from tests.fixtures.daphne import free_port, start_daphne, stop_daphne  # noqa: E402

MODEL = "smollm2"
MODEL_DIR = ROOT / "var" / "cache" / "test-models" / "smollm2-135m-f32"
CONCURRENCY = (1, 8, 16)
TARGET_RATIO = 0.9
# A limit that never refuses but still takes the limiter's full path (rpm and tpm logs,
# parallel lease, budget seeded from the database).
HIGH_LIMITS = {"rpm": 10**7, "tpm": 10**12, "max_parallel": 10**4, "budget_tokens": 10**15}


@dataclass
class Run:
    tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def wait_for_quiet(max_load: float, max_wait_s: float) -> None:
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        print(f"load {load_average()} > {max_load}; waiting 30 s", flush=True)
        time.sleep(30)


def setup_home(home: Path) -> tuple[str, str]:
    """Migrate a fresh database under `home`, register the model; return (unlimited, limited)."""
    os.environ.update({"ORCHARD_HOME": str(home), "DJANGO_SETTINGS_MODULE": "config.settings"})
    os.environ.pop("DATABASE_URL", None)
    import django

    django.setup()
    from django.core.management import call_command

    from accounts.services import api_key_create, team_membership_ensure, user_get_or_create
    from inference.services.registry import model_register

    # Django's LOGGING puts the root logger at INFO: httpx would log every request here.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    call_command("migrate", verbosity=0, interactive=False)
    if not (MODEL_DIR / "config.json").exists():
        from engine.models.gguf import convert_gguf, default_gguf_path

        convert_gguf(default_gguf_path(), MODEL_DIR, dtype="float32")
    model_register(name=MODEL, path=MODEL_DIR, make_default=True)
    user = user_get_or_create(username="bench")
    team, _ = team_membership_ensure(user=user, team_name="bench")
    _, unlimited = api_key_create(user=user, team=team, name="unlimited")
    _, limited = api_key_create(user=user, team=team, name="limited", **HIGH_LIMITS)
    return unlimited, limited


def messages(tag: str, index: int) -> list[dict[str, str]]:
    # Unique per request, so no run is helped by the other's (or its own) prefix cache.
    return [
        {
            "role": "user",
            "content": f"Story {tag}-{index}: tell a long story about the apples in an orchard.",
        }
    ]


async def bounded(concurrency: int, per_client: int, one) -> Run:
    """`concurrency` clients, each sending `per_client` requests one after another."""

    async def client(c: int) -> int:
        return sum([await one(c * per_client + i) for i in range(per_client)])

    start = time.perf_counter()
    counts = await asyncio.gather(*(client(c) for c in range(concurrency)))
    return Run(sum(counts), time.perf_counter() - start)


async def engine_run(client, concurrency: int, per_client: int, max_tokens: int) -> Run:
    from engine.protocol import GenerationRequest, PromptInput, SamplingParams

    tag = uuid.uuid4().hex[:8]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [
        (await client.render_prompt(MODEL, PromptInput(messages=tuple(messages(tag, i))))).token_ids
        for i in range(concurrency * per_client)
    ]

    async def one(i: int) -> int:
        request = GenerationRequest(f"bench-{tag}-{i}", MODEL, tuple(prompts[i]), params)
        return sum([len(out.token_ids) async for out in client.generate(request)])

    return await bounded(concurrency, per_client, one)


async def http_run(client, concurrency: int, per_client: int, max_tokens: int) -> Run:
    tag = uuid.uuid4().hex[:8]

    async def one(i: int) -> int:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages(tag, i),
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
        assert usage is not None and usage.completion_tokens == max_tokens, usage
        return usage.completion_tokens

    return await bounded(concurrency, per_client, one)


async def models_run(base_url: str, key: str, concurrency: int, total: int) -> Run:
    import httpx

    headers = {"Authorization": f"Bearer {key}"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits) as http:

        async def one(_: int) -> int:
            response = await http.get("/v1/models")
            assert response.status_code == 200, response.text
            return 1

        return await bounded(concurrency, total // concurrency, one)


def wrk_models(base_url: str, key: str, concurrency: int, seconds: int) -> float | None:
    if shutil.which("wrk") is None:
        return None
    result = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{concurrency}",
            f"-d{seconds}s",
            "-H",
            f"Authorization: Bearer {key}",
            f"{base_url}/v1/models",
        ],
        capture_output=True,
        text=True,
        timeout=seconds + 30,
        check=True,
    )
    if "Non-2xx" in result.stdout:
        raise RuntimeError(f"wrk saw errors:\n{result.stdout}")
    return float(re.search(r"Requests/sec:\s+([\d.]+)", result.stdout).group(1))


async def measure(args, base_url: str, unlimited: str, limited: str) -> dict:
    import httpx
    import openai

    from engine.local import LocalEngineClient
    from inference.models import ModelEntry
    from inference.services.registry import model_spec

    entry = await ModelEntry.objects.aget(name=MODEL)
    engine_client = LocalEngineClient()
    await engine_client.ensure_model(model_spec(entry))
    api = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1",
        api_key=limited,
        max_retries=0,
        timeout=600,
        http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=64), timeout=600),
    )
    # Warm both: the server loads its model on the first request.
    await http_run(api, 1, 1, 8)
    await engine_run(engine_client, 1, 1, 8)
    best: dict[tuple[str, int], Run] = {}
    for round_ in range(args.repeat):
        for concurrency in CONCURRENCY:
            for side, fn, client in (
                ("engine", engine_run, engine_client),
                ("http", http_run, api),
            ):
                run = await fn(client, concurrency, args.requests_per_client, args.max_tokens)
                print(
                    f"round {round_ + 1} c={concurrency:>2} {side:>6}: {run.tokens} tokens in "
                    f"{run.seconds:.1f} s = {run.tokens_per_s:.1f} tokens/s",
                    flush=True,
                )
                key = (side, concurrency)
                if key not in best or run.tokens_per_s > best[key].tokens_per_s:
                    best[key] = run
    await engine_client.shutdown()
    await api.close()
    models = {}
    for name, key in (("unlimited", unlimited), ("limited", limited)):
        await models_run(base_url, key, 4, 40)
        run = await models_run(base_url, key, args.models_concurrency, args.models_requests)
        print(f"/v1/models {name} (httpx): {run.tokens_per_s:.0f} requests/s", flush=True)
        models[(name, "httpx")] = run.tokens_per_s
        rate = wrk_models(base_url, key, args.models_concurrency, args.wrk_seconds)
        if rate is not None:
            print(f"/v1/models {name} (wrk): {rate:.0f} requests/s", flush=True)
        models[(name, "wrk")] = rate
    return {"streams": best, "models": models}


def table(args, results: dict) -> str:
    lines = [
        "| concurrency | engine alone (tokens/s) | through HTTP (tokens/s) | HTTP / engine |",
        "|------------:|------------------------:|------------------------:|--------------:|",
    ]
    for concurrency in CONCURRENCY:
        eng, http = (
            results["streams"][("engine", concurrency)],
            results["streams"][("http", concurrency)],
        )
        ratio = http.tokens_per_s / eng.tokens_per_s
        mark = "" if ratio >= TARGET_RATIO else " (below the 90% target)"
        lines.append(
            f"| {concurrency} | {eng.tokens_per_s:.1f} | {http.tokens_per_s:.1f} | "
            f"{ratio:.1%}{mark} |"
        )
    lines += [
        "",
        f"| /v1/models, {args.models_concurrency} concurrent clients | requests/s "
        f"(httpx, {args.models_requests} requests) | requests/s (wrk, {args.wrk_seconds} s) |",
        "|---|---:|---:|",
    ]
    for name in ("unlimited", "limited"):
        wrk = results["models"][(name, "wrk")]
        lines.append(
            f"| {name} key | {results['models'][(name, 'httpx')]:.0f} | "
            f"{'n/a (wrk not installed)' if wrk is None else f'{wrk:.0f}'} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--models-requests", type=int, default=2000)
    parser.add_argument("--models-concurrency", type=int, default=16)
    parser.add_argument("--wrk-seconds", type=int, default=10)
    parser.add_argument("--max-load", type=float, default=1.0)
    parser.add_argument("--max-wait", type=float, default=600, help="seconds to wait for quiet")
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()

    wait_for_quiet(args.max_load, args.max_wait)
    load_before = load_average()
    print(f"load before: {load_before}", flush=True)
    home = Path(tempfile.mkdtemp(prefix="orchard-bench-api-"))
    server = None
    try:
        unlimited, limited = setup_home(home)
        port = free_port()
        server = start_daphne(port=port, env=dict(os.environ), log_path=home / "server.log")
        print(f"daphne pid {server.pid} on port {port}", flush=True)
        results = asyncio.run(measure(args, f"http://127.0.0.1:{port}", unlimited, limited))
    finally:
        if server is not None:
            stop_daphne(server)
        shutil.rmtree(home, ignore_errors=True)
    load_after = load_average()
    block = "\n".join(
        [
            *run_header(
                "api.py",
                ", shared by the engine alone, daphne and the benchmark's own clients. Load "
                f"average (1, 5, 15 min) before: {load_before}; after: {load_after}.",
                note=" (= `make bench-api`)",
            ),
            "",
            f"SmolLM2-135M float32, greedy, EOS ignored, {args.max_tokens} tokens per request; "
            f"each of `concurrency` clients sends {args.requests_per_client} requests one after "
            f"another; best of {args.repeat}. HTTP: official `openai` AsyncOpenAI, stream=True, "
            "tokens from `usage` (include_usage), limited key (rpm/tpm/parallel/budget set high, "
            "never refusing). Engine alone: LocalEngineClient in the benchmark process, daphne "
            "idle.",
            "",
            table(args, results),
        ]
    )
    print("\n" + block)
    if not args.no_write:
        write_results("api.py", "API overhead", block)


if __name__ == "__main__":
    main()
