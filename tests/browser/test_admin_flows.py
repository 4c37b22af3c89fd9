"""The admin's flows in a real Chromium at laptop width: inviting a member and issuing their key
on one screen (the key, copied by its button, works against /v1/models over HTTP); the
running-now page showing a long stream's tokens so far and elapsed time, and its Cancel ending
that stream; and axe-core (node_modules/axe-core, scripts/ensure_node_clients.sh) finding no
serious or critical accessibility violation on the member pages and the admin pages."""

import re
import threading
from pathlib import Path

import httpx
import openai
import pytest
from django.conf import settings

from accounts.models import ApiKey, Membership, Team
from accounts.services import api_key_create, team_membership_ensure
from inference.batch_models import Batch
from inference.models import UsageRecord
from inference.services.output import FAILURE_MESSAGES
from inference.services.registry import model_register
from inference.services.usage import usage_record_finished
from tests.browser.test_admin_pages import admin_page  # noqa: F401  (a fixture)
from tests.browser.test_member_pages import shot

MODEL = "tiny-admin-flows"
AXE = Path(settings.BASE_DIR) / "node_modules" / "axe-core" / "axe.min.js"


@pytest.fixture
def team(transactional_db, tiny_model_path) -> Team:
    model_register(name=MODEL, path=tiny_model_path)
    return Team.objects.create(name="flows-team")


def test_an_admin_invites_a_member_and_their_key_works(admin_page, live_server_url, team):  # noqa: F811
    page = admin_page
    page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=live_server_url)
    page.goto(f"{live_server_url}/admin/accounts/team/{team.pk}/change/")
    page.get_by_role("link", name="Invite a member").click()
    assert page.get_by_label("Team").evaluate("select => select.value") == str(team.pk)
    page.get_by_label("Username").fill("newcomer")
    page.get_by_label("Label").fill("newcomer's first key")
    page.get_by_label("All models").uncheck()
    page.get_by_role("checkbox", name=MODEL).check()
    page.get_by_label("Requests per minute").fill("30")
    shot(page, "10-admin-invite")
    page.get_by_role("button", name="Invite").click()

    page.get_by_role("button", name="Copy key").click()
    page.get_by_text("Copied.").wait_for()
    raw_key = page.evaluate("() => navigator.clipboard.readText()")
    assert raw_key == page.locator("#raw-key").input_value() and raw_key.startswith("sk-orch-")
    assert "/accounts/set-password/" in page.locator("#password-link").input_value()
    shot(page, "11-admin-invited")
    api_key = ApiKey.objects.get(user__username="newcomer")
    assert (api_key.team, api_key.allowed_models, api_key.rpm) == (team, [MODEL], 30)
    assert Membership.objects.filter(team=team, user__username="newcomer").exists()

    models = httpx.get(
        f"{live_server_url}/v1/models", headers={"Authorization": f"Bearer {raw_key}"}
    )
    assert models.status_code == 200
    assert [m["id"] for m in models.json()["data"]] == [MODEL]
    page.reload()  # the browser's resubmit: no second key, the secret not shown again
    assert ApiKey.objects.filter(user__username="newcomer").count() == 1
    assert raw_key not in page.content()


def test_the_running_now_page_cancels_a_long_stream(
    admin_page,  # noqa: F811
    live_server_url,
    team,
    django_user_model,
):
    user = django_user_model.objects.create_user("streamer")
    team_membership_ensure(user=user, team_name=team.name)
    _, raw_key = api_key_create(user=user, team=team, name="streamer's")
    client = openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=raw_key, max_retries=0)
    ended: dict = {}

    def stream() -> None:
        chunks = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Go on"}],
            max_tokens=3500,
            extra_body={"ignore_eos": True},
            stream=True,
        )
        try:
            ended["chunks"] = sum(1 for _ in chunks)
        except openai.APIError as exc:
            ended["error"] = exc.message

    streaming = threading.Thread(target=stream)
    streaming.start()
    page = admin_page
    page.goto(f"{live_server_url}/admin/")
    page.get_by_role("link", name="Requests running now").click()
    row = page.locator("#running-table tbody tr", has_text="streamer's")
    row.wait_for(timeout=20_000)  # the page refreshes itself
    tokens = row.locator("td.tokens")
    page.wait_for_function(
        """() => { const cell = document.querySelector("#running-table td.tokens");
                   return cell && Number(cell.textContent.split("/")[1]) > 0; }""",
        timeout=20_000,
    )
    prompt, completion = (int(part) for part in tokens.inner_text().split("/"))
    assert prompt > 0 and completion > 0
    assert re.fullmatch(r"\d+\.\d s", row.locator("td.elapsed").inner_text())
    assert "flows-team" in row.inner_text() and "streamer" in row.inner_text()
    shot(page, "12-admin-running-now")
    overflow = page.locator("#running-now").evaluate("el => el.scrollWidth - el.clientWidth")
    assert overflow <= 0, "the running-now table fits a laptop screen"

    row.get_by_role("button", name=re.compile("^Cancel request")).click()
    assert "Cancelling" in page.locator(".messagelist").inner_text()
    streaming.join(timeout=30)
    assert not streaming.is_alive(), "the client's stream ended"
    assert ended == {"error": FAILURE_MESSAGES["cancelled"]}
    record = UsageRecord.objects.get(api_key__name="streamer's")
    assert record.status == UsageRecord.Status.CANCELLED and record.completion_tokens < 3500
    page.get_by_text("Nothing is running.").wait_for(timeout=10_000)


