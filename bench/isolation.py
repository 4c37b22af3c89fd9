"""What one team's abuse does to another team's latency, on one server.

    .venv/bin/python bench/isolation.py [--seconds 20] [--abuses bodies,enums,...]

One self-contained run: a throwaway ORCHARD_HOME with a migrated SQLite database, the default
chat model (SmolLM2-135M float32, as bench/api.py uses) and the default embedding model, keys of
two teams, and daphne serving config.asgi on a free port (as `make serve` does, engine inside;
with `--layout remote`, the engines in one `manage.py runengine` worker over Redis, as
docs/deploying.md describes for more than one machine).

Team B probes the whole time, one request after another on each of two connections: `GET
/v1/models` (its latency) and a streamed chat completion of 4 tokens (its time to first token;
the chats' usage rows say how much of it was the engine's, from the request's submission to it).
First alone (the baseline), then while team A runs each abuse in a loop, one abuse at a time, from
processes of its own. A's client stands for other machines: on this one it shares the cores
with the server, so it runs in Linux's idle scheduling class (measured here, two busy processes
at nice 19 made B's first token 3.3x slower, since MLX's CPU kernels wait for their every thread,
and two of the idle class 1.3x); `--abusers normal` runs it like any process:

- bodies: 8 MiB bodies to /v1/chat/completions (413s) on 8 connections;
- enums: a `json_schema` whose enum has 250,000 entries (a 3 MiB body, refused past the grammar
  budget) on 8 connections;
- renders: 64 concurrent chat requests of ~1M characters each (rendered and tokenized, then
  refused for their length);
- embeddings: 16 concurrent /v1/embeddings requests of 256 texts each;
- 429s: a key limited to 1 request a minute, 32 connections hammering it.

Pass: for each abuse, B's p99 for /v1/models and for time to first token stay within 2x of the
baseline's, and none of B's requests fail. Also: a chain of 20 stored responses grows storage
linearly (bytes per step, first half against second half). Results go in bench/RESULTS.md.
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
import json  # noqa: E402
import multiprocessing  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

sys.path.append(str(ROOT / "bench"))  # after `engine`: bench/engine.py would shadow it

from api import MODEL, load_average, setup_home, wait_for_quiet  # noqa: E402
from workers import Layout  # noqa: E402

from bench.results import run_header, write_results  # noqa: E402

TARGET = 2.0
ABUSES = ("bodies", "enums", "renders", "embeddings", "429s")
EMBEDDING_MODEL = "all-minilm-l6-v2"
WARM_SECONDS = 10


def p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


@dataclass
class Probe:
    models_ms: list[float] = field(default_factory=list)
    ttft_ms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    # The chats' usage rows: time to first token from the request's submission to the engine.
    engine_ttft_ms: list[float] = field(default_factory=list)
    ttft_at: list[float] = field(default_factory=list)  # seconds into the phase, per ttft_ms
    models_at: list[float] = field(default_factory=list)  # the same, per models_ms
    began_wall: float = 0.0

    def slowest(self) -> str:
        """The five slowest first tokens (ms @ seconds into the phase), the engine's, and the
        five slowest /v1/models answers."""
        chats = sorted(zip(self.ttft_ms, self.ttft_at, strict=True), reverse=True)[:5]
        engines = sorted(self.engine_ttft_ms, reverse=True)[:5]
        models = sorted(zip(self.models_ms, self.models_at, strict=True), reverse=True)[:5]
        return (
            f"(phase began {self.began_wall:.2f}) slowest TTFT "
            + ", ".join(f"{ms:.0f}@{at:.1f}s" for ms, at in chats)
            + ("; the engine's " + ", ".join(f"{ms:.0f}" for ms in engines))
            + "; slowest /v1/models "
            + ", ".join(f"{ms:.0f}@{at:.1f}s" for ms, at in models)
        )

    def row(self) -> tuple[float, float, float, float]:
        return (
            statistics.median(self.models_ms),
            p99(self.models_ms),
            statistics.median(self.ttft_ms),
            p99(self.ttft_ms),
        )


def measure(base_url: str, key: str, seconds: float) -> Probe:
    """`probe`, with the engine's side of each chat's first token from its usage row."""
    from django.utils import timezone

    from inference.models import UsageRecord

    since = timezone.now()
    result = asyncio.run(probe(base_url, key, seconds))
    rows = UsageRecord.objects.filter(
        team__name="team-b", started_at__gte=since, time_to_first_token_ms__isnull=False
    )
    deadline = time.monotonic() + 10
    while rows.count() < len(result.ttft_ms) and time.monotonic() < deadline:
        time.sleep(0.1)  # the server finishes a row right after the stream's last chunk
    result.engine_ttft_ms = [
        float(ms) for ms in rows.values_list("time_to_first_token_ms", flat=True)
    ]
    return result


async def probe(base_url: str, key: str, seconds: float) -> Probe:
    """Team B: /v1/models and a streamed chat, one request after another on each, for
    `seconds`."""
    import httpx

    result = Probe()
    result.began_wall = time.time()
    began = time.monotonic()
    deadline = began + seconds
    headers = {"Authorization": f"Bearer {key}"}

    async def models(http: httpx.AsyncClient) -> None:
        while time.monotonic() < deadline:
            start = time.perf_counter()
            response = await http.get("/v1/models")
            if response.status_code != 200:
                result.failures.append(f"models {response.status_code}: {response.text[:200]}")
            result.models_ms.append((time.perf_counter() - start) * 1000)
            result.models_at.append(time.monotonic() - began)
            await asyncio.sleep(0.02)

    async def chat(http: httpx.AsyncClient) -> None:
        index = 0
        while time.monotonic() < deadline:
            index += 1
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Probe {index}: name a fruit."}],
                "max_tokens": 4,
                "temperature": 0,
                "stream": True,
            }
            start = time.perf_counter()
            first = None
            async with http.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    result.failures.append(f"chat {response.status_code}: {response.text[:200]}")
                    continue
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                            first = time.perf_counter()
            if first is None:
                result.failures.append("chat: no content")
            else:
                result.ttft_ms.append((first - start) * 1000)
                result.ttft_at.append(time.monotonic() - began)
            await asyncio.sleep(0.02)

    async with (
        httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as one,
        httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60) as two,
    ):
        await asyncio.gather(models(one), chat(two))
    return result


def huge_enum_body() -> bytes:
    schema = {
        "type": "object",
        "properties": {"pick": {"enum": [f"v{i}" for i in range(250_000)]}},
        "required": ["pick"],
    }
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Pick one."}],
            "max_tokens": 8,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "pick", "schema": schema},
            },
        }
    ).encode()


def long_render_body(index: int) -> bytes:
    text = f"{index} " + "apples and pears grow in the orchard " * 27_000  # ~1M characters
    return json.dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}
    ).encode()


def embeddings_body(index: int) -> bytes:
    texts = [f"{index}-{i} the orchard's apples and pears, " * 12 for i in range(256)]
    return json.dumps({"model": EMBEDDING_MODEL, "input": texts}).encode()


async def abuse(base_url: str, key: str, kind: str, stop_at: float) -> dict[str, int]:
    """Team A: `kind` in a loop on its connections until `stop_at`; statuses counted."""
    import httpx

    statuses: dict[str, int] = {}
    connections = {"bodies": 8, "enums": 8, "renders": 64, "embeddings": 16, "429s": 32}[kind]
    path = "/v1/embeddings" if kind == "embeddings" else "/v1/chat/completions"
    enum = huge_enum_body() if kind == "enums" else b""
    small = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}).encode()

    def body(index: int) -> bytes:
        if kind == "bodies":
            return b'{"model": "' + MODEL.encode() + b'", "pad": "' + b"x" * (8 << 20) + b'"}'
        if kind == "enums":
            return enum
        if kind == "renders":
            return long_render_body(index)
        if kind == "embeddings":
            return embeddings_body(index)
        return small

    async def connection(c: int) -> None:
        index = c
        async with httpx.AsyncClient(
            base_url=base_url,
            headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            timeout=120,
        ) as http:
            while time.monotonic() < stop_at:
                index += connections
                try:
                    response = await http.post(path, content=body(index))
                    answer = str(response.status_code)
                except httpx.HTTPError as exc:  # e.g. the server closed a refused upload
                    answer = type(exc).__name__
                statuses[answer] = statuses.get(answer, 0) + 1

    await asyncio.gather(*(connection(c) for c in range(connections)))
    return statuses


def abuser_process(
    base_url: str, key: str, kind: str, stop_at_wall: float, out, idle: bool
) -> None:
    if idle:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    stop_at = time.monotonic() + (stop_at_wall - time.time())
    out.send(asyncio.run(abuse(base_url, key, kind, stop_at)))


def chain_growth(base_url: str, key: str, steps: int = 20) -> list[int]:
    """Stored bytes of the team after each step of a chain of `steps` responses."""
    import httpx

    from inference.models import TeamResponseStorage

    sizes = []
    previous = None
    with httpx.Client(
        base_url=base_url, headers={"Authorization": f"Bearer {key}"}, timeout=120
    ) as http:
        for step in range(steps):
            body = {
                "model": MODEL,
                "input": f"Step {step}: say one word about apples.",
                "max_output_tokens": 8,
                "temperature": 0,
            }
            if previous:
                body["previous_response_id"] = previous
            response = http.post("/v1/responses", json=body)
            assert response.status_code == 200, response.text
            previous = response.json()["id"]
            stored = TeamResponseStorage.objects.filter(team__name="team-b").first()
            sizes.append(stored.num_bytes if stored else 0)
    return sizes


def setup_teams(home: Path) -> dict[str, str]:
    unlimited, _ = setup_home(home)  # Django is set up from here on

    from accounts.services import api_key_create, team_membership_ensure, user_get_or_create
    from engine import default_embedding_folder
    from inference.models import ModelEntry
    from inference.services.registry import model_register

    folder = default_embedding_folder(home / "models")
    model_register(name=EMBEDDING_MODEL, path=folder, kind=ModelEntry.Kind.EMBEDDING)
    keys = {"a": unlimited}
    for name in ("team-a", "team-b"):
        user = user_get_or_create(username=name)
        team, _ = team_membership_ensure(user=user, team_name=name)
        _, keys[name] = api_key_create(user=user, team=team, name="bench")
        if name == "team-a":
            _, keys["team-a-limited"] = api_key_create(user=user, team=team, name="rpm1", rpm=1)
    return keys


def run_abuse(
    base_url: str, keys: dict[str, str], kind: str, seconds: float, *, idle: bool
) -> tuple:
    key = keys["team-a-limited" if kind == "429s" else "team-a"]
    context = multiprocessing.get_context("spawn")
    stop_at = time.time() + seconds + 3
    receive, send = context.Pipe(duplex=False)
    process = context.Process(
        target=abuser_process, args=(base_url, key, kind, stop_at, send, idle)
    )
    process.start()
    time.sleep(3)  # the abuse under way before B measures
    measured = measure(base_url, keys["team-b"], seconds)
    statuses = receive.recv() if receive.poll(180) else {}
    process.join(30)
    return measured, statuses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--abuses", default=",".join(ABUSES))
    parser.add_argument("--max-load", type=float, default=1.0)
    parser.add_argument("--max-wait", type=float, default=300, help="seconds to wait for quiet")
    parser.add_argument(
        "--layout",
        choices=("local", "remote"),
        default="local",
        help="engine inside daphne (make serve's) or in a runengine worker over Redis",
    )
    parser.add_argument(
        "--abusers",
        choices=("idle", "normal"),
        default="idle" if hasattr(os, "SCHED_IDLE") else "normal",
        help="team A's client processes: Linux's idle scheduling class (they stand for other "
        "machines) or a normal process's",
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args()
    kinds = [kind for kind in args.abuses.split(",") if kind]
    unknown = set(kinds) - set(ABUSES)
    if unknown:
        parser.error(f"unknown abuses: {sorted(unknown)}; choose from {ABUSES}")

    wait_for_quiet(args.max_load, args.max_wait)
    load_before = load_average()
    home = Path(tempfile.mkdtemp(prefix="orchard-bench-isolation-"))
    server = None
    try:
        keys = setup_teams(home)
        server = Layout(args.layout, home, dict(os.environ), remote=args.layout == "remote")
        server.start()
        base_url = server.url
        # Warm: the models load, then B's first chats settle (their first few, ~2 s, take
        # 2-4x a settled one's first token: a baseline with them in its p99 flatters every
        # TTFT ratio).
        asyncio.run(probe(base_url, keys["team-b"], WARM_SECONDS))
        baseline = measure(base_url, keys["team-b"], args.seconds)
        print(f"alone: {baseline.row()} {baseline.slowest()}", flush=True)
        rows = []
        for kind in kinds:
            measured, statuses = run_abuse(
                base_url, keys, kind, args.seconds, idle=args.abusers == "idle"
            )
            print(
                f"{kind}: {measured.row()} failures={measured.failures[:3]} A={statuses} "
                f"{measured.slowest()}",
                flush=True,
            )
            rows.append((kind, measured, statuses))
        sizes = chain_growth(base_url, keys["team-b"])
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(home, ignore_errors=True)
    block = report(args, load_before, baseline, rows, sizes)
    print(block)
    if not args.no_write:
        write_results("isolation.py", "One team's abuse against another's latency", block)


def report(args, load_before: str, baseline: Probe, rows: list, sizes: list[int]) -> str:
    where = (
        "one daphne, engine inside"
        if args.layout == "local"
        else "one daphne and one runengine worker (Redis)"
    )
    clients = (
        "team A's clients in the idle scheduling class"
        if args.abusers == "idle"
        else "team A's clients as normal processes"
    )
    lines = run_header("isolation.py", f", load before {load_before}; {where}, SQLite; {clients}")
    base = baseline.row()
    lines += [
        "",
        f"Team B alone, then while team A runs one abuse at a time, {args.seconds:.0f} s each "
        "(median / p99 in ms; the ratio is p99 against alone's p99, target at most "
        f"{TARGET:.0f}x):",
        "",
        "| team A runs | /v1/models median | p99 | ratio | chat TTFT median | p99 | ratio | "
        "of it the engine's, median | B's requests | B's failures | A's answers |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| nothing | {base[0]:.1f} | {base[1]:.1f} | 1.0 | {base[2]:.1f} | {base[3]:.1f} | "
        f"1.0 | {_median(baseline.engine_ttft_ms)} | "
        f"{len(baseline.models_ms) + len(baseline.ttft_ms)} | {len(baseline.failures)} | |",
    ]
    verdicts = []
    for kind, measured, statuses in rows:
        row = measured.row()
        models_ratio, ttft_ratio = row[1] / base[1], row[3] / base[3]
        ok = models_ratio <= TARGET and ttft_ratio <= TARGET and not measured.failures
        verdicts.append(ok)
        answers = ", ".join(f"{count}× {status}" for status, count in sorted(statuses.items()))
        lines.append(
            f"| {kind} | {row[0]:.1f} | {row[1]:.1f} | {models_ratio:.2f} | {row[2]:.1f} | "
            f"{row[3]:.1f} | {ttft_ratio:.2f} | {_median(measured.engine_ttft_ms)} | "
            f"{len(measured.models_ms) + len(measured.ttft_ms)}"
            f" | {len(measured.failures)} | {answers} |"
        )
    half = len(sizes) // 2
    first = (sizes[half - 1] - sizes[0]) / max(half - 1, 1)
    second = (sizes[-1] - sizes[half]) / max(len(sizes) - half - 1, 1)
    lines += [
        "",
        f"A chain of {len(sizes)} stored responses: {sizes[-1]:,} bytes in all; per step "
        f"{first:,.0f} bytes in the first half and {second:,.0f} in the second "
        f"({'linear' if second <= 1.5 * first else 'NOT linear'}).",
        "",
        f"Verdict: {'pass' if all(verdicts) else 'FAIL'} "
        f"({sum(verdicts)} of {len(verdicts)} abuses within {TARGET:.0f}x, no failures).",
    ]
    return "\n".join(lines)


def _median(values: list[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "–"


if __name__ == "__main__":
    main()
