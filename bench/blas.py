"""Which BLAS MLX's CPU backend should use: OpenBLAS, BLIS or MKL, at 1 or 2 threads.

    .venv/bin/python bench/blas.py [--model PATH] [--rounds 3] [--libs openblas,blis,mkl]
                                   [--threads 1,2] [--busy]

`mlx[cpu]` on Linux links a reference BLAS; engine/kernels/blas.py loads a fast one with RTLD_GLOBAL
before mlx so that its `cblas_sgemm` is the one libmlx.so binds. Only one library can win that
symbol per process, so each candidate is measured in a fresh subprocess (this script with
`--worker`, ORCHARD_BLAS naming the library file, its thread count in OPENBLAS_NUM_THREADS /
BLIS_NUM_THREADS / MKL_NUM_THREADS). Each subprocess first proves the library is the one in use
(the process's `cblas_sgemm` resolves into its file, and a 1024^3 fp32 matmul is far above the
reference BLAS's rate), then times:

- fp32 `x @ W.T` for the default model's weight shapes (SmolLM2-135M: 576->576, 576->192,
  576->1536, 1536->576 and the 576->49152 vocabulary head) at M = 1, 16, 64, 128 rows. mlx-lm's
  nn.Linear computes `x @ W.T` with W stored (out, in); the same product with the weight stored
  pre-transposed, (in, out) contiguous, `x @ W`, is timed too, to see whether layout matters.
  Each timing evaluates enough distinct weight matrices to exceed the 32 MB L3 cache, as the
  model's 538 MB of weights do, so weights stream from memory as they do in a forward.
- the default model's forward through engine.models.loader (the engine's own load path): decode
steps
  at batch 1, 4, 8 and 16 over a 32-token cache, and one 128-token prefill chunk.

Candidates alternate across rounds (the machine is shared; its speed moves by more than the
differences measured) and each number is the best over rounds. With --busy, each library's
forwards are also timed while another process spins on one core, as daphne or a second
benchmark would, to see which thread count degrades least when the cores are not all free.

BLIS is installed from Debian (libblis4-pthread) when missing and this runs as root; MKL is the
PyPI wheel, downloaded with pip into var/cache/blas/mkl (never installed into the venv). MKL's
licence is the Intel Simplified Software License: use and binary redistribution allowed, no
modification or reverse engineering; the wheel is ~230 MB (~690 MB unpacked).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.results import cpu_model, load_average, run_header  # noqa: E402

MKL_CACHE = ROOT / "var" / "cache" / "blas" / "mkl"
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "BLIS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")

# (in, out) of the default model's weight matrices, and how many of each one forward uses.
HIDDEN, KV, MLP, VOCAB, LAYERS = 576, 192, 1536, 49152, 30
SHAPES = ((HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, MLP), (MLP, HIDDEN), (HIDDEN, VOCAB))
PER_FORWARD = {
    (HIDDEN, HIDDEN): 2 * LAYERS,  # q, o
    (HIDDEN, KV): 2 * LAYERS,  # k, v
    (HIDDEN, MLP): 2 * LAYERS,  # gate, up
    (MLP, HIDDEN): LAYERS,  # down
    (HIDDEN, VOCAB): 1,  # tied embedding as the head
}
ROWS = (1, 16, 64, 128)
# Enough distinct weights per timing to be read from memory, not from the 32 MB L3.
STREAM_BYTES = 96 * 2**20
DECODE_BATCHES = (1, 4, 8, 16)
FORWARDS = (*(f"decode, batch {b}" for b in DECODE_BATCHES), "prefill 128 tokens")


# --- the subprocess: one library, one thread count -------------------------------------------


def best_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1000


def worker(args: argparse.Namespace) -> None:
    import engine  # noqa: F401  (loads ORCHARD_BLAS before mlx)
    from engine.kernels import blas

    # isort: split
    import mlx.core as mx

    loaded = blas.preload_blas()
    provider = blas.sgemm_provider()
    a, b = mx.random.normal((1024, 1024)), mx.random.normal((1024, 1024))
    mx.eval(a, b)
    gflops = 2 * 1024**3 / best_ms(lambda: mx.eval(a @ b), args.repeat) / 1e6
    result = {"loaded": loaded, "provider": provider, "gflops": gflops}
    if not args.check_only:
        if loaded is None or provider != os.path.realpath(loaded):
            sys.exit(f"cblas_sgemm resolves to {provider}, not the requested {loaded}")
        if not args.no_matmuls:
            result["matmul"] = matmuls(mx, args.repeat)
        result["forward"] = forwards(mx, args.model, args.repeat)
    print("RESULT " + json.dumps(result), flush=True)


def matmuls(mx, repeat: int) -> dict[str, float]:
    """ms per product, for each shape, row count and layout ('T': x @ W.T, 'N': x @ W)."""
    out = {}
    for fan_in, fan_out in SHAPES:
        copies = max(1, -(-STREAM_BYTES // (fan_in * fan_out * 4)))
        stored = [mx.random.normal((fan_out, fan_in)) for _ in range(copies)]  # nn.Linear's
        pretransposed = [mx.random.normal((fan_in, fan_out)) for _ in range(copies)]
        mx.eval(stored, pretransposed)
        for rows in ROWS:
            x = mx.random.normal((rows, fan_in))
            mx.eval(x)
            for layout, weights in (("T", stored), ("N", pretransposed)):
                if layout == "T":
                    fn = lambda ws=weights, x=x: mx.eval([x @ w.T for w in ws])  # noqa: E731
                else:
                    fn = lambda ws=weights, x=x: mx.eval([x @ w for w in ws])  # noqa: E731
                out[f"{fan_in}x{fan_out}@{rows}/{layout}"] = best_ms(fn, repeat) / copies
        del stored, pretransposed
    return out


def forwards(mx, model_path: str, repeat: int) -> dict[str, float]:
    """The default model's decode steps and prefill chunk, as bench/kernels.py times them."""
    import random

    from mlx_lm.models.cache import make_prompt_cache

    from engine.models.loader import load_model

    model = load_model(model_path).model
    rng = random.Random(0)
    chunk = mx.array([[rng.randrange(100, 49000) for _ in range(128)]])

    def prefill():
        cache = make_prompt_cache(model)
        model(chunk, cache=cache)
        mx.eval([c.state for c in cache])

    def decode(batch: int):
        cache = make_prompt_cache(model)
        model(mx.array([[rng.randrange(100, 49000) for _ in range(32)]] * batch), cache=cache)
        mx.eval([c.state for c in cache])
        tokens = mx.array([[5]] * batch)

        def step():
            mx.eval(model(tokens, cache=cache))
            for c in cache:  # every step sees the same 32-token context
                c.trim(1)

        return step

    timings = {f"decode, batch {b}": best_ms(decode(b), repeat * 2) for b in DECODE_BATCHES}
    timings["prefill 128 tokens"] = best_ms(prefill, repeat)
    return timings


