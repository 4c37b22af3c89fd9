"""Batches and files in the admin: a superuser lists, filters, searches and opens every batch,
downloads its files and cancels running ones ("Cancel selected batches"; a finished one is
left); staff see only their teams' and cancel only those of teams they own, and see nothing
without the permission; a file is deleted with its bytes, never while an active batch reads it."""

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Permission
from django.contrib.messages import get_messages
from django.test import Client
from django.urls import reverse

from accounts.models import Membership
from inference.batch_models import Batch, StoredFile
from tests.factories import ApiKeyFactory, StaffUserFactory, TeamFactory, UserFactory
from tests.inference.test_admin_usage import staff
from tests.inference.web.test_batch_pages import OUTPUT, downloaded, make_batch

pytestmark = pytest.mark.django_db
BATCHES = reverse("admin:inference_batch_changelist")
FILES = reverse("admin:inference_storedfile_changelist")


@pytest.fixture
def world(settings, tmp_path):
    settings.ORCHARD_FILES_DIR = tmp_path
    alpha, beta = TeamFactory(name="alpha"), TeamFactory(name="beta")
    alpha_key = ApiKeyFactory(team=alpha, name="alpha-key")
    beta_key = ApiKeyFactory(team=beta, name="beta-key")
    return {
        "alpha": alpha,
        "running": make_batch(alpha_key, metadata={"job": "nightly-eval"}),
        "done": make_batch(alpha_key, Batch.Status.COMPLETED, done=(9, 1)),
        "beta": make_batch(beta_key, Batch.Status.VALIDATING, done=(0, 0), total=0),
    }


def signed_in(user) -> Client:
    client = Client()
    client.force_login(user)
    return client


def listed(client: Client, url: str, **query) -> list[str]:
    return [str(row.pk) for row in client.get(url, query).context["cl"].result_list]


def test_a_superuser_sees_every_batch_its_files_and_cancels_running_ones(world):
    client = signed_in(StaffUserFactory(username="root"))
    running, done, beta = world["running"], world["done"], world["beta"]
    page = client.get(BATCHES)
    assert page.status_code == 200
    assert set(listed(client, BATCHES)) == {running.id, done.id, beta.id}
    assert '<progress value="4" max="10"></progress><br>4 of 10, 1 failed' in page.content.decode()
    assert listed(client, BATCHES, status__exact="completed") == [done.id]
    assert listed(client, BATCHES, team__id__exact=world["beta"].team_id) == [beta.id]
    assert listed(client, BATCHES, q="nightly-eval") == [running.id]
    assert listed(client, BATCHES, q=done.id) == [done.id]

    detail = client.get(reverse("admin:inference_batch_change", args=[quote(done.id)]))
    html = detail.content.decode()
    assert detail.status_code == 200 and 'name="_save"' not in html  # read-only
    assert "10 in all: 9 completed, 1 failed" in html
    download = reverse("admin:inference_storedfile_download", args=[done.output_file_id])
    assert download in html
    answer = client.get(download)
    assert answer.status_code == 200 and downloaded(answer) == OUTPUT
    assert answer["Content-Disposition"].startswith("attachment; filename=")
    assert client.get(reverse("admin:inference_batch_add")).status_code == 403

    answer = client.post(
        BATCHES, {"action": "cancel_batches", "_selected_action": [running.id, done.id]}
    )
    assert answer.status_code == 302
    assert [str(m) for m in get_messages(answer.wsgi_request)] == [
        "Cancelling 1 batch(es): what has finished is kept.",
        f"Not cancelled (ended already, or not of a team you own): {done.id}.",
    ]
    statuses = dict(Batch.objects.values_list("id", "status"))
    assert statuses[running.id] == "cancelling" and statuses[done.id] == "completed"


def test_staff_see_their_teams_batches_and_cancel_those_of_teams_they_own(world):
    stranger = UserFactory(username="nobody", is_staff=True)
    assert signed_in(stranger).get(BATCHES).status_code == 403  # no permission
    assert signed_in(stranger).get(FILES).status_code == 403
    member = staff("mike", world["alpha"], Membership.Role.MEMBER, ["view_batch"])
    client = signed_in(member)
    assert set(listed(client, BATCHES)) == {world["running"].id, world["done"].id}
    beta = reverse("admin:inference_batch_change", args=[quote(world["beta"].id)])
    assert client.get(beta).status_code == 302  # not one of theirs: back to the admin index
    page = client.get(BATCHES).content.decode()
    assert "cancel_batches" not in page  # a member may not cancel
    client.post(BATCHES, {"action": "cancel_batches", "_selected_action": [world["running"].id]})
    assert Batch.objects.get(pk=world["running"].id).status == Batch.Status.IN_PROGRESS

    owner = staff("olga", world["alpha"], Membership.Role.OWNER, ["view_batch"])
    selected = [world["running"].id, world["beta"].id]
    signed_in(owner).post(BATCHES, {"action": "cancel_batches", "_selected_action": selected})
    statuses = dict(Batch.objects.values_list("id", "status"))
    assert statuses[world["running"].id] == "cancelling"
    assert statuses[world["beta"].id] == "validating"  # another team's: not even listed


def test_files_are_deleted_with_their_bytes_and_never_while_a_batch_reads_them(
    world, tmp_path, django_capture_on_commit_callbacks
):
    owner = staff("olga", world["alpha"], Membership.Role.OWNER, ["view_storedfile"])
    client = signed_in(owner)
    alpha_files = set(StoredFile.objects.filter(team=world["alpha"]).values_list("pk", flat=True))
    assert set(listed(client, FILES)) == alpha_files  # 2 inputs, an output and an error file
    output = world["done"].output_file
    delete = reverse("admin:inference_storedfile_delete", args=[output.pk])
    assert client.post(delete, {"post": "yes"}).status_code == 403  # no delete permission
    owner.user_permissions.add(Permission.objects.get(codename="delete_storedfile"))
    client = signed_in(owner)

    in_use = reverse("admin:inference_storedfile_delete", args=[world["running"].input_file_id])
    refused = client.post(in_use, {"post": "yes"})
    assert refused.status_code == 200 and "which is still in_progress" in refused.content.decode()
    assert StoredFile.objects.filter(pk=world["running"].input_file_id).exists()
    # Selected with a file that may go, it keeps the whole selection.
    selection = [world["running"].input_file_id, world["done"].error_file_id]
    answer = client.post(
        FILES, {"action": "delete_selected", "_selected_action": selection, "post": "yes"}
    )
    assert answer.status_code == 200 and "which is still in_progress" in answer.content.decode()
    assert StoredFile.objects.filter(pk__in=selection).count() == 2

    path = tmp_path / str(output.team_id) / output.pk
    assert path.exists()
    with django_capture_on_commit_callbacks(execute=True):  # the bytes go once it commits
        assert client.post(delete, {"post": "yes"}).status_code == 302
    assert not StoredFile.objects.filter(pk=output.pk).exists() and not path.exists()
    world["done"].refresh_from_db()
    assert world["done"].output_file is None and world["done"].error_file is not None
