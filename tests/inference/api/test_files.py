"""OpenAI's Files API (/v1/files, inference/batches/), over real HTTP with the official `openai`
client against a daphne of this module's own: small limits (a file of 256 KiB, a team's files
600 KiB, other bodies 64 KiB) and its own ORCHARD_HOME, so its files folder is this module's.
Uploads round-trip byte for byte, files are the team's own (another team's key gets 404s and an
empty list), refused uploads (purpose, size, quota, not UTF-8) leave nothing on disk, lists
page; and, in-process, the quota holds against two uploads at once and batch output files are
never refused for it."""

import hashlib
import shutil
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from django.db import connections
from django.utils import timezone

from accounts.models import ApiKey
from accounts.services import api_key_create, team_membership_ensure, user_get_or_create
from inference.batch_models import Batch, StoredFile
from inference.batches.files import (
    FileQuotaExceeded,
    FileTooLarge,
    file_create,
    file_create_output,
    file_delete,
    files_storage_used,
)
from tests.fixtures.daphne import daphne_servers, server_env

KIB = 1024
FILE_MAX = 256 * KIB
QUOTA = 600 * KIB
BODY_CAP = 64 * KIB  # ORCHARD_MAX_BODY_BYTES: uploads have a cap of their own, above it


def jsonl(num_bytes: int) -> bytes:
    """A JSONL file of about `num_bytes` (not ASCII only), exactly that long."""
    line = '{"custom_id": "ä-1", "method": "POST", "url": "/v1/chat/completions"}\n'.encode()
    data = line * (num_bytes // len(line) + 1)
    return data[: num_bytes - 1] + b"\n"


@pytest.fixture(scope="module")
def files_server(django_db_setup, tmp_path_factory):
    home = tmp_path_factory.mktemp("files-home")
    env = {
        **server_env(),
        "ORCHARD_HOME": str(home),
        "ORCHARD_FILE_MAX_BYTES": str(FILE_MAX),
        "ORCHARD_FILE_STORAGE_BYTES_PER_TEAM": str(QUOTA),
        "ORCHARD_MAX_BODY_BYTES": str(BODY_CAP),
        "ORCHARD_PRELOAD_MODELS": "0",
        "ORCHARD_BATCH_RUNNER": "0",
    }
    with daphne_servers(1, env, home) as (url,):
        yield url, home / "files"


@pytest.fixture
def server(files_server):
    url, files_dir = files_server
    yield url, files_dir
    # Team ids come back after the database is flushed: the next test starts with no files.
    shutil.rmtree(files_dir, ignore_errors=True)


def client_for(url: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)


def on_disk(files_dir: Path, team_id: int) -> list[str]:
    folder = files_dir / str(team_id)
    return sorted(path.name for path in folder.iterdir()) if folder.exists() else []


def test_a_file_round_trips_for_its_team_only(server, make_key):
    url, files_dir = server
    key_a, key_b = make_key("alice", "team-a"), make_key("bob", "team-b")
    alice, bob = client_for(url, key_a), client_for(url, key_b)
    carol = client_for(url, make_key("carol", "team-a"))  # another key of alice's team
    data = jsonl(100 * KIB)  # over ORCHARD_MAX_BODY_BYTES: the upload route's own cap applies

    created = alice.files.create(file=("requests.jsonl", data), purpose="batch")
    assert created.id.startswith("file-") and len(created.id) == len("file-") + 24
    assert (created.object, created.bytes, created.filename) == (
        "file",
        len(data),
        "requests.jsonl",
    )
    assert (created.purpose, created.status, created.status_details) == ("batch", "processed", None)
    assert created.expires_at is None and abs(created.created_at - time.time()) < 60
    assert alice.files.retrieve(created.id) == created
    assert alice.files.content(created.id).read() == data
    assert [f.id for f in carol.files.list()] == [created.id]
    row = StoredFile.objects.get(pk=created.id)
    assert row.sha256 == hashlib.sha256(data).hexdigest() and row.num_bytes == len(data)
    team_a = row.team_id
    assert on_disk(files_dir, team_a) == [created.id]  # no temporary file left beside it
    assert (files_dir / str(team_a) / created.id).read_bytes() == data
    with httpx.Client(base_url=f"{url}/v1", timeout=30) as http:
        content = http.get(
            f"/files/{created.id}/content", headers={"Authorization": f"Bearer {key_a}"}
        )
        assert content.headers["content-type"] == "application/octet-stream"
        assert content.headers["content-length"] == str(len(data))
        # No key: a 401, before the upload's body is parsed (nothing is written).
        assert http.get("/files").status_code == 401
        refused = http.post("/files", files={"file": ("x.jsonl", data)}, data={"purpose": "batch"})
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
    assert on_disk(files_dir, team_a) == [created.id]

    # Another team's key: as if the file did not exist.
    with pytest.raises(openai.NotFoundError):
        bob.files.retrieve(created.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.content(created.id)
    with pytest.raises(openai.NotFoundError):
        bob.files.delete(created.id)
    assert bob.files.list().data == []

    deleted = alice.files.delete(created.id)
    assert (deleted.id, deleted.object, deleted.deleted) == (created.id, "file", True)
    with pytest.raises(openai.NotFoundError):
        alice.files.retrieve(created.id)
    assert on_disk(files_dir, team_a) == []


def test_uploads_are_refused_with_what_to_change_and_leave_nothing(server, make_key):
    url, files_dir = server
    alice = client_for(url, make_key("alice", "team-a"))
    team_a = ApiKey.objects.get().team_id

    with pytest.raises(openai.BadRequestError) as refused:
        alice.files.create(file=("a.jsonl", jsonl(KIB)), purpose="assistants")
    assert refused.value.param == "purpose" and "batch" in refused.value.message
    for data in (b"\xff\xfe{}\n", b""):  # not UTF-8; empty
        with pytest.raises(openai.BadRequestError) as refused:
            alice.files.create(file=("a.jsonl", data), purpose="batch")
        assert refused.value.param == "file"
    # Just over the file limit (within the body cap): the service stops reading at the limit.
    with pytest.raises(openai.APIStatusError) as refused:
        alice.files.create(file=("big.jsonl", jsonl(FILE_MAX + 1)), purpose="batch")
    assert refused.value.status_code == 413 and refused.value.code == "file_too_large"
    assert f"{FILE_MAX:,}" in refused.value.message
    # Far over: the body cap refuses it before Django.
    with pytest.raises(openai.APIStatusError) as refused:
        alice.files.create(file=("big.jsonl", jsonl(FILE_MAX + 128 * KIB)), purpose="batch")
    assert refused.value.status_code == 413 and refused.value.code == "request_too_large"
    assert on_disk(files_dir, team_a) == []

    # The quota: two files of 250 KiB fit in 600 KiB, a third of 150 KiB does not.
    kept = [alice.files.create(file=("a.jsonl", jsonl(250 * KIB)), purpose="batch") for _ in "ab"]
    with pytest.raises(openai.BadRequestError) as refused:
        alice.files.create(file=("c.jsonl", jsonl(150 * KIB)), purpose="batch")
    assert refused.value.code == "storage_quota_exceeded" and f"{QUOTA:,}" in refused.value.message
    assert on_disk(files_dir, team_a) == sorted(f.id for f in kept)

    # The input file of a batch still running is not deleted; once the batch ended it is.
    now = timezone.now()
    batch = Batch.objects.create(
        id="batch_files_test",
        team_id=team_a,
        endpoint="/v1/chat/completions",
        status=Batch.Status.IN_PROGRESS,
        input_file_id=kept[0].id,
        input_file_name=kept[0].id,
        created_at=now,
        expires_at=now,
    )
    with pytest.raises(openai.ConflictError) as refused:
        alice.files.delete(kept[0].id)
    assert refused.value.code == "file_in_use" and batch.id in refused.value.message
    Batch.objects.filter(pk=batch.pk).update(status=Batch.Status.COMPLETED)
    assert alice.files.delete(kept[0].id).deleted
    assert Batch.objects.get(pk=batch.pk).input_file_id is None
    assert on_disk(files_dir, team_a) == [kept[1].id]


def test_lists_page_by_cursor(server, make_key):
    url, _ = server
    key = make_key("alice", "team-a")
    alice = client_for(url, key)
    ids = [alice.files.create(file=(f"{i}.jsonl", b"{}\n"), purpose="batch").id for i in range(5)]
    newest_first = ids[::-1]

    first = alice.files.list(limit=2)
    assert [f.id for f in first.data] == newest_first[:2] and first.has_more
    # The client follows `after` through every page.
    assert [f.id for f in alice.files.list(limit=2)] == newest_first
    assert [f.id for f in alice.files.list(limit=2, order="asc")] == ids
    assert [f.id for f in alice.files.list(after=ids[3], limit=10)] == newest_first[2:]
    assert [f.id for f in alice.files.list(purpose="batch_output")] == []
    with httpx.Client(base_url=f"{url}/v1", timeout=30) as http:
        headers = {"Authorization": f"Bearer {key}"}
        page = http.get("/files", params={"limit": 2, "after": ids[3]}, headers=headers).json()
        assert page["object"] == "list" and page["has_more"]
        assert (page["first_id"], page["last_id"]) == (ids[2], ids[1])
        last = http.get("/files", params={"after": ids[0]}, headers=headers).json()
        assert (last["data"], last["first_id"], last["last_id"], last["has_more"]) == (
            [],
            None,
            None,
            False,
        )
        refused = http.get("/files", params={"limit": 0}, headers=headers)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "limit"


def _api_key(username: str, team: str) -> ApiKey:
    user = user_get_or_create(username=username)
    team_obj, _ = team_membership_ensure(user=user, team_name=team)
    return api_key_create(user=user, team=team_obj)[0]


@pytest.mark.django_db(transaction=True)
def test_the_quota_holds_against_concurrent_uploads_and_spares_batch_results(settings, tmp_path):
    settings.ORCHARD_FILES_DIR = tmp_path
    settings.ORCHARD_FILE_MAX_BYTES = 100
    settings.ORCHARD_FILE_STORAGE_BYTES_PER_TEAM = 150
    api_key = _api_key("alice", "team-a")
    folder = tmp_path / str(api_key.team_id)

    # Reading stops at the limit: a huge upload is not read to its end.
    pulled = []

    def endless():
        while True:
            pulled.append(1)
            yield b"x" * 40

    with pytest.raises(FileTooLarge):
        file_create(api_key=api_key, purpose="batch", filename="a", chunks=endless())
    assert len(pulled) == 3 and list(folder.iterdir()) == []

    # Two uploads of 80 bytes at once, both past the first check before either stores: the
    # team's row lock lets one in; the other is refused and leaves no bytes.
    barrier = threading.Barrier(2, timeout=10)
    outcomes = []

    def upload():
        def chunks():
            yield b"{}\n" * 20
            barrier.wait()  # both have written their bytes
            yield b"{}\n" * 6 + b"\n\n"

        try:
            file_create(api_key=api_key, purpose="batch", filename="b", chunks=chunks())
            outcomes.append("stored")
        except FileQuotaExceeded:
            outcomes.append("refused")
        finally:
            connections.close_all()

    threads = [threading.Thread(target=upload) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["refused", "stored"]
    assert files_storage_used(team_id=api_key.team_id) == 80
    assert len(list(folder.iterdir())) == 1

    # A batch's results are written even past the quota (and past the file limit); they count,
    # so the next upload is refused before it is read.
    output = file_create_output(
        team_id=api_key.team_id, api_key_id=api_key.pk, filename="out.jsonl", chunks=[b"r" * 200]
    )
    assert (output.purpose, output.num_bytes) == ("batch_output", 200)
    assert (folder / output.id).read_bytes() == b"r" * 200
    assert files_storage_used(team_id=api_key.team_id) == 280
    with pytest.raises(FileQuotaExceeded, match="no room is left"):
        file_create(api_key=api_key, purpose="batch", filename="c", chunks=[b"{}\n"])
    assert file_delete(team_id=api_key.team_id, file_id=output.id)
    assert not (folder / output.id).exists()
    assert not file_delete(team_id=api_key.team_id, file_id=output.id)
