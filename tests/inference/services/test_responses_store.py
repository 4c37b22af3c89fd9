"""Stored responses: kept per team, purged by age (the service and `manage.py purge_responses`),
and read-only in the admin (superusers see all, staff team owners their teams', nobody edits)."""

import datetime
import io

import pytest
from django.contrib.auth.models import Permission
from django.core.management import call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.models import Membership
from inference.models import StoredResponse
from inference.services.responses import input_items_page
from inference.services.stored_responses import (
    Conversation,
    response_continued,
    response_get,
    response_store,
    responses_purge,
)
from tests.factories import ApiKeyFactory, MembershipFactory, StaffUserFactory, UserFactory

pytestmark = pytest.mark.django_db

CHANGELIST = reverse("admin:inference_storedresponse_changelist")


def stored(api_key, response_id: str, *, days_old: float = 0, text: str = "hi") -> StoredResponse:
    created = timezone.now() - datetime.timedelta(days=days_old)
    body = {
        "id": response_id,
        "object": "response",
        "created_at": int(created.timestamp()),
        "model": "m",
        "status": "completed",
        "output": [
            {
                "id": f"msg_{response_id}",
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": text}],
            }
        ],
        "usage": {"input_tokens": 12, "output_tokens": 3},
    }
    items = [
        {
            "id": f"in_{response_id}",
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "question"}],
        }
    ]
    return response_store(api_key=api_key, body=body, conversation=Conversation(new_items=items))


def test_a_stored_response_is_found_only_by_its_team():
    key = ApiKeyFactory()
    colleague = ApiKeyFactory(team=key.team)
    stranger = ApiKeyFactory()
    stored(key, "resp_a")
    assert response_get(api_key=colleague, response_id="resp_a").id == "resp_a"
    assert response_get(api_key=stranger, response_id="resp_a") is None
    assert response_get(api_key=key, response_id="resp_b") is None


def test_the_conversation_continues_with_what_it_answered_then_its_output():
    key = ApiKeyFactory()
    stored(key, "resp_a", text="answer")
    continued = response_continued(api_key=key, response_id="resp_a")
    assert [i["id"] for i in continued] == ["in_resp_a", "msg_resp_a"]


def test_input_item_pages():
    items = [{"id": f"item_{i}"} for i in range(5)]
    first = input_items_page(items, order="asc", limit=2)
    assert [i["id"] for i in first["data"]] == ["item_0", "item_1"] and first["has_more"]
    rest = input_items_page(items, order="asc", after="item_3", limit=2)
    assert [i["id"] for i in rest["data"]] == ["item_4"] and not rest["has_more"]
    newest = input_items_page(items, limit=1)
    assert newest["first_id"] == newest["last_id"] == "item_4"
    assert input_items_page(items, after="unknown")["data"] == []


def test_purge_deletes_by_age_in_batches():
    key = ApiKeyFactory()
    for index in range(5):
        stored(key, f"resp_old{index}", days_old=40)
    stored(key, "resp_new", days_old=1)
    assert responses_purge(older_than=datetime.timedelta(days=30), batch_size=2) == 5
    assert list(StoredResponse.objects.values_list("id", flat=True)) == ["resp_new"]


def test_the_purge_command_takes_its_default_from_settings(settings):
    key = ApiKeyFactory()
    stored(key, "resp_old", days_old=8)
    stored(key, "resp_new", days_old=6)
    settings.ORCHARD_RESPONSES_RETENTION_DAYS = 7
    out = io.StringIO()
    call_command("purge_responses", stdout=out)
    assert "Deleted 1 stored responses older than 7 days" in out.getvalue()
    call_command("purge_responses", "--older-than-days", "0", stdout=out)
    assert not StoredResponse.objects.exists()


def test_the_admin_shows_stored_responses_read_only():
    client = Client()
    key = ApiKeyFactory()
    stored(key, "resp_shown", text="the stored answer")
    client.force_login(StaffUserFactory())
    page = client.get(CHANGELIST)
    assert page.status_code == 200 and b"resp_shown" in page.content
    detail = client.get(reverse("admin:inference_storedresponse_change", args=["resp_shown"]))
    assert detail.status_code == 200
    assert b"the stored answer" in detail.content and b"question" in detail.content
    assert b'name="_save"' not in detail.content  # nothing to save: read-only
    assert client.get(reverse("admin:inference_storedresponse_add")).status_code == 403
    deleted = client.post(
        reverse("admin:inference_storedresponse_delete", args=["resp_shown"]), {"post": "yes"}
    )
    assert deleted.status_code == 403 and StoredResponse.objects.filter(id="resp_shown").exists()
    assert client.get(CHANGELIST, {"q": "resp_shown"}).context["cl"].result_count == 1


def test_staff_team_owners_see_only_their_teams_conversations():
    client = Client()
    owner = UserFactory(is_staff=True)
    owner.user_permissions.set(Permission.objects.filter(codename="view_storedresponse"))
    team = MembershipFactory(user=owner, role=Membership.Role.OWNER).team
    stored(ApiKeyFactory(team=team), "resp_mine")
    stored(ApiKeyFactory(), "resp_theirs")
    member_team = MembershipFactory(user=owner, role=Membership.Role.MEMBER).team
    stored(ApiKeyFactory(team=member_team), "resp_as_member")
    client.force_login(owner)
    page = client.get(CHANGELIST)
    assert page.status_code == 200
    assert b"resp_mine" in page.content
    assert b"resp_theirs" not in page.content and b"resp_as_member" not in page.content


def test_nul_characters_are_stored_replaced_and_odd_ids_are_unknown():
    key = ApiKeyFactory()
    body = {
        "id": "resp_nul",
        "object": "response",
        "created_at": 0,
        "model": "m",
        "status": "completed",
        "output": [{"type": "message", "text": "a\x00b"}],
    }
    conversation = Conversation(new_items=[{"type": "message", "text": "q\x00"}])
    stored_response = response_store(api_key=key, body=body, conversation=conversation)
    stored_response.refresh_from_db()
    assert stored_response.body["output"][0]["text"] == "a\ufffdb"
    assert stored_response.new_input_items[0]["text"] == "q\ufffd"
    assert response_get(api_key=key, response_id="resp\x00nul") is None
    assert response_get(api_key=key, response_id="r" * 65) is None
