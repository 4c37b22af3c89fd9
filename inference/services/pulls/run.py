"""Running one claimed pull: the engine's `pull_model` does the work (engine/models/pull.py);
this keeps the row up to date (a heartbeat thread writes its phase, bytes and rate every
HEARTBEAT_S and reads whether a cancel was asked for), registers the model when the folder is
in place, and writes how the pull ended.

Everything is written only while the row is still this runner's (`runner=` in every UPDATE): a
runner that was taken for dead and replaced stops (PullAbandoned), leaving the files to the
runner that replaced it. The row ends done (with its registry entry, in one transaction),
failed (the PullError's sentence, the same in the admin and the shell; the files removed) or
cancelled. A shell pull stopped with Ctrl-C keeps its partial download for the next pull.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.utils import timezone

from engine import (
    PullAbandoned,
    PulledModel,
    PullError,
    PullRequest,
    PullStopped,
    pull_model,
)
from inference.models import ModelEntry, ModelPull
from inference.services.engines import registry_changed
from inference.services.pulls.claims import HEARTBEAT_S, MESSAGE_CANCELLED
from inference.services.pulls.requests import ERROR_NAME_TAKEN
from inference.services.registry import model_register

logger = logging.getLogger(__name__)

MESSAGE_INTERRUPTED = (
    "Interrupted; the partial download is kept: pulling the same model again resumes it."
)
ERROR_UNEXPECTED = "The pull failed unexpectedly ({error}); the server log has the details."
# The rate is a moving average: each second's rate weighs this much.
RATE_WEIGHT = 0.3
RATE_WINDOW_S = 0.5


@dataclass(frozen=True)
class PullProgress:
    """What a pull's runner knows now (the shell's progress bar shows it)."""

    state: str
    done: int
    total: int | None
    rate: float | None


class RowMonitor:
    """The engine's PullMonitor for one row: progress kept in memory (the heartbeat writes
    it), a stop asked for by a cancel, a shutdown, or the loss of the row."""

    def __init__(self, pull: ModelPull, on_change: Callable[[PullProgress], None] | None) -> None:
        self.pull = pull
        self.commit = pull.commit
        self.state = ModelPull.State.DOWNLOADING
        self.done, self.total = pull.done_bytes, pull.total_bytes
        self.download_bytes = pull.total_bytes
        self.rate: float | None = None
        self.cancelled = threading.Event()
        self.lost = threading.Event()
        self.shutting_down = threading.Event()
        self._on_change = on_change
        self._mark: tuple[float, int] | None = None

    def resolved(self, plan) -> None:
        self.commit = plan.commit
        self.total = self.download_bytes = plan.total_bytes

    def phase(self, phase: str) -> None:
        if phase != self.state:
            self.state = phase
            self.done, self.total, self.rate, self._mark = 0, None, None, None
            self._changed()

    def progress(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self._mark is None or done < self._mark[1]:
            self._mark = (now, done)  # the bytes already on disk are not this run's rate
        elif now - self._mark[0] >= RATE_WINDOW_S:
            current = (done - self._mark[1]) / (now - self._mark[0])
            self.rate = (
                current
                if self.rate is None
                else (RATE_WEIGHT * current + (1 - RATE_WEIGHT) * self.rate)
            )
            self._mark = (now, done)
        self.done, self.total = done, total or self.total
        self._changed()

    def should_stop(self) -> bool:
        if self.lost.is_set() or self.shutting_down.is_set():
            raise PullAbandoned
        return self.cancelled.is_set()

    def snapshot(self) -> PullProgress:
        return PullProgress(self.state, self.done, self.total, self.rate)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.snapshot())


class Heartbeat:
    """Writes the monitor's progress to the row every HEARTBEAT_S, and reads its cancel."""

    def __init__(self, monitor: RowMonitor, runner: str) -> None:
        self.monitor, self.runner = monitor, runner
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orchard-pull-beat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            while not self._stop.wait(HEARTBEAT_S):
                try:
                    self.beat()
                except Exception:
                    logger.warning(
                        "pull %s: heartbeat not written", self.monitor.pull.pk, exc_info=True
                    )
        finally:
            connection.close()

    def beat(self) -> None:
        monitor = self.monitor
        mine = ModelPull.objects.filter(pk=monitor.pull.pk, runner=self.runner)
        written = mine.update(
            heartbeat_at=timezone.now(),
            state=monitor.state,
            commit=monitor.commit,
            done_bytes=monitor.done,
            total_bytes=monitor.total,
            rate_bytes_per_s=monitor.rate,
        )
        if not written:
            monitor.lost.set()
        elif mine.filter(cancel_requested=True).exists():
            monitor.cancelled.set()


