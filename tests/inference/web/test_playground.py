"""The playground page through Django's test client: a member is offered only the chat models
their keys allow, and the page's key endpoint refuses any other; the key it makes is shown to
the page once and ended by it."""

import re

import pytest
from django.test import Client
from django.urls import reverse

from accounts.models import ApiKey
from inference.models import ModelEntry
from tests.factories import ApiKeyFactory, ModelEntryFactory, TeamFactory

pytestmark = pytest.mark.django_db


@pytest.fixture
def member_key():
    for name in ("allowed", "forbidden"):
        ModelEntryFactory(name=name)
    ModelEntryFactory(name="encoder", kind=ModelEntry.Kind.EMBEDDING)
    return ApiKeyFactory(team=TeamFactory(), models=["allowed", "encoder"])


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def test_a_member_cannot_pick_a_model_none_of_their_keys_allows(member_key):
    client = signed_in(member_key.user)
    page = client.get(reverse("web-playground")).content.decode()
    offered = re.findall(r'<option value="([^"]+)"', page.split('id="pg-key"')[0])
    assert offered == ["allowed"]  # not the forbidden model, nor the embedding model

    for model in ("forbidden", "encoder"):
        refused = client.post(reverse("web-playground-key"), {"key": member_key.pk, "model": model})
        assert refused.status_code == 400
        assert model in refused.json()["error"]
    assert not ApiKey.objects.filter(parent=member_key).exists()

    made = client.post(reverse("web-playground-key"), {"key": member_key.pk, "model": "allowed"})
    assert made.status_code == 201 and made["Cache-Control"] == "no-store"
    assert made.json()["key"].startswith("sk-orch-")
    child = ApiKey.objects.get(parent=member_key)
    assert child.allowed_models == ["allowed"]

    # A key of another member cannot be spent, nor ended.
    stranger = signed_in(ApiKeyFactory(team=member_key.team).user)
    other = stranger.post(reverse("web-playground-key"), {"key": member_key.pk, "model": "allowed"})
    assert other.status_code == 400
    stranger.post(reverse("web-playground-key-end"), {"id": child.pk})
    assert ApiKey.objects.get(pk=child.pk).revoked_at is None

    ended = client.post(reverse("web-playground-key-end"), {"id": child.pk})
    assert ended.status_code == 204
    assert ApiKey.objects.get(pk=child.pk).revoked_at is not None
    # The playground's keys are not listed among the member's own keys.
    assert child.prefix not in client.get(reverse("web-keys")).content.decode()


def test_a_member_without_a_key_is_told_where_to_get_one():
    client = signed_in(ApiKeyFactory(team=TeamFactory()).user)
    ApiKey.objects.update(revoked_at="2020-01-01T00:00:00Z")
    page = client.get(reverse("web-playground")).content.decode()
    assert 'id="pg-no-keys"' in page and 'id="playground"' not in page
