"""Registry entries: default sampling values are checked when an admin saves them."""

import pytest
from django.core.exceptions import ValidationError

from inference.registry import model_register


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
