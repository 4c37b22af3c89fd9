"""Models in one memory budget (engine/cache/host.py, engine/residency.py): load and switch times.

    .venv/bin/python bench/models.py [--rounds 4] [--no-write]

Three models (the default model, SmolLM2-135M float32, registered three times under different
names, each loaded from its files) in an EngineWorker whose memory budget holds two of them
(weights and a 256 MiB caches' budget each). `pinned` is pinned; `one` and `two` take turns in
the other place. A request (a 32-token prompt, 8 greedy tokens) goes to each model in rotation,
`--rounds` times, one at a time, as a client that names a model would send them:

- the time to first token of a request whose model is loaded (warm), of the first request of
  a model (cold: the load, then the request) and of a request that first unloads the least
  recently used idle model to load its own (a switch);
- failures (target 0), the pinned model unloaded (target never);
- the memory the models hold in the budget and MLX's active memory, sampled every 5 ms
  throughout (targets: never over the budget);
- with an idle time of 2 s on `two`, that it unloads once idle (and `pinned` does not).

Results go in bench/RESULTS.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import engine  # noqa: E402, F401  (OpenBLAS before anything imports mlx)

# isort: split
import argparse  # noqa: E402
import statistics  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402

import mlx.core as mx  # noqa: E402

from bench.results import load_average, run_header, write_results  # noqa: E402
from engine.cache.host import HostMemory, files_bytes  # noqa: E402
from engine.protocol import GenerationRequest, ModelSpec, SamplingParams  # noqa: E402
from engine.worker import EngineWorker  # noqa: E402

MODEL_DIR = ROOT / "var" / "cache" / "test-models" / "smollm2-135m-f32"
CACHE = 256 << 20
MIB = 1 << 20
NAMES = ("pinned", "one", "two")
IDLE_S = 2.0


def model_dir() -> Path:
    if not (MODEL_DIR / "config.json").exists():
        from engine.models.gguf import convert_gguf, default_gguf_path

        convert_gguf(default_gguf_path(), MODEL_DIR, dtype="float32")
    return MODEL_DIR


class Sampler:
    """The budget's bytes held and MLX's active memory, every 5 ms, on a thread."""

    def __init__(self, memory: HostMemory):
        self.memory = memory
        self.held = self.active = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.held = max(self.held, self.memory.used())
            self.active = max(self.active, mx.get_active_memory())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def ask(worker: EngineWorker, spec: ModelSpec, index: int) -> tuple[float, str | None]:
    """One request to `spec`'s model as the API sends it (look the model up, loading it if
    need be, then submit): its time to first token, and its error if it failed."""
    started = time.perf_counter()
    first = threading.Event()
    done = threading.Event()
    error: list[str] = []

    def emit(output) -> None:
        if output.token_ids:
            first.set()
        if output.finish_reason is not None:
            if output.finish_reason == "error":
                error.append(output.error or "error")
            first.set()
            done.set()

    try:
        worker.serve(spec).result(timeout=300)
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        prompt = tuple(range(1000 + index, 1032 + index))
        worker.submit(GenerationRequest(f"r{index}", spec.name, prompt, params), emit)
    except Exception as exc:
        return time.perf_counter() - started, f"{type(exc).__name__}: {exc}"
    first.wait(300)
    ttft = time.perf_counter() - started
    done.wait(300)
    return ttft, error[0] if error else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    folder = model_dir()
    weights = files_bytes(folder)
    budget = 2 * (weights + CACHE) + 64 * MIB
    specs = {
        name: ModelSpec(
            name=name,
            path=str(folder),
            memory_budget_bytes=CACHE,
            pinned=name == "pinned",
            idle_unload_s=IDLE_S if name == "two" else 0,
        )
        for name in NAMES
    }
    memory = HostMemory(budget)
    worker = EngineWorker(memory=memory)
    load_before = load_average()
    sampler = Sampler(memory)
    times: dict[str, list[float]] = {"cold": [], "warm": [], "switch": []}
    failures: list[str] = []
    pinned_lost = 0
    index = 0
    started = time.monotonic()
    seen: set[str] = set()
    for _ in range(args.rounds):
        for name in NAMES:
            loaded = worker.status(name).state == "serving"
            kind = "warm" if loaded else ("cold" if name not in seen else "switch")
            ttft, error = ask(worker, specs[name], index)
            index += 1
            seen.add(name)
            times[kind].append(ttft)
            if error:
                failures.append(f"{name}: {error}")
            if worker.status("pinned").state != "serving" and "pinned" in seen:
                pinned_lost += 1
            print(f"{name:>6} {kind:>6} {ttft * 1000:8.1f} ms {error or ''}", flush=True)
    # `two` idles out (the worker checks every few seconds); `pinned` never does.
    idle_started = time.monotonic()
    idled = None
    while time.monotonic() - idle_started < IDLE_S + 15:
        worker.unload_idle()
        if worker.status("two").state != "serving":
            idled = time.monotonic() - idle_started
            break
        time.sleep(0.1)
    pinned_kept = worker.status("pinned").state == "serving"
    sampler.stop()
    worker.shutdown(30)
    elapsed = time.monotonic() - started

    def row(kind: str) -> str:
        values = times[kind]
        if not values:
            return f"| {kind} | 0 | – | – |"
        return (
            f"| {kind} | {len(values)} | {statistics.median(values) * 1000:,.1f} "
            f"| {max(values) * 1000:,.1f} |"
        )

    ok_memory = sampler.held <= budget and sampler.active <= budget
    lines = [
        *run_header(
            "models.py",
            f"; load average {load_before} before the run, {load_average()} after; "
            f"{elapsed:.0f} s.",
        ),
        "",
        f"Three copies of SmolLM2-135M (float32, {weights / MIB:,.0f} MiB of weights each, a "
        f"{CACHE / MIB:.0f} MiB caches' budget each) in a budget of {budget / MIB:,.0f} MiB "
        f"(two fit); {args.rounds} rounds of one request to each in turn.",
        "",
        "| first token | requests | median (ms) | max (ms) |",
        "| --- | ---: | ---: | ---: |",
        row("warm"),
        row("cold"),
        row("switch"),
        "",
        f"- Failures: {len(failures)} (target 0){': ' + '; '.join(failures) if failures else ''}.",
        f"- Pinned model unloaded: {pinned_lost} times (target 0); still loaded at the end: "
        f"{'yes' if pinned_kept else 'NO'}.",
        f"- Memory, sampled every 5 ms: the budget's bytes held at most {sampler.held / MIB:,.0f} "
        f"MiB, MLX's active memory at most {sampler.active / MIB:,.0f} MiB, of {budget / MIB:,.0f} "
        f"MiB: {'within' if ok_memory else 'OVER'} the budget.",
        f"- `two` (idle time {IDLE_S:.0f} s) unloaded "
        + (f"{idled:.1f} s after its last request." if idled is not None else "NOT (timed out)."),
        "",
        "Verdict: "
        + (
            "pass"
            if not failures and not pinned_lost and pinned_kept and ok_memory and idled
            else "FAIL"
        )
        + ".",
    ]
    block = "\n".join(lines)
    print(block)
    if not args.no_write:
        write_results("models.py", "Models in one memory budget", block)


if __name__ == "__main__":
    main()
