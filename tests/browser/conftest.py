import pytest
from playwright.sync_api import sync_playwright

from tests.fixtures.browser import launch


@pytest.fixture
def browser():
    # Per test: Playwright's sync API runs an event loop on this thread while it is open, and
    # every other test must find none.
    with sync_playwright() as playwright:
        browser = launch(playwright)
        yield browser
        browser.close()


@pytest.fixture(autouse=True)
def orm_beside_playwright(live_server_url, monkeypatch):
    """Playwright's sync API keeps an event loop running on the test's thread, which Django
    takes for async code; the test's own ORM calls are plain sync code. Set only once the live
    server runs (it never inherits this)."""
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


@pytest.fixture
def laptop(browser):
    """A page the size of a 1366 × 768 laptop screen."""
    context = browser.new_context(viewport={"width": 1366, "height": 768})
    yield context.new_page()
    context.close()


@pytest.fixture(autouse=True)
def real_password_hashing(settings, fast_password_hashing):
    """The live server checks these users' passwords with the real hashers."""
    from django.conf import global_settings

    settings.PASSWORD_HASHERS = global_settings.PASSWORD_HASHERS
