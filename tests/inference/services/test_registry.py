"""Registry entries: default sampling values are checked when an admin saves them."""

import pytest
from django.core.exceptions import ValidationError

from inference.models import ERROR_DEFAULT_OVER_CEILING
from inference.services.registry import model_folder_problem, model_for_key, model_register


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
    entry.default_sampling = {"temperature": 0.2, "top_p": 0.9, "top_k": 40}
    entry.default_max_tokens, entry.max_output_tokens = 256, 256
    entry.full_clean()


@pytest.mark.django_db
def test_a_default_output_size_over_the_ceiling_is_refused(tiny_model_path):
    entry = model_register(name="m", path=tiny_model_path)
    entry.default_max_tokens, entry.max_output_tokens = 512, 100
    with pytest.raises(ValidationError) as caught:
        entry.full_clean()
    assert caught.value.message_dict["default_max_tokens"] == [
        ERROR_DEFAULT_OVER_CEILING.format(100)
    ]


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


@pytest.mark.django_db
def test_a_draft_model_reaches_the_engine_spec_and_is_checked(tiny_model_path, tmp_path):
    from django.core.management import call_command
    from django.core.management.base import CommandError

    from inference.models import ModelEntry
    from inference.services.registry import model_spec

    draft = model_register(name="small", path=tiny_model_path)
    entry = model_register(name="big", path=tiny_model_path, draft_model="small")
    assert model_spec(entry).draft_path == draft.path
    assert model_spec(draft).draft_path is None
    # The selectors the API uses bring the draft model along (no query from async code).
    key_entry = ModelEntry.objects.filter(name="big").select_related("draft_model").get()
    assert model_spec(key_entry).draft_path == draft.path

    with pytest.raises(ValueError, match="No registered model"):
        model_register(name="big", path=tiny_model_path, draft_model="missing")
    with pytest.raises(ValueError, match="its own draft model"):
        model_register(name="small", path=tiny_model_path, draft_model="small")
    embedder = model_register(name="embedder", path=tiny_model_path, kind="embedding")
    with pytest.raises(ValueError, match="must be a chat model"):
        model_register(name="big", path=tiny_model_path, draft_model="embedder")
    embedder.draft_model = draft
    with pytest.raises(ValidationError) as caught:
        embedder.full_clean()
    assert "draft_model" in caught.value.message_dict

    call_command("register_model", "other", tiny_model_path, "--draft-model", "big")
    assert ModelEntry.objects.get(name="other").draft_model.name == "big"
    with pytest.raises(CommandError, match="No registered model"):
        call_command("register_model", "other", tiny_model_path, "--draft-model", "nope")
    # Deleting the draft model leaves the models it drafted for without one.
    draft.delete()
    assert ModelEntry.objects.get(name="big").draft_model is None


@pytest.mark.django_db
def test_prefix_cache_shared_is_set_in_the_admin_and_reloads_nothing(admin_client, tiny_model_path):
    from inference.models import ModelEntry
    from inference.services.registry import model_spec

    entry = model_register(name="m", path=tiny_model_path)
    spec = model_spec(entry)
    url = f"/admin/inference/modelentry/{entry.pk}/change/"
    assert 'name="prefix_cache_shared"' in admin_client.get(url).content.decode()
    form = {
        "name": "m",
        "path": entry.path,
        "kind": entry.kind,
        "engine": entry.engine,
        "enabled": "on",
        "max_num_seqs": entry.max_num_seqs,
        "max_num_batched_tokens": entry.max_num_batched_tokens,
        "max_waiting": entry.max_waiting,
        "speculative_tokens": entry.speculative_tokens,
        "kv_cache_group_size": 64,
        "default_sampling": "{}",
        "prefix_cache_shared": "on",
    }
    response = admin_client.post(url, form)
    assert response.status_code == 302, response.content.decode()[:2000]
    entry = ModelEntry.objects.get(pk=entry.pk)
    assert entry.prefix_cache_shared
    # It scopes requests, not the engine: the serving engine keeps its spec (no reload).
    assert model_spec(entry) == spec
    # A quantized KV cache is the engine's: its spec changes (the model reloads with it).
    assert 'name="kv_cache_bits"' in admin_client.get(url).content.decode()
    response = admin_client.post(url, {**form, "kv_cache_bits": "4", "kv_cache_group_size": "32"})
    assert response.status_code == 302, response.content.decode()[:2000]
    quantized = model_spec(ModelEntry.objects.get(pk=entry.pk))
    assert (quantized.kv_cache_bits, quantized.kv_cache_group_size) == (4, 32)
    assert quantized != spec
    refused = admin_client.post(url, {**form, "kv_cache_bits": "3"})
    assert refused.status_code == 200 and "Select a valid choice" in refused.content.decode()


def test_only_a_model_folder_of_its_kind_is_registered(tiny_model_path, minilm_path, tmp_path):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    assert model_folder_problem(tiny_model_path, kind="chat") is None
    assert model_folder_problem(minilm_path, kind="embedding") is None
    assert "does not exist" in model_folder_problem(tmp_path / "nowhere", kind="chat")
    assert "manage.py import_gguf" in model_folder_problem(gguf, kind="chat")
    assert "no config.json" in model_folder_problem(tmp_path, kind="chat")
    (tmp_path / "config.json").write_text("{}")
    assert "no tokenizer.json" in model_folder_problem(tmp_path, kind="embedding")


@pytest.mark.django_db
def test_the_flex_tiers_yield_share_reaches_every_engines_spec(settings, tiny_model_path):
    from inference.services.registry import model_spec

    entry = model_register(name="m", path=tiny_model_path)
    assert model_spec(entry).flex_yield_share == 0.25
    settings.ORCHARD_FLEX_YIELD_SHARE = 1.0
    assert model_spec(entry).flex_yield_share == 1.0
