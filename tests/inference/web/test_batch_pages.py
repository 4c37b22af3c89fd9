"""The members' Batches page through Django's test client: a member sees their teams' batches
(never another team's) with their progress and links to their files, downloads them without a
key (another team's member gets a 404), cancels their own batch while it runs (not a finished
one, not a teammate's unless they own the team); anonymous visitors are sent to sign in."""

import datetime

import pytest
from asgiref.sync import async_to_sync
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from accounts.models import Membership
from inference.batch_models import Batch
from inference.batches.files import file_create, file_create_output
from inference.batches.services import batch_create
from tests.factories import ApiKeyFactory, MembershipFactory, TeamFactory, UserFactory

pytestmark = pytest.mark.django_db
LINE = b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n'
OUTPUT = b'{"id": "batch_req_1", "custom_id": "a", "response": {"status_code": 200}}\n'


def make_batch(api_key, status=Batch.Status.IN_PROGRESS, *, done=(3, 1), total=10, **fields):
    """A batch of `api_key` over a new input file, moved to `status` with `done` (completed,
    failed) of `total` lines; a completed one gets an output and an error file."""
    stored = file_create(api_key=api_key, purpose="batch", filename="requests.jsonl", chunks=[LINE])
    batch = batch_create(
        api_key=api_key,
        input_file_id=stored.pk,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata=fields.pop("metadata", None),
    )
    batch.status, batch.num_total = status, total
    batch.num_completed, batch.num_failed = done
    batch.model = "tiny-chat"
    if status == Batch.Status.COMPLETED:
        batch.completed_at = timezone.now()
        for attribute, kind in (("output_file", "output"), ("error_file", "error")):
            setattr(
                batch,
                attribute,
                file_create_output(
                    team_id=api_key.team_id,
                    api_key_id=api_key.pk,
                    filename=f"{batch.id}_{kind}.jsonl",
                    chunks=[OUTPUT if kind == "output" else b'{"error": 1}\n'],
                ),
            )
    for name, value in fields.items():
        setattr(batch, name, value)
    batch.save()
    return batch


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def downloaded(response) -> bytes:
    """The body of a streamed download (its iterator is asynchronous, as under daphne)."""

    async def collect() -> bytes:
        return b"".join([part async for part in response.streaming_content])

    return async_to_sync(collect)()


@pytest.fixture
def world(settings, tmp_path):
    settings.ORCHARD_FILES_DIR = tmp_path
    team, other = TeamFactory(name="alpha"), TeamFactory(name="beta")
    users = {name: UserFactory(username=name) for name in ("olive", "mia", "carl", "sam", "root")}
    MembershipFactory(team=team, user=users["olive"], role=Membership.Role.OWNER)
    MembershipFactory(team=team, user=users["mia"], role=Membership.Role.MEMBER)
    MembershipFactory(team=team, user=users["carl"], role=Membership.Role.MEMBER)
    MembershipFactory(team=other, user=users["sam"], role=Membership.Role.OWNER)
    users["root"].is_superuser = users["root"].is_staff = True
    users["root"].save()
    keys = {
        "mia": ApiKeyFactory(team=team, user=users["mia"], name="mia-key"),
        "carl": ApiKeyFactory(team=team, user=users["carl"], name="carl-key"),
        "sam": ApiKeyFactory(team=other, user=users["sam"], name="sam-key"),
    }
    batches = {
        "mine": make_batch(keys["mia"]),
        "carls": make_batch(keys["carl"]),
        "done": make_batch(keys["carl"], Batch.Status.COMPLETED, done=(9, 1)),
        "theirs": make_batch(keys["sam"]),
    }
    return {"team": team, "users": users, "keys": keys, "batches": batches}