# --- the parent: candidates, rounds, tables --------------------------------------------------


def ensure_blis() -> str | None:
    from engine.kernels.blas import find_library

    path = find_library("blis")
    if path or os.geteuid() != 0 or not shutil.which("apt-get"):
        return path
    print("installing libblis4-pthread (Debian) ...", flush=True)
    install = ["apt-get", "install", "-y", "-qq", "libblis4-pthread"]
    if subprocess.run(install, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-qq"], capture_output=True)
        subprocess.run(install, capture_output=True)
    return find_library("blis")


def ensure_mkl() -> str | None:
    """libmkl_rt from the PyPI wheel, unpacked under var/cache/blas/mkl (lib/ and the licence)."""
    found = sorted(glob.glob(str(MKL_CACHE / "lib" / "libmkl_rt.so.*")))
    if found:
        return found[0]
    MKL_CACHE.mkdir(parents=True, exist_ok=True)
    wheels = sorted(MKL_CACHE.glob("mkl-*.whl"))
    if not wheels:
        print("downloading the mkl wheel from PyPI (~230 MB) ...", flush=True)
        download = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        if subprocess.run([*download, "-d", str(MKL_CACHE), "mkl"]).returncode != 0:
            return None
        wheels = sorted(MKL_CACHE.glob("mkl-*.whl"))
    lib = MKL_CACHE / "lib"
    lib.mkdir(exist_ok=True)
    with zipfile.ZipFile(wheels[-1]) as wheel:
        for member in wheel.namelist():
            name = os.path.basename(member)
            if ("/data/lib/" in member and name.startswith("libmkl_")) or name == "LICENSE.txt":
                target = (lib if name != "LICENSE.txt" else MKL_CACHE) / name
                target.write_bytes(wheel.read(member))
    found = sorted(glob.glob(str(lib / "libmkl_rt.so.*")))
    return found[0] if found else None


def versions() -> str:
    parts = []
    for package in ("libopenblas0-pthread", "libblis4-pthread"):
        query = ["dpkg-query", "-W", "-f", "${Version}", package]
        run = subprocess.run(query, capture_output=True, text=True)
        if run.returncode == 0:
            parts.append(f"{package} {run.stdout}")
    wheels = sorted(MKL_CACHE.glob("mkl-*.whl"))
    if wheels:
        parts.append(f"mkl {wheels[-1].name.split('-')[1]} (PyPI)")
    return ", ".join(parts)


def run_worker(
    library: str, threads: int | None, args: argparse.Namespace, *extra: str, spin: bool = False
) -> dict:
    env = dict(os.environ, ORCHARD_BLAS=library)
    for var in THREAD_VARS:
        env.pop(var, None)
        if threads:
            env[var] = str(threads)
    command = [sys.executable, __file__, "--worker", "--model", str(args.model)]
    command += ["--repeat", str(args.repeat), *extra]
    spinner = None
    if spin:
        spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        run = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    finally:
        if spinner:
            spinner.kill()
            spinner.wait()
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(f"worker for {library} failed:\n{run.stdout}\n{run.stderr}")


def merge(best: dict, new: dict) -> None:
    for key, value in new.items():
        if isinstance(value, dict):
            merge(best.setdefault(key, {}), value)
        elif isinstance(value, float):
            if key == "gflops":
                best[key] = max(best.get(key, 0.0), value)
            else:
                best[key] = min(best.get(key, float("inf")), value)
        else:
            best[key] = value


def table(header: list[str], rows: list[list[str]]) -> str:
    """Markdown, the first column left-aligned and the numbers right-aligned."""
    rule = "|---|" + "---:|" * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", rule]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def busy_cores(seconds: float = 1.0) -> float:
    """Cores' worth of CPU time the rest of the machine used over `seconds` (no worker runs
    meanwhile). The load average lags by minutes; this says whether now is a fair moment."""

    def ticks() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            fields = [int(v) for v in stat.readline().split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return sum(fields) - idle, sum(fields)

    busy0, total0 = ticks()
    time.sleep(seconds)
    busy1, total1 = ticks()
    return (os.cpu_count() or 1) * (busy1 - busy0) / max(1, total1 - total0)


def wait_for_quiet(max_busy: float, max_wait_s: float) -> float:
    """Wait (up to max_wait_s) until others use at most max_busy cores; returns the last
    reading, so that each measurement's surroundings can be reported."""
    deadline = time.monotonic() + max_wait_s
    busy = busy_cores()
    while busy > max_busy and time.monotonic() < deadline:
        time.sleep(4)
        busy = busy_cores()
    return busy


def per_forward_ms(matmul: dict[str, float], rows: int, layout: str) -> float:
    return sum(
        count * matmul[f"{fan_in}x{fan_out}@{rows}/{layout}"]
        for (fan_in, fan_out), count in PER_FORWARD.items()
    )


def report(results: dict, reference: float, args, load_before: str, load_after: str) -> str:
    configs = list(results)
    out = [
        *run_header(
            "blas.py",
            f", {cpu_model()}. Load average (1, 5, 15 min) before: {load_before}; after: "
            f"{load_after}. {versions()}. {args.rounds} rounds, libraries alternated, best of "
            "each.",
        ),
        "",
        f"Reference BLAS (ORCHARD_BLAS=off): {reference:.1f} GFLOP/s at 1024^3.",
        "",
    ]
    out.append(
        table(
            ["library, threads", "cblas_sgemm from", "1024^3 GFLOP/s"],
            [
                [c, os.path.basename(results[c]["provider"] or "-"), f"{results[c]['gflops']:.0f}"]
                for c in configs
            ],
        )
    )
    layouts = (("T", "x @ W.T (nn.Linear)"), ("N", "x @ W, W pre-transposed"))
    for layout, title in layouts if "matmul" in results[configs[0]] else ():
        out += ["", f"fp32 {title}, ms per product:", ""]
        rows = []
        for fan_in, fan_out in SHAPES:
            for m in ROWS:
                key = f"{fan_in}x{fan_out}@{m}/{layout}"
                rows.append(
                    [f"{fan_in}->{fan_out}, M={m}"]
                    + [f"{results[c]['matmul'][key]:.3f}" for c in configs]
                )
        for m in ROWS:
            rows.append(
                [f"**one forward's weight matmuls, M={m}**"]
                + [f"**{per_forward_ms(results[c]['matmul'], m, layout):.1f}**" for c in configs]
            )
        out.append(table(["shape", *configs], rows))
    out += ["", "Default model forward, ms:", ""]
    rows = [[c] + [f"{results[c]['forward'][label]:.1f}" for label in FORWARDS] for c in configs]
    out.append(table(["library, threads", *FORWARDS], rows))
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5, help="timings per round, best kept")
    parser.add_argument("--libs", default="openblas,blis,mkl")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--busy", action="store_true", help="also time forwards, one core busy")
    parser.add_argument(
        "--max-busy", type=float, default=0.3, help="cores others may use when a worker starts"
    )
    parser.add_argument("--max-wait", type=float, default=60, help="seconds to wait for that")
    parser.add_argument("--forwards-only", action="store_true", help="skip the matmul tables")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--check-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--no-matmuls", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not sys.platform.startswith("linux"):
        sys.exit("the BLAS choice is Linux-only (macOS uses Accelerate through Metal's build)")
    if args.model is None:
        from bench.engine import default_model

        args.model = default_model()
    from engine.kernels.blas import find_library

    found = {"openblas": find_library("openblas"), "blis": ensure_blis(), "mkl": ensure_mkl()}
    libraries = {}
    for name in args.libs.split(","):
        if found.get(name):
            libraries[name] = found[name]
        else:
            print(f"{name}: not available here, skipped", flush=True)
    thread_counts = [int(t) for t in args.threads.split(",")]
    configs = [(name, t) for name in libraries for t in thread_counts]
    load_before = load_average()
    reference = run_worker("off", None, args, "--check-only")["gflops"]
    print(f"reference BLAS: {reference:.1f} GFLOP/s at 1024^3", flush=True)

    results: dict[str, dict] = {}
    busy: dict[str, dict] = {}
    busy_before: list[float] = []
    for round_ in range(args.rounds):
        shift = round_ % len(configs)
        for name, threads in configs[shift:] + configs[:shift]:
            label = f"{name}, {threads}"
            others = wait_for_quiet(args.max_busy, args.max_wait)
            busy_before.append(others)
            extra = ("--no-matmuls",) if args.forwards_only else ()
            result = run_worker(libraries[name], threads, args, *extra)
            merge(results.setdefault(label, {}), result)
            forward = result["forward"]
            print(
                f"round {round_ + 1} {label:12s} {result['gflops']:6.0f} GFLOP/s  "
                + "  ".join(f"{k} {v:.1f} ms" for k, v in forward.items())
                + f"  (others used {others:.2f} cores before it; load {os.getloadavg()[0]:.2f})",
                flush=True,
            )
            if args.busy:
                wait_for_quiet(args.max_busy, args.max_wait)
                spun = run_worker(libraries[name], threads, args, "--no-matmuls", spin=True)
                merge(busy.setdefault(label, {}), spun)
                print(
                    f"        busy {label:12s} "
                    + "  ".join(f"{k} {v:.1f} ms" for k, v in spun["forward"].items()),
                    flush=True,
                )
    # Ordered as configured, not as the last round ran them.
    results = {f"{n}, {t}": results[f"{n}, {t}"] for n, t in configs}
    # The worker already proved its cblas_sgemm comes from the library; the rate says the
    # library is really the fast one (a busy machine can slow one round to near the reference,
    # so only the best round counts).
    for label, result in results.items():
        if result["gflops"] < 3 * reference:
            sys.exit(f"{label}: {result['gflops']:.1f} GFLOP/s at best, no faster than reference")
    load_after = load_average()
    text = report(results, reference, args, load_before, load_after)
    text += (
        f"\n\nOther processes' CPU use just before each worker started: "
        f"{min(busy_before):.2f}-{max(busy_before):.2f} cores "
        f"(median {sorted(busy_before)[len(busy_before) // 2]:.2f}) of {os.cpu_count()}."
    )
    if busy:
        rows = [
            [c] + [f"{busy[c]['forward'][label]:.1f}" for label in FORWARDS]
            for c in results
            if c in busy
        ]
        text += "\n\nThe same forwards while another process spins on one core, ms:\n\n"
        text += table(["library, threads", *FORWARDS], rows)
    print("\n" + text)


if __name__ == "__main__":
    main()
