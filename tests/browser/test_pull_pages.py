"""A pull's admin page in a real browser: its progress follows the row as a runner writes it
(inference/static/web/pulls.js polling the progress view), a failure's sentence appears and
stays after a reload, Cancel goes once the pull has ended; the pull pages pass axe."""

import pytest
from django.contrib.auth import get_user_model
from django.utils import timezone

from inference.models import ModelPull
from inference.services.pulls import pull_create
from tests.browser.test_admin_flows import violations
from tests.fixtures.hub import MLX_REPO

PASSWORD = "a-long-test-password"


@pytest.fixture
def admin_context(browser, live_server_url, transactional_db):
    get_user_model().objects.create_superuser("root", "root@example.com", PASSWORD)
    # axe is injected as an inline script, which the pages' CSP (rightly) refuses.
    context = browser.new_context(viewport={"width": 1366, "height": 768}, bypass_csp=True)
    page = context.new_page()
    page.goto(f"{live_server_url}/admin/login/")
    page.fill("#id_username", "root")
    page.fill("#id_password", PASSWORD)
    page.click("input[type=submit]")
    page.wait_for_url(f"{live_server_url}/admin/")
    yield page
    context.close()


def written(pull: ModelPull, **fields) -> None:
    """What a runner's heartbeat writes (the live server runs no runner: the test is it)."""
    ModelPull.objects.filter(pk=pull.pk).update(
        runner="web-elsewhere", heartbeat_at=timezone.now(), **fields
    )


def test_a_pulls_page_follows_its_progress(admin_context, live_server_url):
    page = admin_context
    pull = pull_create(source=MLX_REPO, name="tiny")
    written(
        pull,
        state="downloading",
        done_bytes=50_000_000,
        total_bytes=200_000_000,
        rate_bytes_per_s=10_000_000,
    )
    page.goto(f"{live_server_url}/admin/inference/modelpull/{pull.pk}/change/")
    amount = page.locator('[data-field="amount"]')
    assert amount.inner_text() == "25.0% · 50.0 MB of 200.0 MB"
    assert page.locator('[data-field="eta"]').inner_text() == "15 s"
    assert page.get_by_role("button", name="Cancel this pull").is_visible()
    assert violations(page) == []

    written(pull, done_bytes=150_000_000)
    page.wait_for_function(
        """() => document.querySelector('[data-field="amount"]').textContent.startsWith("75.0%")""",
        timeout=10_000,
    )
    assert page.locator('progress[data-field="bar"]').evaluate("el => el.value") == 150_000_000

    written(pull, state="failed", error="There is no model x/y on http://hub (check the id).")
    page.locator("#pull-error", has_text="There is no model x/y").wait_for(timeout=10_000)
    assert not page.locator("#pull-cancel").is_visible()
    page.reload()
    assert "There is no model x/y" in page.locator("#pull-error").inner_text()
    assert page.locator('[data-field="state"]').inner_text() == "failed"

    page.goto(f"{live_server_url}/admin/inference/modelpull/")
    summary = page.locator(f'[data-pull="{pull.pk}"][data-field="summary"]')
    assert summary.inner_text().startswith("There is no model x/y")
    assert violations(page) == []

    page.goto(f"{live_server_url}/admin/inference/modelpull/add/")
    assert page.get_by_label("Hub id").is_visible()
    assert violations(page) == []
