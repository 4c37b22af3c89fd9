"""Images in: Orchard against mlx_vlm.server on the same vision model, and a repeated image prompt
warm against cold.

    .venv/bin/python bench/vision.py [--rounds 2] [--max-tokens 96] [--no-write]

(`make bench-vision`.) The model: a SmolVLM (mlx-vlm's `smolvlm`: a SigLIP-style tower, pixel
shuffle, a Llama decoder) with random weights, its tower at SmolVLM-256M's size (768 wide, 12
layers) on 384-pixel images (576 patches, 64 image tokens), its decoder at SmolLM2-135M's (576
wide, 30 layers), with the real Qwen3 tokenizer (no hub here: tests/fixtures/tiny_vision.py's
builder, these sizes). Both servers run here on free ports, with the same BLAS preloaded
(engine/kernels/blas.py): daphne with config.asgi (as `make serve`) over a throwaway
ORCHARD_HOME with the model registered, and `mlx_vlm.server --model DIR` from a venv of its own
(var/bench/mlx-vlm, made from bench/requirements-mlx-vlm.txt on first use) with its defaults.

- Throughput: 8 concurrent chat requests, each its own image (a 384-pixel PNG, new per request
  and round) and question, max_tokens 96, greedy; tokens/s = the completion tokens (usage) over
  the wall time of the 8. The servers alternate round by round, each keeping its best round.
  Target: Orchard at least 1.5x mlx_vlm.server.
- Warm against cold, on Orchard: a new image and question's time to first token (streamed),
  then the same request again (a prefix-cache hit that covers the image: no vision tower), 3
  pairs, medians. Target: warm at least 5x faster.
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
import base64  # noqa: E402
import io  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402

from bench.api import setup_home  # noqa: E402
from bench.results import load_average, run_header, write_results  # noqa: E402
from engine.kernels.blas import find_blas  # noqa: E402
from tests.fixtures.daphne import free_port, start_daphne, stop_daphne  # noqa: E402
from tests.fixtures.tiny_vision import (  # noqa: E402
    CONFIG,
    PREPROCESSOR,
    PROCESSOR,
    build_vision_model,
)

PEER = "mlx_vlm.server"
PEER_VENV = ROOT / "var" / "bench" / "mlx-vlm"
PEER_REQUIREMENTS = ROOT / "bench" / "requirements-mlx-vlm.txt"
NAME = "bench-vision"
REQUESTS = 8
IMAGE_SIZE = 384
TOKENS_PER_S_MIN = 1.5
WARM_SPEEDUP_MIN = 5.0
TEXT = {
    **CONFIG["text_config"],
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "intermediate_size": 1536,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
}
VISION = {
    **CONFIG["vision_config"],
    "hidden_size": 768,
    "intermediate_size": 3072,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "image_size": IMAGE_SIZE,
    "patch_size": 16,
}
SIZE = {"longest_edge": IMAGE_SIZE}
# The peer's process: the BLAS loaded globally before anything imports mlx, then its server.
PEER_BOOTSTRAP = """\
import ctypes, runpy, sys
ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)
sys.argv = ["mlx_vlm.server", *sys.argv[2:]]
runpy.run_module("mlx_vlm.server", run_name="__main__", alter_sys=True)
"""


def bench_model() -> Path:
    config = {**CONFIG, "scale_factor": 3, "text_config": TEXT, "vision_config": VISION}
    preprocessor = {**PREPROCESSOR, "size": SIZE, "max_image_size": SIZE}
    return build_vision_model(config, preprocessor, {**PROCESSOR, "image_seq_len": 64})


def picture(seed: str) -> str:
    """A data URL of a 384-pixel PNG of random rectangles (its own per seed)."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), tuple(rng.randrange(256) for _ in "rgb"))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x, y = rng.randrange(IMAGE_SIZE - 40), rng.randrange(IMAGE_SIZE - 40)
        colour = tuple(rng.randrange(256) for _ in "rgb")
        draw.rectangle([x, y, x + rng.randrange(20, 120), y + rng.randrange(20, 120)], colour)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def messages(seed: str) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": picture(seed)}},
                {"type": "text", "text": f"Describe picture {seed} in detail."},
            ],
        }
    ]


def peer_python() -> Path:
    python = PEER_VENV / "bin" / "python"
    if not python.exists():
        uv = ROOT / ".venv" / "bin" / "uv"
        subprocess.run([uv, "venv", "-q", "--python", sys.executable, PEER_VENV], check=True)
        subprocess.run(
            [uv, "pip", "install", "-q", "--python", python, "-r", PEER_REQUIREMENTS], check=True
        )
    return python


def start_peer(folder: Path, port: int, log_path: Path) -> subprocess.Popen:
    args = ["--model", str(folder), "--host", "127.0.0.1", "--port", str(port)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            [peer_python(), "-c", PEER_BOOTSTRAP, find_blas(), *args],
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).raise_for_status()
            return process
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError(f"{PEER} did not start:\n{log_path.read_text()[-3000:]}")


