"""The members' pages in a real Chromium: a member signs in, creates a key, uses it for an API
call, finds the call in "My usage", watches the live engine status change while a request
runs; the team owner opens the team report and exports it as CSV. Screenshots of each page are
kept under $ORCHARD_HOME/test-artifacts/browser/."""

import threading
from pathlib import Path

import openai
import pytest
from django.conf import settings
from django.contrib.auth import get_user_model

from accounts.models import Membership
from accounts.services import team_membership_ensure
from inference.services.registry import model_register

PASSWORD = "a-long-member-password"
MODEL = "tiny-browser"
ARTIFACTS = Path(settings.ORCHARD_HOME) / "test-artifacts" / "browser"


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def account(username: str, team: str, role: str):
    user = get_user_model().objects.create_user(username, password=PASSWORD)
    team_obj, _ = team_membership_ensure(user=user, team_name=team)
    Membership.objects.filter(user=user, team=team_obj).update(role=role)
    return user, team_obj


def sign_in(page, url: str, username: str) -> None:
    page.goto(f"{url}/accounts/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", PASSWORD)
    page.click("button[type=submit]")
    page.wait_for_url(f"{url}/keys/")


@pytest.fixture
def team_world(transactional_db, tiny_model_path):
    model_register(name=MODEL, path=tiny_model_path)
    _, team = account("olive", "orchard-team", Membership.Role.OWNER)
    team.members_manage_keys = True  # the owner lets members make their own keys
    team.save()
    member, _ = account("mia", "orchard-team", Membership.Role.MEMBER)
    return team, member


def test_a_member_and_an_owner_use_the_pages(live_server_url, laptop, browser, team_world):
    page = laptop
    page.goto(live_server_url + "/")
    assert page.locator("text=Sign in").first.is_visible()
    shot(page, "01-landing")

    sign_in(page, live_server_url, "mia")
    page.fill("#id_name", "from the browser")
    page.click("#create-key button[type=submit]")
    raw_key = page.locator("#raw-key").inner_text().strip()
    assert raw_key.startswith("sk-orch-")
    shot(page, "02-key-created")
    page.reload()
    assert page.locator("#raw-key").count() == 0  # shown once

    client = openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=raw_key, max_retries=0)
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5
    )
    page.goto(f"{live_server_url}/usage/")
    totals = page.locator("#usage-totals").inner_text()
    assert (
        totals.startswith("1 requests") and f"{reply.usage.completion_tokens} completion" in totals
    )
    assert MODEL in page.locator("#usage-by-model").inner_text()
    shot(page, "03-my-usage")

    page.goto(f"{live_server_url}/models/")
    row = page.locator(f'#engine-status tr[data-model="{MODEL}"]')
    row.wait_for(timeout=10_000)
    assert row.locator("td").nth(2).inner_text() == "0"
    streaming = threading.Thread(
        target=lambda: list(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "Go on"}],
                max_tokens=1500,
                extra_body={"ignore_eos": True},
                stream=True,
            )
        )
    )
    streaming.start()
    page.wait_for_function(
        f"""() => {{ const r = document.querySelector('#engine-status tr[data-model="{MODEL}"]');
                    return r && r.children[2].textContent === "1"; }}""",
        timeout=20_000,
    )
    shot(page, "04-live-status-running")
    streaming.join(timeout=120)
    page.wait_for_function(
        f"""() => document.querySelector('#engine-status tr[data-model="{MODEL}"]')
                    .children[2].textContent === "0" """,
        timeout=20_000,
    )

    owner_context = browser.new_context(
        viewport={"width": 1366, "height": 768}, accept_downloads=True
    )
    owner = owner_context.new_page()
    sign_in(owner, live_server_url, "olive")
    owner.click("text=Team reports")
    owner.click("text=orchard-team")
    assert "2 requests" in owner.locator("#report-totals").inner_text()
    assert "mia" in owner.locator("#report-rows").inner_text()
    shot(owner, "05-team-report")
    with owner.expect_download() as download:
        owner.click("#export-csv")
    content = Path(download.value.path()).read_text()
    lines = content.strip().splitlines()
    assert lines[0].startswith("day,model,key,member") and lines[-1].startswith("total,")
    assert any(",mia," in line and MODEL in line for line in lines[1:-1])
    owner_context.close()
