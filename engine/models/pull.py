"""A pull: a model from the hub (hub.py) to an MLX model folder under the models folder,
converted and quantized when it needs to be (convert.py), in phases a monitor follows.

Where the files go, under the models folder (`$ORCHARD_HOME/models`):
- `.pulls/ORG--NAME@COMMIT/`: the download, partial files (`*.incomplete`) included, kept when
  the process is killed so that the next pull of the same commit continues it;
- `.pulls/NAME.converting/`: the conversion's output while it is written;
- `NAME/`: the model folder, renamed into place whole once everything is there.

A pull that fails or is cancelled removes what it wrote; nothing is left half-done under
`NAME/`. Checked before the weights are downloaded (config.json comes first): the repo and
revision exist, the weights are safetensors, mlx-lm (or the embedding encoder) runs the
architecture, the disk has room for the download and, when converting, the converted copy.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from engine.models import hub
from engine.models.convert import (
    architecture_problem,
    convert_in_child,
    is_mlx_checkpoint,
    quantization_of,
)
from engine.models.hub import PullError, hub_fetch, hub_plan, staging_lock

STAGING = ".pulls"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class PullAbandoned(Exception):
    """Raised by a monitor when the pull is no longer its own to run (another process took it
    over): the pull stops and leaves its files to that process."""


class PullMonitor(Protocol):
    """What a pull tells its runner, and asks it. `progress` counts bytes while downloading
    and the weights' bytes written while converting or quantizing."""

    def resolved(self, plan: hub.HubPlan) -> None: ...

    def phase(self, phase: str) -> None: ...

    def progress(self, done: int, total: int) -> None: ...

    def should_stop(self) -> bool: ...


@dataclass(frozen=True)
class PullRequest:
    repo_id: str
    revision: str | None
    name: str
    kind: str = "chat"
    bits: int | None = None
    group_size: int = 64


@dataclass(frozen=True)
class PulledModel:
    folder: Path
    commit: str
    converted: bool
    bits: int | None  # when this pull quantized it
    group_size: int | None
    size_bytes: int


def staging_folder(models_dir: Path, repo_id: str, commit: str) -> Path:
    return Path(models_dir) / STAGING / f"{repo_id.replace('/', '--')}@{commit}"


def pull_model(
    request: PullRequest,
    *,
    models_dir: Path,
    endpoint: str,
    monitor: PullMonitor,
    token: str | None = None,
) -> PulledModel:
    """Download, check, convert and quantize as needed, and put the folder in place under
    `models_dir/NAME`. Raises PullError (with the sentence to show), PullStopped when the
    monitor asked to stop, PullAbandoned when the monitor gave the pull up."""
    models_dir = Path(models_dir)
    dest = models_dir / request.name
    _check_free_name(dest)
    monitor.phase("downloading")
    plan = hub_plan(
        request.repo_id,
        revision=request.revision,
        kind=request.kind,
        endpoint=endpoint,
        token=token,
    )
    monitor.resolved(plan)
    staging = staging_folder(models_dir, plan.repo_id, plan.commit)
    converting = models_dir / STAGING / f"{request.name}.converting"
    with staging_lock(staging, what=f"{plan.repo_id}@{plan.commit[:12]}"):
        try:
            return _pull(request, plan, staging, converting, dest, monitor, token)
        except PullAbandoned:
            raise
        except Exception:
            shutil.rmtree(staging, ignore_errors=True)
            shutil.rmtree(converting, ignore_errors=True)
            raise
        finally:
            if not staging.exists():
                staging.with_name(staging.name + ".lock").unlink(missing_ok=True)


def _pull(
    request: PullRequest,
    plan: hub.HubPlan,
    staging: Path,
    converting: Path,
    dest: Path,
    monitor: PullMonitor,
    token: str | None,
) -> PulledModel:
    repo = plan.repo_id

    def report(done: int) -> None:
        monitor.progress(done, plan.total_bytes)

    staging.mkdir(parents=True, exist_ok=True)
    hub_fetch(plan, staging, paths=["config.json"], on_bytes=report, token=token)
    try:
        config = json.loads((staging / "config.json").read_text(encoding="utf-8"))
    except ValueError:
        raise PullError("unsupported", f"{repo}'s config.json is not JSON.") from None
    if not isinstance(config, dict):
        raise PullError("unsupported", f"{repo}'s config.json is not a JSON object.")
    problem = architecture_problem(config, kind=request.kind)
    if problem:
        raise PullError("unsupported", f"{repo} cannot be served: {problem}")
    if request.kind == "chat" and not any(plan.file(name) for name in TOKENIZER_FILES):
        raise PullError("unsupported", f"{repo} has no tokenizer files.")
    if request.kind == "embedding" and plan.file("tokenizer.json") is None:
        raise PullError("unsupported", f"{repo} has no tokenizer.json (an encoder needs one).")
    if request.bits is not None and (quantized := quantization_of(config)):
        bits = quantized.get("bits") or quantized.get("quant_method") or "already"
        raise PullError(
            "already_quantized",
            f"{repo} is quantized already ({bits}{'-bit' if isinstance(bits, int) else ''}): "
            "pull it without quantizing.",
        )
    convert = request.kind == "chat" and (
        request.bits is not None or not is_mlx_checkpoint(config, hub_says_mlx=plan.hub_says_mlx)
    )
    needed = plan.total_bytes - hub.bytes_on_disk(plan, staging)
    if convert:
        needed += plan.weight_bytes  # the converted copy, at most the size of the source
    free = hub.free_disk_bytes(dest.parent)
    if free < needed:
        raise PullError(
            "disk_full",
            f"Not enough disk space for {repo}: it needs {format_bytes(needed)} more under "
            f"{dest.parent} and {format_bytes(free)} is free.",
        )
    hub_fetch(plan, staging, on_bytes=report, should_stop=monitor.should_stop, token=token)
    folder = staging
    if convert:
        shutil.rmtree(converting, ignore_errors=True)

        def converted(phase: str, done: int, total: int) -> None:
            monitor.phase(phase)
            monitor.progress(done, total)

        monitor.phase("converting")
        convert_in_child(
            staging,
            converting,
            bits=request.bits,
            group_size=request.group_size,
            progress=converted,
            should_stop=monitor.should_stop,
        )
        folder = converting
    _check_free_name(dest)
    os.replace(folder, dest)
    shutil.rmtree(staging, ignore_errors=True)
    quantized = convert and request.bits is not None
    return PulledModel(
        folder=dest,
        commit=plan.commit,
        converted=convert,
        bits=request.bits if quantized else None,
        group_size=request.group_size if quantized else None,
        size_bytes=sum(f.stat().st_size for f in dest.rglob("*") if f.is_file()),
    )


def _check_free_name(dest: Path) -> None:
    if dest.exists():
        raise PullError(
            "exists", f"{dest} exists already: choose another name for the model, or remove it."
        )


def format_bytes(num: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(num) < 1000:
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1000
    return f"{num:.1f} TB"
