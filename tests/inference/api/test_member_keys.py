"""Through the real API (the official client against the live server, another process reading
the same database): a member removed from a team in the admin gets 401 with that team's key on
the very next request, while their key in another team and their colleague's key keep working;
a deactivated user gets 401 with every key."""

import openai
from django.contrib.auth import get_user_model
from django.test import Client
from django.urls import reverse

from accounts.authentication import ERROR_REVOKED
from accounts.models import Membership
from tests.factories import StaffUserFactory


def works(live_server_url: str, key: str) -> bool:
    client = openai.OpenAI(base_url=f"{live_server_url}/v1", api_key=key, max_retries=0)
    try:
        client.models.list()
    except openai.AuthenticationError as exc:
        assert exc.status_code == 401 and exc.code == "invalid_api_key"
        assert exc.body["message"] == ERROR_REVOKED
        return False
    return True


def test_removed_or_deactivated_members_keys_stop_at_once(live_server_url, make_key):
    alice_a = make_key(username="alice", team="team-a")
    alice_b = make_key(username="alice", team="team-b")
    carol_a = make_key(username="carol", team="team-a")
    assert all(works(live_server_url, key) for key in (alice_a, alice_b, carol_a))

    membership = Membership.objects.get(team__name="team-a", user__username="alice")
    admin = Client()
    admin.force_login(StaffUserFactory())
    url = reverse("admin:accounts_membership_delete", args=[membership.pk])
    assert admin.post(url, {"post": "yes"}).status_code == 302
    assert not works(live_server_url, alice_a)
    assert works(live_server_url, alice_b) and works(live_server_url, carol_a)

    alice = get_user_model().objects.get(username="alice")
    alice.is_active = False
    alice.save()  # what the admin's user page does when "Active" is unticked
    assert not works(live_server_url, alice_b)
    assert works(live_server_url, carol_a)
