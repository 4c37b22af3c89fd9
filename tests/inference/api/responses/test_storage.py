"""What /v1/responses stores, over real HTTP with the official client: a chain stores each item
once (its bytes grow linearly with its length, measured from the database), deleting earlier
responses keeps a chain continuable, and a team past its storage quota gets a clear 400 before
anything runs while another team still stores."""

import json

import openai
import pytest

from accounts.models import Team
from inference.models import StoredResponse, TeamResponseStorage, UsageRecord
from tests.inference.api.responses.scripted import MODEL


def row_bytes(response_id: str) -> int:
    """A stored response's bytes, measured from what its row holds."""
    row = StoredResponse.objects.get(pk=response_id)
    return sum(
        len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())
        for value in (row.body, row.new_input_items)
    )


def team_bytes(name: str) -> int:
    counter = TeamResponseStorage.objects.filter(team__name=name).first()
    return counter.num_bytes if counter else 0


def test_a_chain_of_twenty_grows_linearly(client):
    responses = [client.responses.create(model=MODEL, input="Say hello")]
    for _ in range(19):
        responses.append(
            client.responses.create(
                model=MODEL, input="Say hello", previous_response_id=responses[-1].id
            )
        )
    sizes = [row_bytes(response.id) for response in responses]
    # Each step stores what it added: the k-th total is about k steps, not 1 + 2 + ... + k.
    step = sizes[1]
    for k in range(1, len(sizes) + 1):
        assert sum(sizes[:k]) <= k * step * 1.1
    assert max(sizes) <= step * 1.1
    assert team_bytes("team-a") == sum(sizes)
    # ... while the last one still answered the whole conversation.
    items = client.responses.input_items.list(responses[-1].id, order="asc", limit=100)
    texts = [item.content[0].text for item in items.data]
    assert texts == ["Say hello", "Hello there!"] * 19 + ["Say hello"]


def test_deleting_earlier_responses_keeps_the_chain_continuable(client):
    first = client.responses.create(model=MODEL, input="turn one")
    second = client.responses.create(model=MODEL, input="turn two", previous_response_id=first.id)
    third = client.responses.create(model=MODEL, input="turn three", previous_response_id=second.id)
    client.responses.delete(first.id)
    client.responses.delete(second.id)
    for gone in (first.id, second.id):
        for attempt in (
            lambda gone=gone: client.responses.retrieve(gone),
            lambda gone=gone: client.responses.delete(gone),
            lambda gone=gone: client.responses.input_items.list(gone),
            lambda gone=gone: client.responses.create(
                model=MODEL, input="Say hello", previous_response_id=gone
            ),
        ):
            with pytest.raises(openai.NotFoundError):
                attempt()
    assert client.responses.retrieve(third.id).output_text == "Third reply."
    fourth = client.responses.create(model=MODEL, input="Say hello", previous_response_id=third.id)
    texts = [
        item.content[0].text for item in client.responses.input_items.list(fourth.id, order="asc")
    ]
    assert texts == [
        "turn one",
        "First reply.",
        "turn two",
        "Second reply.",
        "turn three",
        "Third reply.",
        "Say hello",
    ]
    client.responses.delete(third.id)
    client.responses.delete(fourth.id)
    # Nothing continues the hidden ones any more: everything went, and its bytes.
    assert not StoredResponse.objects.exists() and team_bytes("team-a") == 0


def test_a_team_at_its_quota_is_refused_before_it_runs_and_another_still_stores(
    client, scripted_url, make_key
):
    kept = client.responses.create(model=MODEL, input="Say hello")
    used = team_bytes("team-a")
    Team.objects.filter(name="team-a").update(response_storage_bytes=used)
    num_rows = UsageRecord.objects.filter(team__name="team-a").count()
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.responses.create(
                model=MODEL, input="Say hello", previous_response_id=kept.id, stream=stream
            )
        error = caught.value.body
        assert (error["code"], error["param"]) == ("storage_quota_exceeded", "store")
        assert f"{used:,} bytes" in error["message"] and "store" in error["message"]
    # Refused before it ran: no tokens, no usage row.
    assert UsageRecord.objects.filter(team__name="team-a").count() == num_rows
    unstored = client.responses.create(model=MODEL, input="Say hello", store=False)
    assert unstored.output_text == "Hello there!" and team_bytes("team-a") == used
    other = openai.OpenAI(
        base_url=f"{scripted_url}/v1", api_key=make_key("bob", "team-b"), max_retries=0
    )
    theirs = other.responses.create(model=MODEL, input="Say hello")
    assert other.responses.retrieve(theirs.id).output_text == "Hello there!"
    assert team_bytes("team-b") > 0
    # Deleting frees the quota again.
    client.responses.delete(kept.id)
    again = client.responses.create(model=MODEL, input="Say hello")
    assert client.responses.retrieve(again.id).output_text == "Hello there!"
