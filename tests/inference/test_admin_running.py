"""The running-now page's rules through Django's test client: staff see the requests in
progress of the teams they belong to, and cancel only those of the teams they own (never an
embeddings request); what a process writes to its running rows and reads back from them."""

import pytest
from django.test import Client
from django.urls import reverse

from accounts.models import Membership
from inference.models import UsageRecord
from inference.services.running import CANCEL_REQUESTED, running_rows_sync
from inference.services.usage import usage_finish
from tests.factories import ApiKeyFactory, MembershipFactory, TeamFactory, UsageRecordFactory
from tests.inference.test_admin_usage import staff

pytestmark = pytest.mark.django_db
RUNNING = reverse("admin:inference_usagerecord_running")


def test_staff_cancel_only_their_own_teams_running_requests():
    owned, member_of, other = TeamFactory(), TeamFactory(), TeamFactory()
    user = staff("oona", owned, Membership.Role.OWNER, ["view_usagerecord"])
    MembershipFactory(team=member_of, user=user, role=Membership.Role.MEMBER)
    mine = UsageRecordFactory(api_key=ApiKeyFactory(team=owned, name="mine"), prompt_tokens=7)
    theirs = UsageRecordFactory(api_key=ApiKeyFactory(team=member_of, name="theirs"))
    embedding = UsageRecordFactory(api_key=mine.api_key, endpoint="embeddings")
    UsageRecordFactory(api_key=ApiKeyFactory(team=other, name="hidden"))
    done = UsageRecordFactory(api_key=mine.api_key, request_id="req-done")
    usage_finish(record_id=done.pk, status=UsageRecord.Status.COMPLETED)
    client = Client()
    client.force_login(user)
    page = client.get(RUNNING)
    rows = {row["record"].pk: row["may_cancel"] for row in page.context["rows"]}
    assert rows == {mine.pk: True, theirs.pk: False, embedding.pk: False}
    assert "7 / 0" in page.content.decode()

    for record in (theirs, embedding, done):
        answer = client.post(RUNNING, {"record": record.pk, "label": "x"}, follow=True)
        assert "is no longer running, or is not yours to stop" in answer.content.decode()
    assert client.post(RUNNING, {"record": mine.pk, "label": "mine"}).status_code == 302
    assert UsageRecord.objects.get(pk=mine.pk).error_code == CANCEL_REQUESTED
    assert set(UsageRecord.objects.exclude(pk=mine.pk).values_list("error_code", flat=True)) == {""}
    assert "cancelling…" in client.get(RUNNING).content.decode()


def test_a_process_writes_its_running_rows_tokens_and_reads_their_cancels():
    running, asked = UsageRecordFactory(), UsageRecordFactory(error_code=CANCEL_REQUESTED)
    finished = UsageRecordFactory()
    usage_finish(record_id=finished.pk, status=UsageRecord.Status.COMPLETED, completion_tokens=3)
    progress = {row.pk: (10, 4, 25) for row in (running, asked, finished)}
    stop = running_rows_sync(progress=progress, row_ids=[running.pk, asked.pk, finished.pk])
    assert stop == {asked.pk}
    running.refresh_from_db()
    assert (running.prompt_tokens, running.cached_tokens, running.completion_tokens) == (10, 4, 25)
    finished.refresh_from_db()
    assert finished.completion_tokens == 3  # a finished row is never written again
