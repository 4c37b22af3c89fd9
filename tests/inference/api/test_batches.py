"""The Batch API through the official `openai` SDK against the live server: the documented flow
(upload, create, retrieve until done, output and error files, list, cancel), lines checked up
front, a bad file, expiry, budgets, and what another team's key sees."""

import io
import json
import time

import openai
import pytest
from django.db.models import Sum

from inference.batch_models import Batch, BatchLine
from inference.models import DailyUsage, UsageRecord
from tests.fixtures.daphne import free_port, server_env, start_daphne, stop_daphne
from tests.inference.api.test_embeddings import (  # noqa: F401  (fixtures)
    EMBED,
    embed_client,
    embedding_folder,
    embedding_model,
)
from tests.inference.conftest import TINY

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture(scope="module")
def live_server_url(django_db_setup, tmp_path_factory):
    """This module's own server, with a batch runner (the suite's shared one has none, so that
    no other server claims the batches of tests that run their own)."""
    port = free_port()
    env = {**server_env(), "ORCHARD_BATCH_RUNNER": "1"}
    log_path = tmp_path_factory.mktemp("daphne-batches") / "server.log"
    process = start_daphne(port=port, env=env, log_path=log_path)
    yield f"http://127.0.0.1:{port}"
    stop_daphne(process)


FINAL = ("completed", "failed", "expired", "cancelled")


def chat_line(custom_id: str, content: str, *, model: str = TINY, max_tokens: int = 4) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
    }


def long_line(custom_id: str, max_tokens: int = 3000) -> dict:
    """A line that generates all of its `max_tokens` (it runs until something stops it)."""
    line = chat_line(custom_id, f"Story {custom_id}.", max_tokens=max_tokens)
    line["body"]["ignore_eos"] = True
    return line


def wait_done(batch_id: str, count: int) -> None:
    done = BatchLine.objects.filter(batch_id=batch_id, state="done")
    deadline = time.monotonic() + 60
    while done.count() < count:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def upload(client: openai.OpenAI, lines: list, name: str = "input.jsonl") -> str:
    text = "\n".join(line if isinstance(line, str) else json.dumps(line) for line in lines)
    return client.files.create(file=(name, io.BytesIO(text.encode())), purpose="batch").id


def wait_for(client: openai.OpenAI, batch_id: str, statuses=FINAL, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch}"
        time.sleep(0.2)


