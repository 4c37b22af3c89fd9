"""The admin's pulls: "Pull a model" (linked from the model list and its add page) makes a
queued pull that a runner runs; its page and the list show the progress from the row, through
the JSON view the page polls; a failure shows the same sentence the shell prints; Cancel; and
who may do what."""

import pytest
from django.contrib.auth.models import Permission
from django.core.management import CommandError, call_command
from django.test import Client
from django.urls import reverse
from django.utils import timezone

from inference.models import ModelEntry, ModelPull
from inference.services.pulls import PullRunner, pull_create
from tests.factories import UserFactory
from tests.fixtures.hub import GATED_REPO, MLX_REPO, ODD_REPO

pytestmark = pytest.mark.django_db(transaction=True)
ADD = reverse("admin:inference_modelpull_add")
PROGRESS = reverse("admin:inference_modelpull_progress")


@pytest.fixture
def admin_client(django_user_model) -> Client:
    user = django_user_model.objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(user)
    return client


def page(pull: ModelPull) -> str:
    return reverse("admin:inference_modelpull_change", args=[pull.pk])


def test_pull_a_model_from_the_admin(hub, admin_client, models_dir):
    models = admin_client.get(reverse("admin:inference_modelentry_changelist")).content.decode()
    assert f'href="{ADD}"' in models and "Pull from the hub" in models
    adding = admin_client.get(reverse("admin:inference_modelentry_add")).content.decode()
    assert "pull a model from the hub" in adding
    form = admin_client.get(ADD)
    assert form.status_code == 200 and hub.url in form.content.decode()

    answer = admin_client.post(
        ADD, {"source": f"{MLX_REPO}@v1", "name": "tiny", "kind": "chat", "group_size": "64"}
    )
    pull = ModelPull.objects.get()
    assert answer.status_code == 302 and answer["Location"] == page(pull)
    assert (pull.state, pull.revision, pull.origin) == ("queued", "v1", "admin")
    assert pull.started_by.username == "root"
    queued = admin_client.get(page(pull)).content.decode()
    assert 'id="pull-live"' in queued and 'data-field="state">queued<' in queued
    assert "Cancel this pull" in queued

    ended = PullRunner(runner="web-1").run_once()  # the web process's runner, in this test
    assert ended.state == "done"
    done = admin_client.get(page(pull)).content.decode()
    assert "Cancel this pull" not in done
    assert reverse("admin:inference_modelentry_change", args=[ended.model_id]) in done
    assert ModelEntry.objects.get(name="tiny").source == MLX_REPO


def test_the_progress_view_says_what_the_row_says(hub, admin_client):
    pull = pull_create(source=MLX_REPO, name="tiny")
    ModelPull.objects.filter(pk=pull.pk).update(
        state="downloading",
        runner="web-1",
        heartbeat_at=timezone.now(),
        done_bytes=50_000_000,
        total_bytes=200_000_000,
        rate_bytes_per_s=10_000_000,
    )
    answer = admin_client.get(PROGRESS, {"ids": f"{pull.pk},999"})
    assert answer["Content-Type"] == "application/json" and "no-store" in answer["Cache-Control"]
    (row,) = answer.json()["pulls"]
    assert (row["id"], row["state"], row["active"], row["eta_s"]) == (
        pull.pk,
        "downloading",
        True,
        15.0,
    )
    assert row["shown"]["amount"] == "25.0% · 50.0 MB of 200.0 MB"
    assert (row["shown"]["rate"], row["shown"]["eta"]) == ("10.0 MB/s", "15 s")
    listing = admin_client.get(reverse("admin:inference_modelpull_changelist")).content.decode()
    assert f'data-pull="{pull.pk}" data-field="summary">25.0% · 50.0 MB of 200.0 MB' in listing
    assert "web/pulls.js" in listing


@pytest.mark.parametrize(
    ("source", "sentence"),
    [
        ("nobody/nothing", "There is no model nobody/nothing on "),
        (f"{MLX_REPO}@no-such-branch", "has no revision 'no-such-branch'"),
        (GATED_REPO, "is gated: accept its conditions at "),
        (ODD_REPO, "cannot be served: mlx-lm "),
    ],
)
def test_a_failure_reads_the_same_in_the_admin_and_the_shell(
    hub, admin_client, models_dir, source, sentence
):
    admin_client.post(ADD, {"source": source, "name": "a", "kind": "chat", "group_size": "64"})
    failed = PullRunner(runner="web-1").run_once()
    assert failed.state == "failed" and sentence in failed.error
    shown = admin_client.get(page(failed)).content.decode()
    assert f'id="pull-error">{failed.error}<' in shown.replace("&#x27;", "'")
    with pytest.raises(CommandError) as caught:
        call_command("pull", source, "--name", "b")
    assert str(caught.value) == failed.error
    assert not ModelEntry.objects.exists()


def test_a_request_the_form_refuses_makes_no_pull(hub, admin_client, tiny_model_path):
    ModelEntry.objects.create(name="taken", path=str(tiny_model_path))
    for data, sentence in [
        ({"source": "not an id"}, "is not a hub model id"),
        ({"source": MLX_REPO, "name": "taken"}, "A model called &#x27;taken&#x27; is registered"),
        ({"source": MLX_REPO, "kind": "embedding", "quantize": "4"}, "are not quantized"),
    ]:
        answer = admin_client.post(ADD, {"kind": "chat", "group_size": "64", **data})
        assert answer.status_code == 200
        assert sentence in answer.content.decode()
    assert not ModelPull.objects.exists()


def test_cancel_from_the_admin(hub, admin_client):
    pull = pull_create(source=MLX_REPO)
    cancel = reverse("admin:inference_modelpull_cancel", args=[pull.pk])
    assert admin_client.get(cancel).status_code == 405
    answer = admin_client.post(cancel, follow=True)
    assert "Cancelling pull #" in answer.content.decode()
    pull.refresh_from_db()
    assert pull.state == "cancelled"
    again = admin_client.post(cancel, follow=True)
    assert "has ended already" in again.content.decode()


def test_who_may_pull_watch_and_cancel(hub):
    pull = pull_create(source=MLX_REPO)
    watcher = UserFactory(username="watcher", is_staff=True)
    watcher.user_permissions.set(Permission.objects.filter(codename="view_modelpull"))
    client = Client()
    client.force_login(watcher)
    assert client.get(page(pull)).status_code == 200
    assert "Cancel this pull" not in client.get(page(pull)).content.decode()
    assert client.get(PROGRESS).status_code == 200
    assert client.get(ADD).status_code == 403
    cancel = reverse("admin:inference_modelpull_cancel", args=[pull.pk])
    assert client.post(cancel).status_code == 403
    nobody = UserFactory(username="nobody", is_staff=True)
    client.force_login(nobody)
    assert client.get(PROGRESS).status_code == 403
    pull.refresh_from_db()
    assert pull.state == "queued"
