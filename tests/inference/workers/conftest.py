"""A scaled-out layout on this machine: `runengine` worker processes and a daphne web process
with ORCHARD_ENGINE=remote, meeting on the real Redis, sharing the test database."""

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from inference.workers.beats import BeatStore, WorkerBeat
from tests.fixtures.daphne import ROOT, free_port, server_env, start_daphne, stop_daphne

REDIS_URL = "redis://127.0.0.1:6379/13"
HEARTBEAT_S = 0.2
# Above the pauses a worker's beats take while it loads models on a busy machine (docs/deploy.md).
TIMEOUT_S = 3.0


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
        self.workers: dict[str, subprocess.Popen] = {}
        self.web: subprocess.Popen | None = None
        self.url = ""

    def start_web(self) -> None:
        port = free_port()
        self.web = start_daphne(port=port, env=self.env, log_path=self.tmp / "web.log")
        self.url = f"http://127.0.0.1:{port}"

    def start_worker(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "ab")
        process = subprocess.Popen(
            [sys.executable, "manage.py", "runengine", "--worker-id", name, *args],
            cwd=ROOT,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        self.workers[name] = process
        self.wait_for(lambda: name in self.beats(), f"worker {name} to beat")
        return process

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
        layout.start_worker("wa")
        layout.start_worker("wb")
        layout.start_web()
        yield layout
    finally:
        layout.stop_all()


@pytest.fixture
def served(layout, tiny_models):
    """The tiny models registered, and both workers serving the batched one."""
    if layout.serving(tiny_models[0]) != ["wa", "wb"]:
        nudge(layout)
        layout.wait_for(lambda: layout.serving(tiny_models[0]) == ["wa", "wb"], "both to serve")
    return tiny_models


@pytest.fixture
def embedded(layout, served, minilm_path):
    """all-MiniLM-L6-v2 registered beside the tiny models, and both workers serving it."""
    from engine.models.embeddings import DEFAULT_EMBEDDING_MODEL
    from inference.models import ModelEntry
    from inference.services.registry import model_register

    model_register(name=DEFAULT_EMBEDDING_MODEL, path=minilm_path, kind=ModelEntry.Kind.EMBEDDING)
    if layout.serving(DEFAULT_EMBEDDING_MODEL) != ["wa", "wb"]:
        nudge(layout)
        layout.wait_for(
            lambda: layout.serving(DEFAULT_EMBEDDING_MODEL) == ["wa", "wb"], "both to embed"
        )
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


def is_gone(process: subprocess.Popen) -> bool:
    return process.poll() is not None
