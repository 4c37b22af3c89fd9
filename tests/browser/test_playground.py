"""The playground in a real Chromium: a member whose team does not let members make keys opens
it from the navigation, is offered only the model their key allows, sends a message from the
keyboard and sees the reply stream in with its token counts and time to first token; the
request is metered on the page's own key, which ends when the page is left; the Python the
page copies runs against the server as it is (with the member's key in ORCHARD_API_KEY)."""

import os
import re
import subprocess
import sys

import pytest

from accounts.authentication import ERROR_REVOKED
from accounts.models import ApiKey, Membership
from accounts.services import api_key_create
from inference.models import UsageRecord
from inference.services.registry import model_register
from tests.browser.test_member_pages import account, shot, sign_in

MODEL = "tiny-playground"
FORBIDDEN = "tiny-not-yours"


@pytest.fixture
def member_key(transactional_db, tiny_model_path):
    model_register(name=MODEL, path=tiny_model_path)
    model_register(name=FORBIDDEN, path=tiny_model_path)
    user, team = account("pia", "playground-team", Membership.Role.MEMBER)
    assert not team.members_manage_keys
    return api_key_create(user=user, team=team, name="pia's", models=[MODEL])


def test_a_member_chats_in_the_playground_and_runs_its_python(
    live_server_url, browser, member_key, tmp_path
):
    parent, raw_key = member_key
    context = browser.new_context(viewport={"width": 1366, "height": 768})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=live_server_url)
    page = context.new_page()
    sign_in(page, live_server_url, "pia")
    page.get_by_role("link", name="Playground").click()
    page.wait_for_url(f"{live_server_url}/playground/")
    assert page.locator("#pg-model option").all_inner_texts() == [MODEL]

    page.get_by_label("System prompt").fill("You are terse.")
    page.get_by_label("Temperature").fill("0")
    page.get_by_label("Max tokens").fill("8")
    page.get_by_label("Your message").fill("Hello")
    with page.expect_response(lambda response: response.url.endswith("/playground/key/")) as made:
        page.get_by_label("Your message").press("Control+Enter")
    playground_key = made.value.json()["key"]
    page.locator("#pg-usage", has_text="completion").wait_for(timeout=60_000)
    reply = page.locator(".pg-message.pg-assistant").last
    assert int(reply.get_attribute("data-deltas")) > 1  # it came in pieces
    assert reply.inner_text().strip() != "Assistant"  # the role label and some text
    counts = re.match(r"(\d+) prompt \+ (\d+) completion", page.locator("#pg-usage").inner_text())
    prompt, completion = map(int, counts.groups())
    assert re.fullmatch(r"\d+ ms", page.locator("#pg-ttft").inner_text())
    shot(page, "06-playground")

    # Metered on the page's own key, made from the member's.
    key = ApiKey.objects.get(parent=parent)
    row = UsageRecord.objects.get(api_key=key)
    assert (row.model, row.status) == (MODEL, UsageRecord.Status.COMPLETED)
    assert (row.prompt_tokens, row.completion_tokens) == (prompt, completion)

    # A second turn, offering the sample tool and asking for JSON: the Python copied below
    # carries the whole conversation, the tool and the schema.
    page.get_by_label("Offer a sample tool").check()
    page.get_by_label("Answer in JSON").check()
    page.get_by_label("Your message").fill("And the weather?")
    page.get_by_role("button", name="Send").click()
    page.locator("#pg-usage", has_text="completion").wait_for(timeout=60_000)
    assert page.locator(".pg-message").count() == 4
    assert page.locator("#pg-status").inner_text() == "Done."

    page.click("#pg-copy-python")
    page.locator("#pg-python-status", has_text="Copied.").wait_for()
    python = page.evaluate("navigator.clipboard.readText()")
    assert python == page.locator("#pg-python").inner_text()
    assert "sk-orch-" not in python  # the playground's key stays in the page
    assert '"get_weather"' in python and '"additionalProperties": False' in python
    script = tmp_path / "copied.py"
    script.write_text(python)
    run = subprocess.run(
        [sys.executable, str(script)],
        env={**os.environ, "ORCHARD_API_KEY": raw_key},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert re.search(r"\d+ prompt \+ \d+ completion tokens", run.stdout)

    # Usable on a phone: nothing wider than the screen.
    page.set_viewport_size({"width": 390, "height": 844})
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    shot(page, "07-playground-phone")

    # Leaving the page ends its key.
    # Chromium tells Playwright nothing of a page's requests while it is being left (its
    # beacon), so the new page asks the API until the key is refused (for at most 10 s).
    page.goto(f"{live_server_url}/usage/")
    refused = page.evaluate(
        """async (key) => {
            const until = Date.now() + 10000;
            while (Date.now() < until) {
                const r = await fetch("/v1/models", {headers: {Authorization: `Bearer ${key}`}});
                if (r.status === 401) { return (await r.json()).error.message; }
                await new Promise((resolve) => setTimeout(resolve, 50));
            }
            return null;
        }""",
        playground_key,
    )
    assert refused == ERROR_REVOKED
    assert ApiKey.objects.get(pk=key.pk).revoked_at is not None
    assert ApiKey.objects.get(pk=parent.pk).revoked_at is None
    context.close()