def jsonl(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    lines = [json.loads(line) for line in client.files.content(file_id).text.splitlines()]
    by_id = {line["custom_id"]: line for line in lines}
    assert len(by_id) == len(lines), "a custom_id is in the file twice"
    return by_id


def test_the_documented_flow(client, make_key, live_server_url):
    """Lines run as the endpoint runs them (the same greedy answer as an interactive request),
    in the flex tier, one usage row each marked as batch work; a line the endpoint would refuse
    goes to the error file with its status; another team sees nothing of it."""
    prompts = {f"q{i}": f"Count to {i}." for i in range(4)}
    lines = [chat_line(cid, text) for cid, text in prompts.items()]
    lines.append(chat_line("not-mine", "Hello.", model="no-such-model"))
    lines.append({**chat_line("bad-body", "Hi."), "body": {"model": TINY, "messages": []}})
    file_id = upload(client, lines)
    batch = client.batches.create(
        input_file_id=file_id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"run": "nightly"},
    )
    assert batch.status == "validating" and batch.metadata == {"run": "nightly"}
    batch = wait_for(client, batch.id)

    assert batch.status == "completed", batch
    assert batch.request_counts.total == 6
    assert batch.request_counts.completed == 4 and batch.request_counts.failed == 2
    assert batch.completed_at and batch.in_progress_at and batch.finalizing_at
    output = jsonl(client, batch.output_file_id)
    assert set(output) == set(prompts)
    for custom_id, text in prompts.items():
        line = output[custom_id]
        assert line["response"]["status_code"] == 200 and line["error"] is None
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["service_tier"] == "flex"
        alone = client.chat.completions.create(
            model=TINY,
            messages=[{"role": "user", "content": text}],
            max_tokens=4,
            temperature=0,
        )
        assert body["choices"][0]["message"]["content"] == alone.choices[0].message.content
    errors = jsonl(client, batch.error_file_id)
    assert set(errors) == {"not-mine", "bad-body"}
    assert errors["not-mine"]["response"]["status_code"] == 404
    assert errors["not-mine"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert errors["bad-body"]["response"]["status_code"] == 400

    rows = UsageRecord.objects.filter(batch_id=batch.id)
    assert rows.count() == 4
    assert set(rows.values_list("service_tier", flat=True)) == {"flex"}
    assert set(rows.values_list("request_id", flat=True)) == {
        output[c]["response"]["request_id"] for c in prompts
    }
    tokens = rows.aggregate(p=Sum("prompt_tokens"), c=Sum("completion_tokens"))
    assert batch.usage.input_tokens == tokens["p"] and batch.usage.output_tokens == tokens["c"]
    assert DailyUsage.objects.filter(batch=True).aggregate(n=Sum("num_requests"))["n"] == 4

    assert batch.id in [b.id for b in client.batches.list()]
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)
    other = openai.OpenAI(
        base_url=f"{live_server_url}/v1", api_key=make_key("bob", "team-b"), max_retries=0
    )
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(batch.output_file_id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
    assert batch.id not in [b.id for b in other.batches.list()]


def test_a_bad_file_fails_in_validating_with_its_lines(client):
    lines = [
        chat_line("a", "Hi."),
        "{not json",
        chat_line("a", "Again."),
        {**chat_line("c", "Hi."), "url": "/v1/completions"},
        {"method": "POST", "url": "/v1/chat/completions", "body": {}},
    ]
    batch = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch = wait_for(client, batch.id)
    assert batch.status == "failed" and batch.failed_at
    assert [(e.code, e.line) for e in batch.errors.data] == [
        ("invalid_json_line", 2),
        ("duplicate_custom_id", 3),
        ("mismatched_endpoint", 4),
        ("invalid_custom_id", 5),
    ]
    assert batch.output_file_id is None and batch.request_counts.total == 0
    assert not UsageRecord.objects.filter(batch_id=batch.id).exists()


def test_requests_the_api_refuses(client):
    file_id = upload(client, [chat_line("a", "Hi.")])
    cases = [
        ({"endpoint": "/v1/images", "completion_window": "24h"}, "endpoint"),
        ({"endpoint": "/v1/chat/completions", "completion_window": "1h"}, "completion_window"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as raised:
            client.batches.create(input_file_id=file_id, **fields)
        assert raised.value.body["param"] == param
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")
    # What cannot be an id (a NUL byte PostgreSQL would refuse in a query) is not found.
    with pytest.raises(openai.NotFoundError):
        client.batches.create(
            input_file_id="file-\x00", endpoint="/v1/chat/completions", completion_window="24h"
        )
    with pytest.raises(openai.NotFoundError):
        client.get("/batches/batch_%00", cast_to=object)
    with pytest.raises(openai.NotFoundError):
        client.post("/batches/batch_%00/cancel", cast_to=object)
    with pytest.raises(openai.BadRequestError):
        client.batches.list(after="batch_\x00")


def test_cancel_stops_the_lines_and_keeps_what_finished(client):
    """Short lines finish; long ones are stopped by the cancel within moments (the engine
    aborts them), billed for what they computed, and reported as cancelled."""
    lines = [chat_line(f"short{i}", f"Hi {i}.", max_tokens=2) for i in range(4)]
    lines += [long_line(f"long{i}") for i in range(4)]
    batch = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    wait_done(batch.id, 4)
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    asked = time.monotonic()
    batch = wait_for(client, batch.id, timeout=30)
    assert time.monotonic() - asked < 5  # not the 3,000 tokens each long line asked for
    assert batch.status == "cancelled" and batch.cancelled_at
    output, errors = jsonl(client, batch.output_file_id), jsonl(client, batch.error_file_id)
    assert set(output) == {f"short{i}" for i in range(4)}
    assert set(errors) == {f"long{i}" for i in range(4)}
    assert {line["error"]["code"] for line in errors.values()} == {"batch_cancelled"}
    assert batch.request_counts.completed == 4 and batch.request_counts.failed == 4
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: no change
    # The stopped lines are billed for what they computed, then nothing more runs.
    rows = UsageRecord.objects.filter(batch_id=batch.id)
    deadline = time.monotonic() + 10
    while rows.filter(status="in_progress").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert rows.filter(status="completed").count() == 4
    stopped = rows.filter(status="cancelled")
    assert stopped.count() == 4
    assert all(0 < row.completion_tokens < 3000 for row in stopped)


def test_a_batch_past_its_window_expires(client):
    lines = [chat_line("short", "Hi.", max_tokens=2)] + [long_line(f"long{i}") for i in range(3)]
    batch = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    wait_done(batch.id, 1)
    Batch.objects.filter(pk=batch.id).update(expires_at=Batch.objects.get(pk=batch.id).created_at)
    batch = wait_for(client, batch.id, timeout=30)
    assert batch.status == "expired" and batch.expired_at
    assert set(jsonl(client, batch.output_file_id)) == {"short"}
    errors = jsonl(client, batch.error_file_id)
    assert set(errors) == {"long0", "long1", "long2"}
    assert {line["error"]["code"] for line in errors.values()} == {"batch_expired"}


def test_a_budget_that_runs_out_stops_the_batch(make_key, tiny_models, live_server_url):
    client = openai.OpenAI(
        base_url=f"{live_server_url}/v1",
        api_key=make_key("carol", "team-c", budget_tokens=150),
        max_retries=0,
    )
    lines = [chat_line(f"l{i}", f"Tell me about {i}.", max_tokens=30) for i in range(12)]
    batch = client.batches.create(
        input_file_id=upload(client, lines),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    batch = wait_for(client, batch.id)
    assert batch.status == "failed"
    assert batch.errors.data[0].code == "insufficient_quota"
    errors = jsonl(client, batch.error_file_id)
    assert {line["error"]["code"] for line in errors.values() if line["error"]} == {
        "insufficient_quota"
    }
    output = jsonl(client, batch.output_file_id)
    assert len(output) + len(errors) == 12
    used = UsageRecord.objects.filter(batch_id=batch.id).aggregate(
        t=Sum("prompt_tokens") + Sum("completion_tokens")
    )["t"]
    assert used <= 150


def test_completions_responses_and_embeddings_lines(client, embed_client):  # noqa: F811
    """Each endpoint's lines answer what the endpoint answers."""
    for endpoint, body, check in (
        (
            "/v1/completions",
            {"model": TINY, "prompt": "Once upon", "max_tokens": 3, "temperature": 0},
            lambda b: b["object"] == "text_completion" and b["usage"]["completion_tokens"] == 3,
        ),
        (
            "/v1/responses",
            {"model": TINY, "input": "Hello.", "max_output_tokens": 3, "temperature": 0},
            lambda b: b["object"] == "response" and b["usage"]["output_tokens"] == 3,
        ),
    ):
        line = {"custom_id": "x", "method": "POST", "url": endpoint, "body": body}
        batch = client.batches.create(
            input_file_id=upload(client, [line]), endpoint=endpoint, completion_window="24h"
        )
        batch = wait_for(client, batch.id)
        assert batch.status == "completed", batch
        answer = jsonl(client, batch.output_file_id)["x"]["response"]["body"]
        assert check(answer), answer
        assert batch.usage.output_tokens == 3

    texts = ["A man is playing a guitar.", "Stocks fell today."]
    lines = [
        {
            "custom_id": f"e{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": EMBED, "input": text},
        }
        for i, text in enumerate(texts)
    ]
    batch = embed_client.batches.create(
        input_file_id=upload(embed_client, lines),
        endpoint="/v1/embeddings",
        completion_window="24h",
    )
    batch = wait_for(embed_client, batch.id)
    assert batch.status == "completed", batch
    output = jsonl(embed_client, batch.output_file_id)
    alone = embed_client.embeddings.create(model=EMBED, input=texts).data
    for i in range(2):
        vector = output[f"e{i}"]["response"]["body"]["data"][0]["embedding"]
        assert vector == pytest.approx(alone[i].embedding, abs=1e-5)
    assert UsageRecord.objects.filter(batch_id=batch.id, endpoint="embeddings").count() == 2


def test_a_team_with_many_batches_does_not_hold_back_another_team(
    client, make_key, live_server_url
):
    """A team's batches run one at a time per runner, so another team's batch starts beside
    them rather than after them (the engine then shares the flex tier between the two)."""
    team_a = [
        client.batches.create(
            input_file_id=upload(client, [long_line(f"{n}-{i}", 400) for i in range(2)]),
            endpoint="/v1/chat/completions",
            completion_window="24h",
        ).id
        for n in range(3)
    ]
    other = openai.OpenAI(
        base_url=f"{live_server_url}/v1", api_key=make_key("bob", "team-b"), max_retries=0
    )
    team_b = other.batches.create(
        input_file_id=upload(other, [chat_line("short", "Hi.", max_tokens=2)]),
        endpoint="/v1/chat/completions",
        completion_window="24h",
    ).id
    assert wait_for(other, team_b).status == "completed"
    statuses = [Batch.objects.get(pk=batch_id).status for batch_id in team_a]
    assert statuses.count("validating") >= 1, statuses  # team A's later batches wait their turn
    for batch_id in team_a:
        client.batches.cancel(batch_id)
    for batch_id in team_a:
        assert wait_for(client, batch_id).status == "cancelled"