def violations(page) -> list[str]:
    """axe-core's serious and critical violations on the page, one line each."""
    page.add_script_tag(path=str(AXE))
    return page.evaluate(
        """async () => (await axe.run(document, {resultTypes: ["violations"]})).violations
             .filter(v => v.impact === "serious" || v.impact === "critical")
             .map(v => v.id + " (" + v.impact + "): "
                       + v.nodes.map(n => n.target.join(" ")).join(", "))"""
    )


def test_the_member_and_admin_pages_pass_axe(browser, live_server_url, team, django_user_model):
    assert AXE.exists(), "axe-core is installed by scripts/ensure_node_clients.sh"
    root = django_user_model.objects.create_superuser("axe-root", "axe@example.com", "axe-pw-123")
    team_membership_ensure(user=root, team_name=team.name, role=Membership.Role.OWNER)
    api_key, _ = api_key_create(user=root, team=team, name="axe key", rpm=60, budget_tokens=10**6)
    usage_record_finished(
        request_id="req-axe",
        api_key=api_key,
        model=MODEL,
        endpoint="chat.completions",
        status="completed",
        started_at=api_key.created_at,
        prompt_tokens=1234,
    )
    batch = Batch.objects.create(
        id="batch_axe",
        team=team,
        api_key=api_key,
        endpoint="/v1/chat/completions",
        model=MODEL,
        status=Batch.Status.COMPLETED,  # ended: the server's batch runner leaves it alone
        input_file_name="file-axe",
        num_total=10,
        num_completed=4,
        created_at=api_key.created_at,
        completed_at=api_key.created_at,
        expires_at=api_key.created_at,
    )
    # axe is injected as an inline script, which the pages' CSP (rightly) refuses.
    context = browser.new_context(viewport={"width": 1366, "height": 768}, bypass_csp=True)
    page = context.new_page()
    missing = []  # e.g. a /favicon.ico the pages never offered
    page.on("response", lambda r: missing.append(r.url) if r.status == 404 else None)
    page.goto(f"{live_server_url}/accounts/login/")
    page.get_by_label("Username").fill("axe-root")
    page.get_by_label("Password").fill("axe-pw-123")
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"{live_server_url}/keys/")
    pages = [
        "/",
        "/keys/",
        "/usage/",
        "/models/",
        "/playground/",
        "/teams/",
        f"/teams/{team.pk}/",
        "/admin/",
        "/admin/accounts/apikey/",
        f"/admin/accounts/apikey/{api_key.pk}/change/",
        f"/admin/accounts/team/{team.pk}/change/",
        "/admin/accounts/team/invite/",
        "/admin/inference/usagerecord/running/",
        "/batches/",
        "/admin/inference/batch/",
        f"/admin/inference/batch/{batch.pk}/change/",
    ]
    found = {}
    for index, path in enumerate(pages):
        response = page.goto(f"{live_server_url}{path}")
        assert response.status == 200, path
        found[path] = violations(page)
        shot(page, f"2{index:x}-axe-{path.strip('/').replace('/', '-') or 'home'}")
    context.close()
    assert missing == []
    assert not any(found.values()), "\n".join(
        f"{path}: {line}" for path, lines in found.items() for line in lines
    )