def test_members_see_their_teams_batches_and_download_their_files(world):
    users, batches, keys = world["users"], world["batches"], world["keys"]
    anonymous = Client()
    for url in (reverse("web-batches"), reverse("web-batch-file", args=["file-" + "0" * 24])):
        answer = anonymous.get(url)
        assert answer.status_code == 302 and answer["Location"].startswith(reverse("web-login"))

    page = signed_in(users["mia"]).get(reverse("web-batches"))
    html = page.content.decode()
    assert page.status_code == 200 and 'href="/batches/"' in html  # in the navigation
    shown = [row["batch"].id for row in page.context["rows"]]
    assert shown == [batches["done"].id, batches["carls"].id, batches["mine"].id]  # newest first
    assert batches["theirs"].id not in html
    mine = html.split(f'<tr id="{batches["mine"].id}">')[1].split("</tr>")[0]
    assert '<progress value="4" max="10"' in mine and "4 of 10 (40%), 1 failed" in mine
    assert keys["mia"].prefix in mine and "requests.jsonl" in mine and "In Progress" in mine
    assert f'action="/batches/{batches["mine"].id}/cancel/"' in mine
    carls = html.split(f'<tr id="{batches["carls"].id}">')[1].split("</tr>")[0]
    # A teammate's batch: its key is not shown to a member, nor may they cancel it.
    assert keys["carl"].prefix not in carls and "a teammate&#x27;s key" in carls
    assert "/cancel/" not in carls
    done = html.split(f'<tr id="{batches["done"].id}">')[1].split("</tr>")[0]
    output = batches["done"].output_file
    assert reverse("web-batch-file", args=[output.pk]) in done and "/cancel/" not in done
    assert reverse("web-batch-file", args=[batches["done"].error_file_id]) in done
    assert "10 of 10 (100%)" in done and timezone.now().strftime("%Y-%m-%d") in done

    # The team's owner sees every key of the team and may cancel any running batch of it.
    owner = signed_in(users["olive"]).get(reverse("web-batches")).content.decode()
    assert keys["carl"].prefix in owner
    assert f"/batches/{batches['carls'].id}/cancel/" in owner
    assert f"/batches/{batches['done'].id}/cancel/" not in owner  # it has ended
    # A superuser's page is their own teams' (the admin has every team's).
    assert signed_in(users["root"]).get(reverse("web-batches")).context["rows"] == []

    url = reverse("web-batch-file", args=[output.pk])
    answer = signed_in(users["mia"]).get(url)
    assert answer.status_code == 200 and downloaded(answer) == OUTPUT
    assert answer["Content-Disposition"] == f'attachment; filename="{output.filename}"'
    assert answer["Content-Length"] == str(len(OUTPUT))
    assert signed_in(users["sam"]).get(url).status_code == 404  # another team's file
    missing = reverse("web-batch-file", args=["file-" + "f" * 24])
    assert signed_in(users["mia"]).get(missing).status_code == 404


def test_fifty_batches_a_page(world):
    api_key = world["keys"]["sam"]
    start = timezone.now() - datetime.timedelta(days=1)
    Batch.objects.bulk_create(
        Batch(
            id=f"batch_old{index:03d}",
            team_id=api_key.team_id,
            api_key=api_key,
            endpoint="/v1/chat/completions",
            input_file_name="file-gone",
            created_at=start - datetime.timedelta(minutes=index),
            expires_at=start,
        )
        for index in range(50)
    )
    client = signed_in(world["users"]["sam"])
    first = client.get(reverse("web-batches"))
    assert len(first.context["rows"]) == 50 and "Page 1 of 2" in first.content.decode()
    assert first.context["rows"][0]["batch"] == world["batches"]["theirs"]
    second = client.get(reverse("web-batches"), {"page": 2})
    assert [row["batch"].id for row in second.context["rows"]] == ["batch_old049"]
    assert "file-gone" in second.content.decode()  # its input's id, the file being gone


def test_cancelling_from_the_page(world):
    users, batches = world["users"], world["batches"]
    mia = signed_in(users["mia"])
    cancel = reverse("web-batch-cancel", args=[batches["mine"].id])
    assert mia.get(cancel).status_code == 405
    refused = Client(enforce_csrf_checks=True)
    refused.force_login(users["mia"])
    assert refused.post(cancel).status_code == 403  # no CSRF token
    answer = mia.post(cancel, {"page": "1"})
    assert answer.status_code == 302 and answer["Location"] == reverse("web-batches") + "?page=1"
    assert [str(m) for m in get_messages(answer.wsgi_request)] == [
        f"Cancelling {batches['mine'].id}: what has finished is kept in its output file."
    ]
    mine = Batch.objects.get(pk=batches["mine"].id)
    assert mine.status == Batch.Status.CANCELLING and mine.cancelling_at is not None

    # A teammate's running batch (for a member) and another team's: as if there were none.
    for user, batch in (("mia", "carls"), ("sam", "carls"), ("mia", "theirs")):
        url = reverse("web-batch-cancel", args=[batches[batch].id])
        assert signed_in(users[user]).post(url).status_code == 404
    assert Batch.objects.get(pk=batches["carls"].id).status == Batch.Status.IN_PROGRESS

    # The owner may cancel any of the team's, but a finished batch stays as it was.
    owner = signed_in(users["olive"])
    answer = owner.post(reverse("web-batch-cancel", args=[batches["done"].id]), follow=True)
    assert "Cannot cancel a batch with status &#x27;completed&#x27;." in answer.content.decode()
    assert Batch.objects.get(pk=batches["done"].id).status == Batch.Status.COMPLETED
    owner.post(reverse("web-batch-cancel", args=[batches["carls"].id]))
    assert Batch.objects.get(pk=batches["carls"].id).status == Batch.Status.CANCELLING
