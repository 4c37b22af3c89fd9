"""The web process's engine: enabled models, chat and embedding, start loading at start-up,
without blocking it."""

import shutil
import time

import pytest
from django.contrib import admin

from engine import ModelLoadError
from engine.local import LocalEngineClient
from inference.models import ModelEntry
from inference.services import engines
from inference.services.registry import model_register, model_spec


@pytest.fixture
def fresh_client(monkeypatch):
    client = LocalEngineClient()
    monkeypatch.setattr(engines, "_client", client)
    yield client
    client.worker.shutdown(10)


@pytest.mark.django_db
def test_preload_starts_loading_enabled_models_only(fresh_client, tiny_model_path, minilm_path):
    enabled = model_register(name="pre", path=tiny_model_path)
    model_register(name="off", path=tiny_model_path)
    ModelEntry.objects.filter(name="off").update(enabled=False)
    encoder = model_register(name="minilm", path=minilm_path, kind=ModelEntry.Kind.EMBEDDING)
    engines.preload_models()
    # The same spec returns the load already under way; it finishes with the model's info.
    info = fresh_client.worker.load(model_spec(enabled)).result(timeout=120)
    assert info.name == "pre"
    # Embedding models load in the same worker, and the admin reads their state from it.
    assert fresh_client.worker.load(model_spec(encoder)).result(timeout=120).dimensions == 384
    assert sorted(s.model for s in fresh_client.worker.stats()) == ["minilm", "pre"]
    assert admin.site._registry[ModelEntry].status(encoder) == "loaded"


@pytest.mark.django_db
def test_preload_survives_a_model_that_cannot_load(fresh_client, tiny_model_path, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    model_register(name="broken", path=broken)
    engines.preload_models()  # logs, does not raise
    with pytest.raises(Exception):  # noqa: B017 (whatever the loader raised)
        fresh_client.worker.load(model_spec(ModelEntry.objects.get(name="broken"))).result(60)


@pytest.mark.django_db
def test_admin_changes_reach_the_engine_without_a_restart(
    fresh_client, tiny_model_path, django_capture_on_commit_callbacks
):
    from django.contrib.auth import get_user_model
    from django.test import Client

    client = Client()

    entry = model_register(name="live", path=tiny_model_path)
    ModelEntry.objects.filter(pk=entry.pk).update(is_default=False)  # the default stays enabled
    fresh_client.worker.load(model_spec(entry)).result(timeout=120)
    admin = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(admin)
    form = {
        "name": "live",
        "path": entry.path,
        "kind": entry.kind,
        "engine": entry.engine,
        "enabled": "on",
        "max_num_seqs": 3,
        "max_num_batched_tokens": entry.max_num_batched_tokens,
        "max_waiting": entry.max_waiting,
        "speculative_tokens": 2,
        "kv_cache_group_size": 64,
        "default_sampling": "{}",
    }
    with django_capture_on_commit_callbacks(execute=True):
        response = client.post(f"/admin/inference/modelentry/{entry.pk}/change/", form)
    assert response.status_code == 302, response.content.decode()[:2000]
    # The new batch size loads beside the serving engine: no restart, no request waits.
    deadline = time.monotonic() + 60
    while (serving := fresh_client.model_status("live").serving).max_num_seqs != 3 or (
        serving.speculative_tokens != 2
    ):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # Disabling it in the admin retires its engine.
    with django_capture_on_commit_callbacks(execute=True):
        client.post(
            "/admin/inference/modelentry/",
            {"action": "disable", "_selected_action": [entry.pk], "index": 0},
        )
    assert not ModelEntry.objects.get(name="live").enabled
    assert fresh_client.model_status("live").state == "not_loaded"


@pytest.mark.django_db
def test_the_admins_reload_retries_a_failed_embedding_model_at_once(
    fresh_client, minilm_path, tmp_path
):
    from django.contrib.auth import get_user_model
    from django.test import Client

    folder = tmp_path / "encoder"
    shutil.copytree(minilm_path, folder)
    weights = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(b"not weights")
    entry = model_register(name="encoder", path=folder, kind=ModelEntry.Kind.EMBEDDING)
    with pytest.raises(ModelLoadError):
        fresh_client.worker.load(model_spec(entry)).result(timeout=60)
    assert fresh_client.model_status("encoder").state == "failed"
    (folder / "model.safetensors").write_bytes(weights)  # the admin fixed the files
    client = Client()
    client.force_login(get_user_model().objects.create_superuser("root", "r@example.com", "pw"))
    client.post(
        "/admin/inference/modelentry/",
        {"action": "reload", "_selected_action": [entry.pk], "index": 0},
    )
    deadline = time.monotonic() + 60
    while fresh_client.model_status("encoder").state != "serving":
        assert time.monotonic() < deadline, fresh_client.model_status("encoder")
        time.sleep(0.05)
