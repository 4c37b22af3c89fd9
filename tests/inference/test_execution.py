"""Execution's accounting holds on the awkward paths: a client that leaves while its usage row
is being written still gets exactly one finished row and its limiter slot back."""

import asyncio
import time

import pytest
from asgiref.sync import sync_to_async

from accounts import limits
from accounts.services import api_key_create, team_membership_ensure, user_get_or_create
from engine.protocol import GenerationRequest, SamplingParams
from inference import execution as execution_module
from inference.execution import Execution
from inference.models import UsageRecord


def make_key():
    user = user_get_or_create(username="exec")
    team, _ = team_membership_ensure(user=user, team_name="exec-team")
    api_key, _ = api_key_create(user=user, team=team, max_parallel=1)
    return api_key


@pytest.mark.django_db(transaction=True)
async def test_cancel_while_the_usage_row_is_written(monkeypatch):
    api_key = await sync_to_async(make_key)()
    real_open = execution_module.usage_open

    def slow_open(**kwargs):
        time.sleep(0.3)
        return real_open(**kwargs)

    monkeypatch.setattr(execution_module, "usage_open", slow_open)
    request = GenerationRequest("req_slow", "m", (1, 2, 3), SamplingParams(max_tokens=4))
    execution = Execution(
        api_key=api_key,
        model="m",
        endpoint="chat.completions",
        request_id="req_slow",
        requests=[request],
    )
    task = asyncio.create_task(execution.start())
    await asyncio.sleep(0.1)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    row = await sync_to_async(UsageRecord.objects.get)(request_id="req_slow")
    assert row.status == UsageRecord.Status.CANCELLED
    assert row.finished_at is not None
    # max_parallel=1: the slot came back, so a new request is admitted.
    admission = await limits.admit(api_key, reserved_tokens=1)
    await admission.release(used_tokens=0)
