"""GET /v1/models and /v1/models/{id}: only what the key may use, and can load."""

import openai
import pytest

from inference.models import ModelEntry
from inference.services.registry import model_register
from tests.inference.conftest import TINY, TINY_SIMPLE


def test_list_shows_enabled_models(client):
    models = client.models.list()
    assert sorted(m.id for m in models.data) == sorted([TINY, TINY_SIMPLE])
    assert all(m.object == "model" and m.owned_by == "orchard" for m in models.data)


def test_disabled_model_disappears(client):
    ModelEntry.objects.filter(name=TINY_SIMPLE).update(enabled=False)
    assert [m.id for m in client.models.list().data] == [TINY]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(TINY_SIMPLE)


def test_scoped_key_sees_only_its_models(live_server_url, make_key, tiny_models):
    key = make_key(username="carol", team="team-c", models=[TINY])
    client = openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=key, max_retries=0)
    assert [m.id for m in client.models.list().data] == [TINY]
    assert client.models.retrieve(TINY).id == TINY
    with pytest.raises(openai.NotFoundError) as caught:
        client.models.retrieve(TINY_SIMPLE)
    assert caught.value.code == "model_not_found"


def test_a_model_that_failed_to_load_is_not_offered(client, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    model_register(name="broken-model", path=broken)
    assert "broken-model" in [m.id for m in client.models.list().data]  # not tried yet
    with pytest.raises(openai.InternalServerError) as caught:
        client.chat.completions.create(
            model="broken-model", messages=[{"role": "user", "content": "Hi"}], max_tokens=1
        )
    assert caught.value.code == "model_load_failed"
    assert "administrator" in caught.value.message
    assert sorted(m.id for m in client.models.list().data) == sorted([TINY, TINY_SIMPLE])
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("broken-model")