class Side:
    def __init__(self, name: str, port: int, model: str, key: str, extra_body: dict):
        import openai

        self.name, self.model, self.extra_body = name, model, extra_body
        self.client = openai.AsyncOpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=key, max_retries=0, timeout=900
        )
        self.best: tuple[float, int, float] | None = None  # tokens/s, tokens, seconds

    async def ask(self, seed: str, max_tokens: int) -> int:
        reply = await self.client.chat.completions.create(
            model=self.model,
            messages=messages(seed),
            max_tokens=max_tokens,
            temperature=0,
            extra_body=self.extra_body,
        )
        return reply.usage.completion_tokens

    async def round(self, tag: str, max_tokens: int) -> tuple[float, int, float]:
        began = time.perf_counter()
        tokens = await asyncio.gather(
            *(self.ask(f"{tag}-{i}", max_tokens) for i in range(REQUESTS))
        )
        seconds = time.perf_counter() - began
        result = (sum(tokens) / seconds, sum(tokens), seconds)
        if self.best is None or result[0] > self.best[0]:
            self.best = result
        return result

    async def first_token(self, seed: str) -> float:
        began = time.perf_counter()
        stream = await self.client.chat.completions.create(
            model=self.model,
            messages=messages(seed),
            max_tokens=4,
            temperature=0,
            stream=True,
            extra_body=self.extra_body,
        )
        first = None
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content is not None:
                first = time.perf_counter() - began
        return first if first is not None else time.perf_counter() - began


async def measure(args, orchard: Side, peer: Side) -> dict:
    for side in (orchard, peer):  # loads the model, compiles what compiles
        await side.ask("warm-up", 4)
    rounds = []
    for number in range(args.rounds):
        for side in (orchard, peer) if number % 2 == 0 else (peer, orchard):
            tokens_s, tokens, seconds = await side.round(f"r{number}", args.max_tokens)
            rounds.append(f"{side.name} round {number + 1}: {tokens} tokens in {seconds:.1f} s")
            print(rounds[-1], f"({tokens_s:.1f} tokens/s)", flush=True)
    pairs = []
    for number in range(3):
        cold = await orchard.first_token(f"ttft-{number}")
        warm = await orchard.first_token(f"ttft-{number}")
        pairs.append((cold, warm))
        print(f"time to first token cold {cold:.3f} s, warm {warm:.3f} s", flush=True)
    return {"rounds": rounds, "pairs": pairs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--no-write", action="store_true", help="leave bench/RESULTS.md as it is")
    args = parser.parse_args()
    began, load_before = time.monotonic(), load_average()
    folder = bench_model()
    with tempfile.TemporaryDirectory(prefix="orchard-bench-vision-") as tmp:
        home = Path(tmp)
        key, _ = setup_home(home)
        from inference.services.registry import model_register

        model_register(name=NAME, path=folder)
        ours, theirs = free_port(), free_port()
        env = {**os.environ, "ORCHARD_HOME": str(home), "DJANGO_SETTINGS_MODULE": "config.settings"}
        server = start_daphne(port=ours, env=env, log_path=home / "orchard.log")
        peer = start_peer(folder, theirs, home / "peer.log")
        try:
            orchard = Side("Orchard", ours, NAME, key, {"ignore_eos": True})
            other = Side(PEER, theirs, str(folder), "none", {})
            result = asyncio.run(measure(args, orchard, other))
        finally:
            stop_daphne(server)
            peer.terminate()
            peer.wait(30)
    ratio = orchard.best[0] / other.best[0]
    colds, warms = zip(*result["pairs"], strict=True)
    cold, warm = statistics.median(colds), statistics.median(warms)
    speedup = cold / warm

    def verdict(ok: bool) -> str:
        return "pass" if ok else "FAIL"

    lines = [
        *run_header(
            "vision.py",
            f"; load average {load_before} before the run, {load_average()} after; "
            f"{time.monotonic() - began:.0f} s.",
        ),
        "",
        "A SmolVLM with random weights (tower 768 wide, 12 layers, 384-pixel images: 64 image "
        "tokens; decoder 576 wide, 30 layers; Qwen3's tokenizer), float32. "
        f"{REQUESTS} concurrent chat requests, each its own image and question, max_tokens "
        f"{args.max_tokens}, greedy (Orchard ignores EOS; {PEER} cannot, so tokens are counted "
        f"from usage); best of {args.rounds} rounds each, the servers alternating.",
        "",
        "| server | tokens/s (best round) | tokens | seconds |",
        "| --- | ---: | ---: | ---: |",
        *(
            f"| {side.name} | {side.best[0]:.1f} | {side.best[1]} | {side.best[2]:.1f} |"
            for side in (orchard, other)
        ),
        "",
        *(f"- {line}" for line in result["rounds"]),
        "",
        "Orchard's time to first token of a new image and question, then of the same request "
        "again (cold / warm, seconds): "
        + ", ".join(f"{c:.3f} / {w:.3f}" for c, w in result["pairs"])
        + ".",
        "",
        f"- Tokens/s, Orchard against {PEER}: {ratio:.2f}x (target >= {TOKENS_PER_S_MIN}x): "
        f"{verdict(ratio >= TOKENS_PER_S_MIN)}.",
        f"- A repeated image prompt's time to first token, warm against cold (medians "
        f"{warm:.3f} s and {cold:.3f} s): {speedup:.1f}x faster (target >= "
        f"{WARM_SPEEDUP_MIN}x): {verdict(speedup >= WARM_SPEEDUP_MIN)}.",
    ]
    block = "\n".join(lines)
    print(block)
    if not args.no_write:
        write_results("vision.py", "Images in: Orchard against mlx_vlm.server", block)


if __name__ == "__main__":
    main()
