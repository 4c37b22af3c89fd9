"""Pages about models in a real Chromium, true to what the API does: the members' models page
shows the parser a reply goes through (or none), the context requests are checked against, the
weights and their size, and a failed load; the admin refuses a path that is no model folder."""

import json

import openai
import pytest

from accounts.models import Membership
from accounts.services import api_key_create
from inference.models import ModelEntry
from inference.services.registry import model_register
from tests.browser.test_admin_pages import admin_page  # noqa: F401  (a fixture)
from tests.browser.test_member_pages import account, shot, sign_in
from tests.fixtures.tiny_models import build_tiny_model

HI = [{"role": "user", "content": "Hi"}]
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}
# Columns of the models table.
STATUS, CONTEXT, TOOL_PARSER, REASONING_PARSER, WEIGHTS, SIZE = 2, 3, 5, 6, 7, 8


@pytest.fixture
def plain_model(tmp_path):
    """The tiny model with a chat template that shows no tool syntax: it has no tool parser."""
    folder = build_tiny_model(tmp_path / "plain", model_type="qwen3", tokenizer="qwen3")
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
    )
    config_file.write_text(json.dumps(config))
    return folder


def test_the_models_page_says_what_the_api_does(
    live_server_url, laptop, transactional_db, tiny_model_path, minilm_path, plain_model, tmp_path
):
    model_register(name="tiny-tools", path=tiny_model_path)
    model_register(name="tiny-plain", path=plain_model)
    model_register(name="minilm", path=minilm_path, kind=ModelEntry.Kind.EMBEDDING)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    model_register(name="tiny-broken", path=broken)
    user, team = account("nell", "truth-team", Membership.Role.MEMBER)
    _, raw_key = api_key_create(user=user, team=team)
    client = openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=raw_key, max_retries=0)
    # Each model asked once (the page itself never loads one).
    client.chat.completions.create(model="tiny-tools", messages=HI, max_tokens=1)
    client.embeddings.create(model="minilm", input="apples")
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny-plain", messages=HI, tools=[WEATHER], tool_choice="required"
        )
    assert "has no tool-call parser" in caught.value.message
    with pytest.raises(openai.InternalServerError):
        client.chat.completions.create(model="tiny-broken", messages=HI, max_tokens=1)

    sign_in(laptop, live_server_url, "nell")
    laptop.goto(f"{live_server_url}/models/")
    shot(laptop, "models-page")

    def cells(name: str) -> list[str]:
        row = laptop.locator("table.data tbody tr", has=laptop.locator(f"code:text-is('{name}')"))
        return row.locator("td").all_inner_texts()

    tools, plain, encoder = cells("tiny-tools"), cells("tiny-plain"), cells("minilm")
    assert [tools[i] for i in (STATUS, CONTEXT, TOOL_PARSER, REASONING_PARSER, WEIGHTS)] == [
        "loaded",
        "4096",
        "hermes",
        "qwen3",
        "float32",
    ]
    assert [plain[i] for i in (TOOL_PARSER, REASONING_PARSER)] == ["none", "none"]
    # The embedding model: the 256 tokens the API takes, not its 512 positions; no parsers.
    assert [encoder[i] for i in (STATUS, CONTEXT, TOOL_PARSER, REASONING_PARSER)] == [
        "loaded",
        "256",
        "—",
        "—",
    ]
    on_disk, _, in_memory = encoder[SIZE].partition(" · ")
    assert on_disk.endswith("MB") and in_memory.endswith("in use (weights and caches)")
    # A chat model's caches and their budget: weights plus what the caches hold now.
    assert "in use (weights and caches; caches' budget" in tools[SIZE]
    assert cells("tiny-broken")[STATUS] == "load failed"


def test_the_admin_refuses_a_path_that_is_no_model_folder(
    admin_page,  # noqa: F811
    live_server_url,
    tiny_model_path,
    tmp_path,
):
    page = admin_page
    page.goto(f"{live_server_url}/admin/inference/modelentry/add/")
    page.fill("#id_name", "typo")
    page.fill("#id_path", str(tmp_path / "no-such-model"))
    page.click("input[name=_save]")
    error = page.locator(".field-path .errorlist").inner_text()
    assert "does not exist on this server" in error
    assert not ModelEntry.objects.filter(name="typo").exists()
    # The same form with a real model folder is valid and saves (checked in this process: a
    # browser save writes an admin log entry, whose content type ids the live server cached
    # before an earlier test's flush re-created them).
    from django.contrib import admin

    model_admin = admin.site._registry[ModelEntry]
    from django.contrib.auth import get_user_model
    from django.test import RequestFactory

    request = RequestFactory().get("/admin/inference/modelentry/add/")
    request.user = get_user_model().objects.get(username="root")
    form_class = model_admin.get_form(request, None)
    initial = {
        field: page.locator(f"#id_{field}").input_value() for field in ("name", "engine", "kind")
    }
    numbers = (
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_waiting",
        "speculative_tokens",
        "kv_cache_group_size",
    )
    initial |= {field: page.locator(f"#id_{field}").input_value() for field in numbers}
    form = form_class(data={**initial, "path": str(tiny_model_path), "enabled": "on"})
    assert form.is_valid(), form.errors
    form.save()
    assert ModelEntry.objects.get(name="typo").path == str(tiny_model_path.resolve())