def run_pull(
    pull: ModelPull,
    *,
    runner: str,
    on_change: Callable[[PullProgress], None] | None = None,
    monitor: RowMonitor | None = None,
) -> ModelPull:
    """Run `pull` (claimed by `runner`) to its end, and return the row as it ended."""
    monitor = monitor or RowMonitor(pull, on_change)
    request = PullRequest(
        repo_id=pull.source,
        # A pull taken over continues the commit it started on (its partial files are of it).
        revision=pull.commit or pull.revision or None,
        name=pull.name,
        kind=pull.kind,
        bits=pull.quantize_bits,
        group_size=pull.group_size,
    )
    try:
        with Heartbeat(monitor, runner):
            pulled = pull_model(
                request,
                models_dir=settings.ORCHARD_MODELS_DIR,
                endpoint=settings.HF_ENDPOINT,
                monitor=monitor,
            )
    except PullAbandoned:
        logger.warning("pull %s: no longer this runner's; stopped, files left", pull.pk)
        return ModelPull.objects.get(pk=pull.pk)
    except PullStopped:
        return _finish(pull, runner, monitor, ModelPull.State.CANCELLED, MESSAGE_CANCELLED)
    except PullError as exc:
        return _finish(pull, runner, monitor, ModelPull.State.FAILED, str(exc), exc.code)
    except KeyboardInterrupt:
        _finish(pull, runner, monitor, ModelPull.State.CANCELLED, MESSAGE_INTERRUPTED)
        raise
    except Exception as exc:
        logger.exception("pull %s failed", pull.pk)
        message = ERROR_UNEXPECTED.format(error=f"{type(exc).__name__}: {exc}")
        return _finish(pull, runner, monitor, ModelPull.State.FAILED, message, "internal")
    return _register(pull, runner, monitor, pulled)


def _register(pull: ModelPull, runner: str, monitor: RowMonitor, pulled: PulledModel) -> ModelPull:
    ModelPull.objects.filter(pk=pull.pk, runner=runner).update(
        state=ModelPull.State.REGISTERING, heartbeat_at=timezone.now()
    )
    try:
        with transaction.atomic():
            if ModelEntry.objects.filter(name=pull.name).exists():
                raise PullError("exists", ERROR_NAME_TAKEN.format(name=pull.name))
            entry = model_register(name=pull.name, path=pulled.folder, kind=pull.kind)
            ModelEntry.objects.filter(pk=entry.pk).update(
                source=pull.source,
                source_revision=pulled.commit,
                quantization_bits=pulled.bits,
                quantization_group_size=pulled.group_size,
                size_on_disk_bytes=pulled.size_bytes,
            )
            ended = _finish(pull, runner, monitor, ModelPull.State.DONE, "", model=entry)
            if ended.runner != runner:
                raise PullAbandoned
            transaction.on_commit(registry_changed)
    except PullAbandoned:
        logger.warning("pull %s: no longer this runner's when registering", pull.pk)
        return ModelPull.objects.get(pk=pull.pk)
    except (PullError, ValueError) as exc:
        shutil.rmtree(pulled.folder, ignore_errors=True)
        code = getattr(exc, "code", "register_failed")
        return _finish(pull, runner, monitor, ModelPull.State.FAILED, str(exc), code)
    return ended


def _finish(
    pull: ModelPull,
    runner: str,
    monitor: RowMonitor,
    state: str,
    error: str,
    code: str = "",
    model: ModelEntry | None = None,
) -> ModelPull:
    if not connection.in_atomic_block:
        close_old_connections()  # a long download may have outlived the connection
    done = state == ModelPull.State.DONE
    ModelPull.objects.filter(pk=pull.pk, runner=runner).update(
        state=state,
        error=error,
        error_code=code,
        commit=monitor.commit,
        # A finished pull shows what it downloaded; one that stopped, where it stopped.
        done_bytes=(monitor.download_bytes or 0) if done else monitor.done,
        total_bytes=monitor.download_bytes if done else monitor.total,
        rate_bytes_per_s=None,
        heartbeat_at=timezone.now(),
        finished_at=timezone.now(),
        model=model,
    )
    return ModelPull.objects.get(pk=pull.pk)
