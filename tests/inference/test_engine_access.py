"""The web process's engine: enabled models start loading at start-up, without blocking it."""

import pytest

from engine.local import LocalEngineClient
from inference import engine_access
from inference.models import ModelEntry
from inference.services.registry import model_register, model_spec


@pytest.fixture
def fresh_client(monkeypatch):
    client = LocalEngineClient()
    monkeypatch.setattr(engine_access, "_client", client)
    yield client
    client.worker.shutdown(10)


@pytest.mark.django_db
def test_preload_starts_loading_enabled_models_only(fresh_client, tiny_model_path):
    enabled = model_register(name="pre", path=tiny_model_path)
    model_register(name="off", path=tiny_model_path)
    ModelEntry.objects.filter(name="off").update(enabled=False)
    engine_access.preload_models()
    # The same spec returns the load already under way; it finishes with the model's info.
    info = fresh_client.worker.load(model_spec(enabled)).result(timeout=120)
    assert info.name == "pre"
    assert [s.model for s in fresh_client.worker.stats()] == ["pre"]


@pytest.mark.django_db
def test_preload_survives_a_model_that_cannot_load(fresh_client, tiny_model_path, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    model_register(name="broken", path=broken)
    engine_access.preload_models()  # logs, does not raise
    with pytest.raises(Exception):  # noqa: B017 (whatever the loader raised)
        fresh_client.worker.load(model_spec(ModelEntry.objects.get(name="broken"))).result(60)
