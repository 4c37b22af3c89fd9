"""A scaled-out layout on this machine: `runengine` worker processes and a daphne web process
with ORCHARD_ENGINE=remote, meeting on the real Redis, sharing the test database. One layout
serves a whole test file: a test that ends a worker leaves the others serving, and a fixture
starts another only when a test needs more workers than are left."""

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from inference.workers.beats import BeatStore, WorkerBeat
from tests.fixtures.daphne import ROOT, free_port, server_env, start_daphne, stop_daphne
from tests.inference.conftest import TINY

REDIS_URL = "redis://127.0.0.1:6379/13"
HEARTBEAT_S = 0.2
# Above the pauses a worker's beats take while it loads models on a busy machine (docs/deploy.md).
TIMEOUT_S = 3.0
NAMES = ("wa", "wb", "wc", "wd", "we", "wf")


class Layout:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.namespace = f"test{uuid.uuid4().hex[:8]}"
        self.env = {
            **server_env(),
            "REDIS_URL": REDIS_URL,
            "ORCHARD_ENGINE": "remote",
            "ORCHARD_WORKER_NAMESPACE": self.namespace,
            "ORCHARD_WORKER_HEARTBEAT_SECONDS": str(HEARTBEAT_S),
            "ORCHARD_WORKER_TIMEOUT_SECONDS": str(TIMEOUT_S),
            # Between tests the test database is emptied and the same models registered again:
            # workers re-read the registry only when told (tests tell them where it matters).
            "ORCHARD_WORKER_SYNC_SECONDS": "3600",
            "PYTHONUNBUFFERED": "1",
        }
        self.store = BeatStore(REDIS_URL, self.namespace)
        self.workers: dict[str, subprocess.Popen] = {}  # every worker started, ended ones too
        self.model_filters: dict[str, list[str] | None] = {}  # each worker's --models
        self.web: subprocess.Popen | None = None
        self.url = ""

    def start_web(self) -> None:
        port = free_port()
        self.web = start_daphne(port=port, env=self.env, log_path=self.tmp / "web.log")
        self.url = f"http://127.0.0.1:{port}"

    def start_workers(self, count: int, *, models: list[str] | None = None) -> list[str]:
        """Start `count` workers side by side (given `models`, serving only those) and return
        their names once each beats."""
        names = [name for name in NAMES if name not in self.workers][:count]
        assert len(names) == count, "out of worker names"
        for name in names:
            args = ["--models", ",".join(models)] if models else []
            log = open(self.tmp / f"{name}.log", "ab")
            self.workers[name] = subprocess.Popen(
                [sys.executable, "manage.py", "runengine", "--worker-id", name, *args],
                cwd=ROOT,
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            log.close()
            self.model_filters[name] = models
        self.wait_for(lambda: set(names) <= self.beats().keys(), f"{names} to beat")
        return names

    def live(self, model: str | None = None) -> list[str]:
        """The workers whose processes run (and whose --models allow `model`)."""
        return sorted(
            name
            for name, process in self.workers.items()
            if process.poll() is None
            and (
                model is None
                or self.model_filters[name] is None
                or model in self.model_filters[name]
            )
        )

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(errors="replace")

    def beats(self) -> dict[str, WorkerBeat]:
        return {beat.worker_id: beat for beat in self.store.read_all_sync()}

    def serving(self, model: str) -> list[str]:
        return sorted(
            worker_id
            for worker_id, beat in self.beats().items()
            if model in beat.models and beat.models[model].state == "serving" and not beat.draining
        )

    def stats(self, worker: str, model: str) -> dict:
        beat = self.beats().get(worker)
        model_beat = beat.models.get(model) if beat else None
        return (model_beat.stats or {}) if model_beat else {}

    def settled(self, model: str) -> bool:
        """Every live worker that may serve `model` serves it, and none is loading anything
        (a spec the registry changed, say): no load's CPU or pauses in the beats fall on a test."""
        beats = self.beats()
        loading = [
            name
            for name in self.live()
            if name in beats
            for beat in beats[name].models.values()
            if beat.state == "loading" or beat.loading
        ]
        return self.serving(model) == self.live(model) and not loading

    def running(self, model: str) -> list[str]:
        """The live workers whose beats say they run a request of `model`."""
        return [w for w in self.live(model) if self.stats(w, model).get("num_running")]

    def wait_for(self, predicate, what: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n}\n{self.log(n)[-3000:]}" for n in self.workers)
                raise AssertionError(f"timed out waiting for {what}\n{logs}")
            time.sleep(0.05)

    def stop_all(self) -> None:
        for process in self.workers.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.workers.values():
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self.web is not None:
            stop_daphne(self.web)
        client = self.store._redis()
        for key in client.scan_iter(f"{self.namespace}*"):
            client.delete(key)
        self.store.close()


@pytest.fixture(scope="module")
def layout(django_db_setup, tmp_path_factory):
    """Two workers (wa, wb) serving every enabled model, and a web process routing to them."""
    layout = Layout(tmp_path_factory.mktemp("workers"))
    try:
        layout.start_workers(2)
        layout.start_web()
        yield layout
    finally:
        layout.stop_all()


@pytest.fixture
def served(layout, transactional_db, tiny_model_path):
    """The tiny model registered (the only chat model: a worker loads every enabled one), and at
    least two live workers, every one serving it."""
    from inference.services.registry import model_register

    model_register(name=TINY, path=tiny_model_path, make_default=True)
    if len(layout.live(TINY)) < 2:  # a test before this one ended a worker
        layout.start_workers(2 - len(layout.live(TINY)))
    if layout.serving(TINY) != layout.live(TINY):
        nudge(layout)
    layout.wait_for(lambda: layout.settled(TINY), "all to serve it")
    return TINY


@pytest.fixture
def embedded(layout, served, minilm_path):
    """all-MiniLM-L6-v2 registered beside the tiny model, and every worker it may go to serving
    it."""
    from engine.models.embeddings import DEFAULT_EMBEDDING_MODEL
    from inference.models import ModelEntry
    from inference.services.registry import model_register

    model_register(name=DEFAULT_EMBEDDING_MODEL, path=minilm_path, kind=ModelEntry.Kind.EMBEDDING)
    if layout.serving(DEFAULT_EMBEDDING_MODEL) != layout.live(DEFAULT_EMBEDDING_MODEL):
        nudge(layout)
    layout.wait_for(lambda: layout.settled(DEFAULT_EMBEDDING_MODEL), "all to embed")
    return DEFAULT_EMBEDDING_MODEL


def nudge(layout: Layout) -> None:
    """What an admin's change does: the workers read the registry now."""
    from asgiref.sync import async_to_sync
    from channels_redis.core import RedisChannelLayer

    from inference.workers.wire import registry_group

    channel_layer = RedisChannelLayer(hosts=[{"address": REDIS_URL, "socket_timeout": 15}])
    async_to_sync(channel_layer.group_send)(
        registry_group(layout.namespace), {"type": "registry.changed"}
    )
