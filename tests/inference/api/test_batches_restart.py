"""A batch outlives the processes running it: stopped (its lines given back) and killed (its
claim taken over once its heartbeat is older than the lease), the next process resumes it, and
every line is answered once and billed once."""

import io
import json
import signal
import time
from datetime import timedelta

import openai
import pytest
from django.db.models import Sum
from django.utils import timezone

from inference.batch_models import Batch, BatchLine
from inference.batches.runner import LEASE_S
from inference.models import DailyUsage, UsageRecord
from tests.fixtures.daphne import free_port, server_env, start_daphne, stop_daphne
from tests.inference.conftest import TINY

pytestmark = pytest.mark.django_db(transaction=True)
NUM_LINES = 8


def _server(tmp_path, name):
    port = free_port()
    env = {**server_env(), "ORCHARD_BATCH_CONCURRENCY": "2", "ORCHARD_BATCH_RUNNER": "1"}
    process = start_daphne(port=port, env=env, log_path=tmp_path / f"{name}.log")
    return process, f"http://127.0.0.1:{port}/v1"


def _done_at_least(batch_id: str, count: int) -> int:
    done = BatchLine.objects.filter(batch_id=batch_id, state="done")
    deadline = time.monotonic() + 60
    while done.count() < count:
        assert time.monotonic() < deadline, Batch.objects.get(pk=batch_id).status
        time.sleep(0.05)
    return done.count()


def test_a_batch_resumes_after_a_stop_and_a_kill_without_running_a_line_twice(
    tmp_path, make_key, tiny_models
):
    api_key = make_key()
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": TINY,
                "messages": [{"role": "user", "content": f"Line {i}."}],
                "max_tokens": 48,
                "ignore_eos": True,
                "temperature": 0,
            },
        }
        for i in range(NUM_LINES)
    ]
    text = "\n".join(json.dumps(line) for line in lines).encode()

    first, url = _server(tmp_path, "first")
    client = openai.OpenAI(base_url=url, api_key=api_key, max_retries=0)
    file_id = client.files.create(file=("in.jsonl", io.BytesIO(text)), purpose="batch").id
    batch_id = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    ).id
    _done_at_least(batch_id, 2)
    stop_daphne(first)  # a stop: the runner gives its batch back at once
    assert Batch.objects.get(pk=batch_id).runner == ""

    second, url = _server(tmp_path, "second")
    done = _done_at_least(batch_id, _done_at_least(batch_id, 0) + 2)
    second.send_signal(signal.SIGKILL)  # a crash: its claim stays until the lease runs out
    second.wait()
    batch = Batch.objects.get(pk=batch_id)
    assert batch.runner and batch.status == "in_progress" and done < NUM_LINES
    # As if the lease had passed (LEASE_S without a heartbeat).
    Batch.objects.filter(pk=batch_id).update(
        heartbeat_at=timezone.now() - timedelta(seconds=LEASE_S + 1)
    )

    third, url = _server(tmp_path, "third")
    try:
        client = openai.OpenAI(base_url=url, api_key=api_key, max_retries=0)
        deadline = time.monotonic() + 120
        while (batch := client.batches.retrieve(batch_id)).status != "completed":
            assert batch.status in ("in_progress", "finalizing"), batch
            assert time.monotonic() < deadline
            time.sleep(0.2)
        output = [
            json.loads(line)
            for line in client.files.content(batch.output_file_id).text.splitlines()
        ]
    finally:
        stop_daphne(third)

    assert sorted(line["custom_id"] for line in output) == sorted(
        f"line-{i}" for i in range(NUM_LINES)
    )
    assert batch.request_counts.completed == NUM_LINES and batch.error_file_id is None
    rows = UsageRecord.objects.filter(batch_id=batch_id)
    assert rows.count() == NUM_LINES
    assert set(rows.values_list("status", flat=True)) == {"completed"}
    assert set(rows.values_list("request_id", flat=True)) == {
        line["response"]["request_id"] for line in output
    }
    assert all(row.completion_tokens == 48 for row in rows)
    daily = DailyUsage.objects.filter(batch=True).aggregate(
        n=Sum("num_requests"), c=Sum("completion_tokens")
    )
    assert daily == {"n": NUM_LINES, "c": 48 * NUM_LINES}
    assert Batch.objects.get(pk=batch_id).attempts == 1  # one takeover, of the killed claim
