"""Pulls as managed tasks: the runner claims each pull once however many processes ask, takes
over a pull whose runner stopped (resuming it) or gives it up after MAX_ATTEMPTS, and a cancel
stops a queued pull, a running one (its files removed) and one whose runner is gone."""

import datetime
import threading

import pytest
from django.db import connection
from django.utils import timezone

from inference.models import ModelEntry, ModelPull
from inference.services.pulls import PullRunner, pull_cancel, pull_claim_next, pull_create
from inference.services.pulls.claims import ERROR_GAVE_UP, MAX_ATTEMPTS
from tests.fixtures.hub import HF_REPO, MLX_REPO
from tests.inference.pulls.conftest import wait_for

pytestmark = pytest.mark.django_db(transaction=True)
AN_HOUR_AGO = datetime.timedelta(hours=1)


def left_by_a_stopped_process(pull: ModelPull, *, attempts: int = 1, **fields) -> ModelPull:
    ModelPull.objects.filter(pk=pull.pk).update(
        runner="gone-host:4242:dead",
        heartbeat_at=timezone.now() - AN_HOUR_AGO,
        attempts=attempts,
        state=ModelPull.State.DOWNLOADING,
        **fields,
    )
    return ModelPull.objects.get(pk=pull.pk)


def leftovers(models_dir) -> list[str]:
    return sorted(p.relative_to(models_dir).as_posix() for p in models_dir.rglob("*"))


def test_a_pull_is_claimed_by_one_runner_only(hub):
    pull = pull_create(source=MLX_REPO, name="once")
    claims: list = []
    barrier = threading.Barrier(4)

    def claim(runner: str) -> None:
        barrier.wait()
        try:
            claims.append(pull_claim_next(runner=runner))
        finally:
            connection.close()

    threads = [threading.Thread(target=claim, args=(f"runner-{n}",)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    won = [claimed for claimed in claims if claimed is not None]
    assert [claimed.pk for claimed in won] == [pull.pk]
    assert ModelPull.objects.get(pk=pull.pk).runner == won[0].runner
    assert pull_claim_next(runner="late") is None  # its runner is alive (fresh heartbeat)


def test_a_pull_whose_process_stopped_is_resumed_by_a_runner(hub, models_dir):
    pull = left_by_a_stopped_process(pull_create(source=HF_REPO, name="resumed", bits=4))
    ended = PullRunner(runner="web-1").run_once()
    assert (ended.pk, ended.state, ended.attempts, ended.runner) == (pull.pk, "done", 2, "web-1")
    entry = ModelEntry.objects.get(name="resumed")
    assert (entry.source, entry.quantization_bits, entry.quantization_group_size) == (
        HF_REPO,
        4,
        64,
    )
    assert entry.source_revision == hub.repos[HF_REPO].refs["main"] == ended.commit
    assert ended.model == entry and ended.finished_at is not None


def test_a_pull_that_keeps_stopping_its_process_is_given_up(hub, models_dir):
    pull = left_by_a_stopped_process(pull_create(source=MLX_REPO), attempts=MAX_ATTEMPTS)
    assert PullRunner(runner="web-1").run_once() is None
    pull.refresh_from_db()
    assert (pull.state, pull.error) == ("failed", ERROR_GAVE_UP.format(attempts=MAX_ATTEMPTS))
    assert not ModelEntry.objects.exists()


def test_a_queued_pull_is_cancelled_at_once(hub):
    pull = pull_create(source=MLX_REPO)
    assert pull_cancel(pull_id=pull.pk)
    pull.refresh_from_db()
    assert (pull.state, pull.error) == ("cancelled", "Cancelled.")
    assert PullRunner(runner="web-1").run_once() is None
    assert not pull_cancel(pull_id=pull.pk)  # nothing left to cancel


def test_a_running_pull_is_cancelled_and_its_files_removed(hub, models_dir):
    stall = hub.stall_once(MLX_REPO, "model.safetensors", 15 << 20)
    pull = pull_create(source=MLX_REPO, name="stopped")
    ended: list[ModelPull] = []
    runner = PullRunner("web-1")
    thread = threading.Thread(target=lambda: ended.append(runner.run_once()))
    thread.start()
    try:
        assert stall.reached.wait(60)
        assert pull_cancel(pull_id=pull.pk)
        # Its heartbeat reads the cancel (the runner's monitor is its in-memory side) ...
        wait_for(lambda: runner._monitor.cancelled.is_set(), what="the runner to see it")
    finally:
        stall.released.set()  # ... then the hub hangs up, and the download stops
    thread.join(60)
    assert [p.state for p in ended] == ["cancelled"]
    assert not ModelEntry.objects.exists()
    assert leftovers(models_dir) == [".pulls"]


def test_a_pull_cancelled_after_its_runner_stopped_ends_when_taken_over(hub):
    pull = left_by_a_stopped_process(pull_create(source=MLX_REPO), cancel_requested=True)
    assert PullRunner(runner="web-1").run_once() is None
    pull.refresh_from_db()
    assert pull.state == "cancelled"


def test_two_admins_pulling_the_same_repo_get_one_pull(hub, django_user_model):
    alice = django_user_model.objects.create_user("alice")
    bob = django_user_model.objects.create_user("bob")
    first = pull_create(source=MLX_REPO, name="shared", started_by=alice)
    with pytest.raises(ValueError, match=rf"being pulled already \(pull #{first.pk}"):
        pull_create(source=MLX_REPO, name="mine", started_by=bob)
    with pytest.raises(ValueError, match=r"A pull into 'shared' is under way already"):
        pull_create(source=HF_REPO, name="shared", started_by=bob)
    assert ModelPull.objects.count() == 1
