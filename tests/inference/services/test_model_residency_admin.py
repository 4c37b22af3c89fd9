"""The admin's hold on models in the memory budget: the list shows each model's state, memory
and last use; "Pin" changes residency without a reload; "Unload" frees a model's memory and
"Load" brings it back, making room by unloading an idle model."""

import time

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from engine.cache.host import HostMemory, files_bytes
from engine.local import LocalEngineClient
from engine.text.processes import PoolSize
from engine.worker import EngineWorker
from inference.models import ModelEntry
from inference.services import engines
from inference.services.registry import model_register, model_spec

MIB = 1 << 20


@pytest.fixture
def budget_client(monkeypatch, tiny_model_path):
    """An in-process engine whose budget holds one tiny model, not two."""
    worker = EngineWorker(memory=HostMemory(files_bytes(tiny_model_path) + 400 * MIB))
    client = LocalEngineClient(worker, render=PoolSize(processes=1))
    monkeypatch.setattr(engines, "_client", client)
    yield client
    worker.shutdown(10)


def wait(predicate, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline
        time.sleep(0.05)


@pytest.mark.django_db
def test_pin_unload_and_load_from_the_model_list(
    budget_client, tiny_model_path, django_capture_on_commit_callbacks
):
    a = model_register(name="res-a", path=tiny_model_path)
    b = model_register(name="res-b", path=tiny_model_path)
    budget_client.worker.load(model_spec(a)).result(timeout=120)
    admin = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    web = Client()
    web.force_login(admin)

    def act(action: str, *entries: ModelEntry):
        with django_capture_on_commit_callbacks(execute=True):
            response = web.post(
                "/admin/inference/modelentry/",
                {"action": action, "_selected_action": [e.pk for e in entries], "index": 0},
            )
        assert response.status_code == 302

    page = web.get("/admin/inference/modelentry/").content.decode()
    assert ">loaded<" in page and ">unloaded<" in page and "Memory and use" in page

    engine = budget_client.worker.get("res-a")
    act("pin", a)
    assert ModelEntry.objects.get(pk=a.pk).pinned
    wait(lambda: budget_client.model_status("res-a").pinned)
    assert budget_client.worker.get("res-a") is engine  # no reload

    # Pinned, res-a does not make room: loading res-b from the admin fails, and says why.
    act("load", b)
    wait(lambda: budget_client.model_status("res-b").error is not None)
    change = web.get(f"/admin/inference/modelentry/{b.pk}/change/").content.decode()
    assert "memory budget has no room" in change

    act("unpin", a)
    wait(lambda: not budget_client.model_status("res-a").pinned)
    act("unload", a)
    wait(lambda: budget_client.model_status("res-a").state == "not_loaded")
    wait(lambda: budget_client.model_status("res-a").memory_bytes == 0)
    act("load", b)
    wait(lambda: budget_client.model_status("res-b").state == "serving")
    assert budget_client.model_status("res-b").error is None
    page = web.get("/admin/inference/modelentry/").content.decode()
    assert "MB; last request" in page  # res-b: its memory and use
