"""A model registered with a draft model, through the API: the engine loads the draft model
beside it, drafts with it, and the replies are the ones the model gives without it."""

from django.contrib.auth import get_user_model

from inference.services.registry import model_register
from tests.inference.api.test_metrics import scrape, value
from tests.inference.conftest import TINY

DRAFTED = "tiny-drafted"


def test_a_model_with_a_draft_model_replies_as_without_it(
    live_server_url, tiny_models, tiny_model_path, make_key, client
):
    # The served model drafting for itself: every draft is right, so drafts are kept.
    model_register(name=DRAFTED, path=tiny_model_path, draft_model=TINY)
    staff = make_key("ops", "ops-team")
    get_user_model().objects.filter(username="ops").update(is_staff=True)
    messages = [{"role": "user", "content": "Count to ten, slowly."}]
    ask = {"messages": messages, "temperature": 0, "max_tokens": 24}
    extra = {"ignore_eos": True}
    plain = client.chat.completions.create(model=TINY, **ask, extra_body=extra)
    drafted = client.chat.completions.create(model=DRAFTED, **ask, extra_body=extra)
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    assert drafted.usage.completion_tokens == 24
    samples = scrape(live_server_url, staff)
    checked = value(samples, "orchard_speculative_draft_tokens_total", model=DRAFTED)
    kept = value(samples, "orchard_speculative_accepted_tokens_total", model=DRAFTED)
    assert checked > 0 and kept == checked
