"""Checkpoints into MLX model folders: which checkpoints need it, whether mlx-lm can run them,
and the conversion itself (mlx-lm's, optionally quantized; a vision-language model's, mlx-vlm's),
in a process of its own.

The rule for "already MLX": a config with mlx-lm's own `quantization` block (checkpoints
quantized elsewhere carry `quantization_config` only), or a repo the hub lists as MLX (library
`mlx`, or the `mlx` tag: every mlx-community upload). Those are served as downloaded; anything
else is converted (mlx-lm's model class loads it, its `sanitize` renames and drops what MLX does
not use, and the weights are written as MLX safetensors), keeping the checkpoint's dtype, and
quantized when asked (affine, 4 or 8 bits, group size 32, 64 or 128).

The conversion runs in a child process (`python -m engine.models.convert`): it holds a whole
checkpoint's arrays, and running out of memory there ends that process and fails the pull, not
the web process serving everyone's requests. The child writes progress as JSON lines on its
stdout (mlx-lm's own prints go to its stderr). The weights are evaluated tensor by tensor and
written shard by shard (as mlx-lm's `save_model` does), so memory holds about one shard.

mlx-lm's conversion helpers (`load_model`, `quantize_model`, `make_shards`, `save_config`) are
used only here: an mlx-lm upgrade that moves them touches this module.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from engine.models.hub import PullError, PullStopped

QUANTIZE_BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP_SIZE = 64
ROOT = Path(__file__).resolve().parents[2]
# Files of the source that the converted folder does not take as they are.
_REWRITTEN = ("config.json", "model.safetensors.index.json")
_WEIGHTS_PREFIX, _WEIGHTS_SUFFIX = "model", ".safetensors"
_DTYPES = ("float16", "bfloat16", "float32")

Progress = Callable[[str, int, int], None]  # (phase, done, total)


def quantization_of(config: Mapping[str, Any]) -> dict | None:
    """The checkpoint's quantization (mlx-lm's block, or another tool's), or None."""
    found = config.get("quantization") or config.get("quantization_config")
    return dict(found) if isinstance(found, Mapping) else None


def is_mlx_checkpoint(config: Mapping[str, Any], *, hub_says_mlx: bool) -> bool:
    return isinstance(config.get("quantization"), Mapping) or hub_says_mlx


def architecture_problem(config: Mapping[str, Any], *, kind: str) -> str | None:
    """Why this config's model cannot be served (a sentence), or None."""
    model_type = config.get("model_type")
    if kind == "embedding":
        if model_type != "bert":
            return (
                f"its model_type is {model_type!r}: Orchard's embedding encoder runs BERT-family "
                "sentence-transformers models (model_type 'bert') only."
            )
        return None
    if not isinstance(model_type, str) or not model_type:
        return "its config.json names no model_type."
    from engine.models.vision import VisionModelError, is_vision_model, text_module

    if is_vision_model(dict(config)):
        try:
            text_module(dict(config))
        except VisionModelError as exc:
            return f"{exc}."
        return None
    from mlx_lm.utils import _get_classes

    try:
        _get_classes(dict(config))
    except (ValueError, ImportError, KeyError):
        version = importlib.import_module("mlx_lm").__version__
        return f"mlx-lm {version} has no model for its model_type {model_type!r}."
    return None


