"""The admin index's "Engine workers" panel: a line in local mode, one row per live worker in
remote mode (from the workers' beats, worker-supplied text escaped), and a message instead of an
error page when the workers cannot be read."""

import re
import time

import pytest
from django.test import Client
from django.urls import reverse

from inference.services import engines
from inference.workers.beats import BeatStore, ModelBeat, WorkerBeat
from tests.factories import StaffUserFactory
from tests.fixtures.daphne import free_port

pytestmark = pytest.mark.django_db
HOSTILE = "<script>x</script>"


class FakeWorkers:
    """Stands in for the RemoteEngineClient: only `.workers()` is read."""

    def __init__(self, beats=None, error=None):
        self.beats = beats or []
        self.error = error

    def workers(self):
        if self.error:
            raise self.error
        return list(self.beats)


def two_workers() -> list[WorkerBeat]:
    now = time.time()
    stats = {
        "model": "qwen3-8b",
        "num_waiting": 7,
        "num_running": 3,
        "tokens_per_second": 41.25,
        "prefix_cache": {"bytes": 12_500_000, "max_bytes": 250_000_000, "hits": 4, "lookups": 9},
    }
    serving = WorkerBeat(
        worker_id="mac1-a",
        host="mac1",
        pid=4242,
        started_at=now - 60,
        at=now - 0.5,
        seq=60,
        model_filter=["qwen3-8b"],
        models={
            "qwen3-8b": ModelBeat(
                name="qwen3-8b",
                state="serving",
                spec={"name": "qwen3-8b"},
                stats=stats,
                restarts=2,
                memory_bytes=9_000_000_000,
            )
        },
        memory_max_bytes=48_000_000_000,
        memory_used_bytes=9_000_000_000,
    )
    draining = WorkerBeat(
        worker_id="gpu2-b",
        host=HOSTILE,
        pid=77,
        started_at=now - 30,
        at=now - 1.0,
        seq=30,
        draining=True,
        models={
            "gemma-3-4b": ModelBeat(
                name="gemma-3-4b", state="failed", error="out of memory <b>boom</b>"
            )
        },
    )
    return [serving, draining]


def admin_index() -> tuple[int, str]:
    client = Client()
    client.force_login(StaffUserFactory())
    response = client.get(reverse("admin:index"))
    return response.status_code, response.content.decode()


def panel(page: str) -> str:
    start = page.index('id="orchard-workers"')
    return page[start : page.index("</div>", start)]


def test_local_mode_says_the_engines_run_in_the_web_processes(settings):
    settings.ORCHARD_ENGINE = "local"
    status, page = admin_index()
    assert status == 200
    text = panel(page)
    assert "Engine workers" in text
    assert "engines run inside the web processes (ORCHARD_ENGINE=local)" in text
    assert "each web process has its own" in text
    assert "<table" not in text


def test_the_panel_adds_no_inline_script(settings, monkeypatch):
    settings.ORCHARD_ENGINE = "remote"
    monkeypatch.setattr(engines, "_client", FakeWorkers(two_workers()))
    status, page = admin_index()
    assert status == 200 and not re.search(r"<script(?![^>]*\bsrc=)[^>]*>", page)


def test_remote_mode_shows_each_worker_and_escapes_what_workers_send(settings, monkeypatch):
    settings.ORCHARD_ENGINE = "remote"
    made_at = time.time()
    monkeypatch.setattr(engines, "_client", FakeWorkers(two_workers()))
    status, page = admin_index()
    rendered_in = time.time() - made_at
    assert status == 200
    text = panel(page)
    assert "<code>mac1-a</code>" in text and "<code>gpu2-b</code>" in text
    assert "<td>4242</td>" in text and "<td>77</td>" in text
    assert "<td>serving</td>" in text and "<td>draining</td>" in text
    assert text.count("<td>qwen3-8b</td>") == 2  # its --models filter, and the model
    assert "all enabled" in text  # the worker without a filter
    # The model's queue, running sequences, tokens/s, prefix cache and restarts.
    assert "<td>7</td>" in text and "<td>3</td>" in text
    assert "<td>41.2</td>" in text or "<td>41.3</td>" in text
    assert "12.5 of 250.0 MB" in text and "<td>2</td>" in text
    # The worker's memory budget and what the model holds in it; no budget on the other.
    assert "<td>9,000 of 48,000 MB</td>" in text and "<td>9,000 MB</td>" in text
    assert "<td>0 MB (no budget)</td>" in text
    assert "failed" in text and "<td>off</td>" in text
    # Each beat's age when the page was made: the serving worker's beat was 0.5 s old when
    # the test built it, and the page took `rendered_in` more (a busy machine: a while).
    ages = sorted(float(age) for age in re.findall(r"<td>([0-9.]+) s ago</td>", text))
    assert len(ages) == 2
    assert 0.45 <= ages[0] <= 0.55 + rendered_in, (ages, rendered_in)
    assert 0.95 <= ages[1] <= 1.05 + rendered_in, (ages, rendered_in)
    # Worker-supplied text is escaped, never markup.
    assert HOSTILE not in page and "<b>boom</b>" not in page
    assert "&lt;script&gt;x&lt;/script&gt;" in text
    assert "out of memory &lt;b&gt;boom&lt;/b&gt;" in text


def test_remote_mode_without_workers_says_none_is_beating(settings, monkeypatch):
    settings.ORCHARD_ENGINE = "remote"
    monkeypatch.setattr(engines, "_client", FakeWorkers([]))
    status, page = admin_index()
    assert status == 200 and "No engine worker is beating." in panel(page)


def test_workers_that_cannot_be_read_show_a_message_not_an_error_page(settings, monkeypatch):
    settings.ORCHARD_ENGINE = "remote"
    error = ConnectionError(f"Redis is down {HOSTILE}")
    monkeypatch.setattr(engines, "_client", FakeWorkers(error=error))
    status, page = admin_index()
    assert status == 200
    text = panel(page)
    assert "Engine workers unavailable: ConnectionError: Redis is down" in text
    assert HOSTILE not in page
    assert 'id="orchard-today"' in page  # the rest of the index still renders


def test_an_engine_client_that_cannot_be_made_shows_the_message(settings, monkeypatch):
    settings.ORCHARD_ENGINE = "remote"

    def broken():
        raise RuntimeError("no channel layer")

    monkeypatch.setattr(engines, "get_engine_client", broken)
    status, page = admin_index()
    assert status == 200
    assert "Engine workers unavailable: RuntimeError: no channel layer" in panel(page)


def test_a_real_remote_client_with_redis_down_shows_the_message(settings, monkeypatch):
    from inference.workers.client import RemoteEngineClient

    settings.ORCHARD_ENGINE = "remote"
    store = BeatStore(f"redis://127.0.0.1:{free_port()}/0", "orchard-test-admin")
    remote = RemoteEngineClient(store=store, namespace="orchard-test-admin")
    monkeypatch.setattr(engines, "_client", remote)
    try:
        status, page = admin_index()
    finally:
        store.close()
    assert status == 200
    assert "Engine workers unavailable: ConnectionError" in panel(page)
