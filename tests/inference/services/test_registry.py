"""Registry entries: default sampling values are checked when an admin saves them."""

import pytest
from django.core.exceptions import ValidationError

from inference.services.registry import model_for_key, model_register


@pytest.mark.django_db
@pytest.mark.parametrize(
    "defaults",
    [
        {"temperature": "hot"},
        {"temperature": 5},
        {"top_k": 1.5},
        {"max_tokens": 0},
        {"sampler": 1},
        {"top_p": True},
        ["temperature"],
    ],
)
def test_bad_default_sampling_is_refused(tiny_model_path, defaults):
    entry = model_register(name="m", path=tiny_model_path)
    entry.default_sampling = defaults
    with pytest.raises(ValidationError) as caught:
        entry.full_clean()
    assert "default_sampling" in caught.value.message_dict


@pytest.mark.django_db
def test_good_default_sampling_is_accepted(tiny_model_path):
    entry = model_register(name="m", path=tiny_model_path)
    entry.default_sampling = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "max_tokens": 256}
    entry.full_clean()


@pytest.mark.django_db
def test_the_default_model_cannot_be_disabled(tiny_model_path):
    entry = model_register(name="m", path=tiny_model_path)
    assert entry.is_default
    entry.enabled = False
    with pytest.raises(ValidationError) as caught:
        entry.full_clean()
    assert "enabled" in caught.value.message_dict


@pytest.mark.django_db
def test_admin_disable_skips_the_default_and_make_default_needs_an_enabled_model(
    admin_client, tiny_model_path
):
    from inference.models import ModelEntry

    default = model_register(name="a", path=tiny_model_path)
    other = model_register(name="b", path=tiny_model_path)
    url = "/admin/inference/modelentry/"
    admin_client.post(url, {"action": "disable", "_selected_action": [default.pk, other.pk]})
    assert ModelEntry.objects.get(pk=default.pk).enabled
    assert not ModelEntry.objects.get(pk=other.pk).enabled
    admin_client.post(url, {"action": "make_default", "_selected_action": [other.pk]})
    assert ModelEntry.objects.get(pk=default.pk).is_default


@pytest.mark.django_db
def test_odd_model_names_match_nothing_without_asking_the_database(
    django_assert_num_queries, tiny_model_path
):
    from tests.factories import ApiKeyFactory

    model_register(name="m", path=tiny_model_path)
    api_key = ApiKeyFactory()
    for name in ("m\x00", "\x00", "", "m" * 101):
        with django_assert_num_queries(0):
            assert model_for_key(api_key, name) is None
    assert model_for_key(api_key, "m").name == "m"
