"""The admin's lists, in a real browser at laptop width (1366 px): every column on screen, no
two columns with one heading; the model list says what the engine serves and why it failed."""

import datetime

import openai
import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from inference.models import ModelEntry, UsageRecord
from inference.services.registry import model_register
from inference.services.usage import usage_finish, usage_open
from tests.factories import ApiKeyFactory, api_key_with_raw

PASSWORD = "a-long-test-password"
LISTS = [
    "/admin/inference/usagerecord/",
    "/admin/inference/dailyusage/",
    "/admin/inference/modelentry/",
    "/admin/accounts/apikey/",
]


@pytest.fixture
def admin_page(live_server_url, laptop, transactional_db):
    get_user_model().objects.create_superuser("root", "root@example.com", PASSWORD)
    laptop.goto(f"{live_server_url}/admin/login/")
    laptop.fill("#id_username", "root")
    laptop.fill("#id_password", PASSWORD)
    laptop.click("input[type=submit]")
    laptop.wait_for_url(f"{live_server_url}/admin/")
    return laptop


def realistic_usage(tiny_model_path):
    """Rows as the server writes them: long request ids and model names, big counts, errors."""
    model_register(name="smollm2-135m-instruct-f32", path=tiny_model_path)
    api_key = ApiKeyFactory(rpm=600, tpm=1_000_000, max_parallel=8, budget_tokens=50_000_000)
    for index, (status, error) in enumerate(
        [
            ("completed", ""),
            ("cancelled", "client_disconnected"),
            ("failed", "engine_error"),
            ("completed", ""),
        ]
    ):
        record = usage_open(
            request_id=f"req_{index:032x}",
            api_key=api_key,
            model="smollm2-135m-instruct-f32",
            endpoint="chat.completions",
            reserved_tokens=8192,
        )
        usage_finish(
            record_id=record.pk,
            status=status,
            prompt_tokens=12_345,
            cached_tokens=4_096,
            completion_tokens=1_234,
            time_to_first_token_ms=250,
            error_code=error,
        )
    UsageRecord.objects.update(started_at=timezone.now() - datetime.timedelta(minutes=5))


@pytest.mark.parametrize("path", LISTS)
def test_admin_lists_fit_a_laptop_screen(admin_page, live_server_url, tiny_model_path, path):
    realistic_usage(tiny_model_path)
    admin_page.goto(f"{live_server_url}{path}")
    results = admin_page.locator("#changelist .results")
    assert results.count() == 1, "the list has rows"
    overflow = results.evaluate("el => el.scrollWidth - el.clientWidth")
    assert overflow <= 0, f"{path}: the table is {overflow} px wider than its box"
    table = results.locator("table").bounding_box()
    assert table["x"] + table["width"] <= 1366
    headers = [
        h.strip().lower() for h in admin_page.locator("#result_list thead th").all_inner_texts()
    ]
    named = [h for h in headers if h]
    assert len(named) == len(set(named)), f"{path}: repeated headings {headers}"


def test_the_key_list_heads_models_and_limits_once_each(admin_page, live_server_url):
    ApiKeyFactory(rpm=60, models=["a", "b"])
    admin_page.goto(f"{live_server_url}/admin/accounts/apikey/")
    headers = [
        h.strip().lower() for h in admin_page.locator("#result_list thead th").all_inner_texts()
    ]
    assert headers.count("models") == 1 and headers.count("limits") == 1
    row = admin_page.locator("#result_list tbody tr").first.inner_text()
    assert "a, b" in row and "rpm 60" in row


def test_the_model_list_shows_the_models_own_context_length(
    admin_page, live_server_url, tiny_model_path
):
    model_register(name="own-context", path=tiny_model_path)  # context_length left empty
    admin_page.goto(f"{live_server_url}/admin/inference/modelentry/")
    row = admin_page.locator("#result_list tbody tr", has_text="own-context").inner_text()
    assert "4,096 (model's own)" in row
    assert ModelEntry.objects.get(name="own-context").context_length is None


def openai_client(live_server_url) -> openai.OpenAI:
    _, raw = api_key_with_raw()
    return openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=raw, max_retries=0)


def test_a_broken_reload_keeps_serving_and_the_admin_shows_why(
    admin_page, live_server_url, tiny_model_path, tmp_path
):
    client = openai_client(live_server_url)
    entry = model_register(name="reloaded", path=tiny_model_path)
    ask = {"model": "reloaded", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert client.chat.completions.create(**ask).choices[0].finish_reason == "length"

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    ModelEntry.objects.filter(pk=entry.pk).update(path=str(broken))
    # The old engine answers while (and after) the new path fails to load.
    for _ in range(3):
        assert client.chat.completions.create(**ask).choices[0].finish_reason == "length"

    admin_page.goto(f"{live_server_url}/admin/inference/modelentry/")
    row = admin_page.locator("#result_list tbody tr", has_text="reloaded")
    for _ in range(50):  # the failed load is reported by the engine thread
        if "last reload failed" in row.inner_text():
            break
        admin_page.wait_for_timeout(100)
        admin_page.reload()
    assert "loaded, last reload failed" in row.inner_text()
    admin_page.goto(f"{live_server_url}/admin/inference/modelentry/{entry.pk}/change/")
    error = admin_page.locator(".field-load_error .readonly").inner_text()
    assert "No safetensors found" in error and str(broken) in error


def test_a_model_that_cannot_load_is_a_503_and_the_admin_says_so(
    admin_page, live_server_url, tmp_path
):
    broken = tmp_path / "never"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "no_such_architecture"}')
    model_register(name="never-loads", path=broken)
    client = openai_client(live_server_url)
    for _ in range(2):
        with pytest.raises(openai.InternalServerError) as caught:
            client.chat.completions.create(
                model="never-loads", messages=[{"role": "user", "content": "Hi"}]
            )
        assert caught.value.status_code == 503
        assert caught.value.code == "model_load_failed"
    admin_page.goto(f"{live_server_url}/admin/inference/modelentry/")
    assert (
        "load failed"
        in admin_page.locator("#result_list tbody tr", has_text="never-loads").inner_text()
    )


def test_staff_see_a_models_prefix_cache_and_can_clear_it(
    admin_page, live_server_url, tiny_model_path
):
    model_register(name="cached-model", path=tiny_model_path)
    client = openai_client(live_server_url)
    messages = [{"role": "user", "content": "A long question about apples. " * 20}]
    for _ in range(2):
        client.chat.completions.create(model="cached-model", messages=messages, max_tokens=2)
    admin_page.goto(f"{live_server_url}/admin/inference/modelentry/")
    row = admin_page.locator("#result_list tbody tr", has_text="cached-model")
    assert "50% hits" in row.inner_text()  # the second request hit, the first missed
    entry = ModelEntry.objects.get(name="cached-model")
    admin_page.goto(f"{live_server_url}/admin/inference/modelentry/{entry.pk}/change/")
    stats = admin_page.locator(".field-cache_stats .readonly").inner_text()
    assert "2 lookups, 1 hits" in stats and "0 evictions" in stats

    admin_page.goto(f"{live_server_url}/admin/inference/modelentry/")
    row.locator("input.action-select").check()
    admin_page.select_option("select[name=action]", "clear_cache")
    admin_page.click("button[name=index]")
    message = admin_page.locator(".messagelist").inner_text()
    assert "Freed" in message and "Freed 0.0 MB" not in message
    assert row.inner_text().split("\t")[-1].startswith("0.0 MB of")