def convert_checkpoint(
    source: Path,
    dest: Path,
    *,
    bits: int | None = None,
    group_size: int = DEFAULT_GROUP_SIZE,
    progress: Progress | None = None,
) -> None:
    """Convert the checkpoint folder `source` into an MLX model folder `dest` (which must not
    exist), quantized to `bits` when given. Runs in the calling process; see `convert_in_child`."""
    from engine.models.vision import is_vision_model, read_config

    if is_vision_model(read_config(source)):
        _convert_vision(source, dest, bits=bits, group_size=group_size, progress=progress)
        return
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map, tree_map_with_path
    from mlx_lm.utils import load_model, quantize_model

    import engine  # noqa: F401  (OpenBLAS before mlx)

    report = progress or (lambda phase, done, total: None)
    report("converting", 0, 0)
    model, config = load_model(source, lazy=True)
    dtype = config.get("torch_dtype") or config.get("dtype")
    if dtype in _DTYPES:
        target = getattr(mx, dtype)
        keep = getattr(model, "cast_predicate", lambda _: True)
        model.update(
            tree_map_with_path(
                lambda k, v: (
                    v.astype(target) if keep(k) and mx.issubdtype(v.dtype, mx.floating) else v
                ),
                model.parameters(),
            )
        )
    phase = "converting"
    if bits is not None:
        phase = "quantizing"
        report(phase, 0, 0)
        with contextlib.redirect_stdout(sys.stderr):
            model, config = quantize_model(model, config, group_size, bits)
    weights = dict(tree_flatten(model.parameters()))
    # The model lets go of its arrays, so each is freed once its shard is written.
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    del model
    dest.mkdir(parents=True)
    _write_weights(dest, weights, lambda done, total: report(phase, done, total))
    _write_config(dest / "config.json", config)
    for file in sorted(source.rglob("*")):
        relative = file.relative_to(source).as_posix()
        if file.is_file() and not _is_weights(relative) and relative not in _REWRITTEN:
            (dest / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(file, dest / relative)


def _convert_vision(
    source: Path, dest: Path, *, bits: int | None, group_size: int, progress: Progress | None
) -> None:
    """A vision-language checkpoint through mlx-vlm's conversion (its model class renames the
    weights of both towers; quantized, only the language model and projector are, as mlx-vlm
    does: the vision tower keeps its precision), with the processor's files."""
    from mlx_vlm.convert import convert

    import engine  # noqa: F401  (OpenBLAS before mlx)

    phase = "quantizing" if bits is not None else "converting"
    report = progress or (lambda phase, done, total: None)
    report(phase, 0, 0)
    with contextlib.redirect_stdout(sys.stderr):  # (its progress prints)
        convert(
            str(source),
            str(dest),
            quantize=bits is not None,
            q_group_size=group_size,
            q_bits=bits or 4,
            trust_remote_code=False,  # (its default runs code a repo names)
        )
    for file in sorted(source.iterdir()):  # what its processor did not write again
        if file.is_file() and not _is_weights(file.name) and not (dest / file.name).exists():
            shutil.copy2(file, dest / file.name)
    report(phase, 1, 1)


def _is_weights(relative: str) -> bool:
    return (
        "/" not in relative
        and relative.startswith(_WEIGHTS_PREFIX)
        and relative.endswith(_WEIGHTS_SUFFIX)
    )


def _write_weights(dest: Path, weights: dict, report: Callable[[int, int], None]) -> None:
    import mlx.core as mx
    from mlx_lm.utils import make_shards

    total = sum(v.nbytes for v in weights.values())
    shards = make_shards(weights)
    weights.clear()
    name = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    index: dict[str, Any] = {"metadata": {"total_size": total}, "weight_map": {}}
    done = 0
    report(done, total)
    for number in range(len(shards)):
        shard, shards[number] = shards[number], None
        for array in shard.values():
            mx.eval(array)
            done += array.nbytes
            report(done, total)
        file = name.format(number + 1, len(shards))
        mx.save_safetensors(str(dest / file), shard, metadata={"format": "mlx"})
        index["weight_map"].update(dict.fromkeys(shard, file))
        del shard
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


def _write_config(path: Path, config: dict) -> None:
    from mlx_lm.utils import save_config

    save_config(config, config_path=path)


def convert_in_child(
    source: Path,
    dest: Path,
    *,
    bits: int | None,
    group_size: int,
    progress: Progress,
    should_stop: Callable[[], bool],
) -> None:
    """`convert_checkpoint` in a child process. `should_stop()` True ends it (PullStopped); a
    child that fails or dies is a PullError saying how."""
    command = [sys.executable, "-m", "engine.models.convert", str(source), str(dest)]
    if bits is not None:
        command += ["--bits", str(bits), "--group-size", str(group_size)]
    child = subprocess.Popen(
        command,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    errors: collections.deque[str] = collections.deque(maxlen=20)
    drain = threading.Thread(target=lambda: errors.extend(child.stderr), daemon=True)
    drain.start()
    stopped = threading.Event()
    done = threading.Event()

    def watch() -> None:
        while not done.wait(0.25):
            if should_stop():
                stopped.set()
                child.kill()
                return

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    reported: str | None = None
    try:
        for line in child.stdout:
            message = json.loads(line)
            if "error" in message:
                reported = message["error"]
            else:
                progress(message["phase"], message["done"], message["total"])
        child.wait()
    except BaseException:
        child.kill()
        child.wait()
        raise
    finally:
        done.set()
        watcher.join()
        drain.join(timeout=5)
    if stopped.is_set():
        raise PullStopped
    if child.returncode != 0:
        if reported is None:
            tail = " ".join(line.strip() for line in errors if line.strip())[-300:]
            how = (
                f"was killed by signal {-child.returncode} (out of memory?)"
                if child.returncode < 0
                else f"exited with status {child.returncode}"
            )
            reported = f"the conversion process {how}" + (f": {tail}" if tail else "")
        raise PullError("convert_failed", f"Converting failed: {reported}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Convert a checkpoint into an MLX model folder.")
    parser.add_argument("source", type=Path)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--bits", type=int, choices=QUANTIZE_BITS)
    parser.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=DEFAULT_GROUP_SIZE)
    args = parser.parse_args(argv)
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    # The protocol goes to the real stdout; anything else printed goes to stderr.
    channel = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    def progress(phase: str, done: int, total: int) -> None:
        channel.write(json.dumps({"phase": phase, "done": done, "total": total}) + "\n")

    try:
        convert_checkpoint(
            args.source, args.dest, bits=args.bits, group_size=args.group_size, progress=progress
        )
    except Exception as exc:
        channel.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}) + "\n")
        return 1
    return 0


def _exit_with_parent(parent: int) -> None:
    # A parent killed outright (SIGKILL) cannot stop this process; it stops itself.
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


if __name__ == "__main__":
    sys.exit(main())
