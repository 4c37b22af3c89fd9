"""`manage.py pull` against the local hub: a model by id registered with its source, commit and
size; conversion and quantization; each failure a one-line error with a non-zero exit and
nothing registered or left on disk; and a pull killed mid-download resumed by the next one with
a Range request, ending with the hub's very bytes."""

import ctypes
import datetime
import json
import os
import signal
import sys
from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.db.models import Sum
from django.utils import timezone

from inference.models import ModelEntry, ModelPull
from inference.services.pulls.requests import (
    ERROR_EMBEDDING_QUANTIZED,
    ERROR_NAME_TAKEN,
)
from inference.services.pulls.run import MESSAGE_INTERRUPTED
from inference.services.registry import model_register
from tests.fixtures.hub import (
    GATED_REPO,
    HF_REPO,
    MLX_REPO,
    ODD_REPO,
)
from tests.inference.pulls.conftest import finish, pull_row, shell_env, start_pull, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def pull(*args: str) -> tuple[str, str]:
    out, err = StringIO(), StringIO()
    call_command("pull", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def files_of(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def test_pull_registers_an_mlx_model_by_id(hub, models_dir):
    out, err = pull(f"{MLX_REPO}@v1", "--name", "tiny")
    entry = ModelEntry.objects.get(name="tiny")
    commit = hub.repos[MLX_REPO].refs["v1"]
    assert (entry.source, entry.source_revision) == (MLX_REPO, commit)
    assert entry.quantization_bits is None and entry.kind == "chat"
    assert entry.path == str(models_dir / "tiny")
    on_disk = files_of(models_dir / "tiny")
    assert entry.size_on_disk_bytes == sum(len(data) for data in on_disk.values())
    assert on_disk == {name: hub.repos[MLX_REPO].files[name] for name in on_disk}
    row = ModelPull.objects.get()
    assert (row.state, row.origin, row.model, row.commit) == ("done", "shell", entry, commit)
    assert row.done_bytes == row.total_bytes == entry.size_on_disk_bytes
    assert out.startswith(f"Registered tiny (chat, as published): {MLX_REPO}@{commit[:12]} in ")
    assert "downloading" in err and "100.0%" in err


def test_pull_converts_and_quantizes_under_a_default_name(hub, models_dir):
    out, _ = pull(HF_REPO, "--quantize", "8", "--group-size", "32")
    entry = ModelEntry.objects.get(name="tiny-llama-hf-8bit")
    assert (entry.quantization_bits, entry.quantization_group_size) == (8, 32)
    config = json.loads((models_dir / entry.name / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["quantization"]["group_size"] == 32
    assert "8-bit, group 32" in out


FAILURES = [
    ("nobody/nothing", [], "There is no model nobody/nothing on "),
    (f"{MLX_REPO}@no-such-branch", [], "has no revision 'no-such-branch'"),
    (GATED_REPO, [], f"{GATED_REPO} is gated: accept its conditions at "),
    (ODD_REPO, [], "cannot be served: mlx-lm "),
    (HF_REPO, ["--quantize", "4"], "Not enough disk space for "),
]


def leftovers(models_dir) -> list[str]:
    return sorted(p.relative_to(models_dir).as_posix() for p in models_dir.rglob("*"))


@pytest.mark.parametrize(("source", "extra", "sentence"), FAILURES)
def test_a_failed_pull_says_why_in_one_line_and_leaves_nothing(
    hub, models_dir, monkeypatch, source, extra, sentence
):
    if "disk space" in sentence:
        monkeypatch.setattr("engine.models.hub.free_disk_bytes", lambda path: 1000)
    with pytest.raises(CommandError) as caught:
        pull(source, "--name", "x", *extra)
    message = str(caught.value)
    assert sentence in message and "\n" not in message
    row = ModelPull.objects.get()
    assert (row.state, row.error) == ("failed", message)
    assert not ModelEntry.objects.exists()
    assert leftovers(models_dir) in ([], [".pulls"])


def test_an_unreachable_hub_fails_the_pull(hub, models_dir, settings):
    settings.HF_ENDPOINT = "http://127.0.0.1:9"
    with pytest.raises(CommandError) as caught:
        pull(MLX_REPO)
    assert str(caught.value).startswith(
        f"Could not download {MLX_REPO} from http://127.0.0.1:9 (ConnectError: "
    )
    assert str(caught.value).endswith("check the network, or HF_ENDPOINT.")
    assert ModelPull.objects.get().error_code == "network"


def test_a_pull_that_cannot_be_asked_for_makes_no_row(hub, models_dir, tiny_model_path):
    model_register(name="taken", path=tiny_model_path)
    for args, sentence in [
        (["not-an-id"], "is not a hub model id"),
        ([MLX_REPO, "--name", "taken"], ERROR_NAME_TAKEN.format(name="taken")),
        ([MLX_REPO, "--name", "../up"], "cannot be a model name"),
        ([MLX_REPO, "--kind", "embedding", "--quantize", "4"], ERROR_EMBEDDING_QUANTIZED),
        ([f"{MLX_REPO}@v1", "--revision", "main"], "Give the revision once"),
    ]:
        with pytest.raises(CommandError) as caught:
            pull(*args)
        assert sentence in str(caught.value)
    assert not ModelPull.objects.exists()


def test_the_shell_exits_non_zero_with_one_line(transactional_db, local_hub, models_dir):
    process = start_pull(shell_env(local_hub, models_dir), "nobody/nothing")
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines[-1].startswith("CommandError: There is no model nobody/nothing on http")
    assert ModelPull.objects.get().state == "failed"


def test_a_killed_pull_is_resumed_by_the_next_with_a_range_request(
    transactional_db, local_hub, models_dir
):
    env = shell_env(local_hub, models_dir)
    weights = local_hub.repos[MLX_REPO].files["model.safetensors"]
    # huggingface_hub writes what it reads 10 MiB at a time: the hub stops sending half-way
    # through the second chunk, so 10 MiB are on disk when the process is killed.
    cut = 10 << 20
    stall = local_hub.stall_once(MLX_REPO, "model.safetensors", cut + (5 << 20))
    # (and its read timeout, which would resume it within the process, is out of the way)
    first = start_pull(
        {**env, "HF_HUB_DOWNLOAD_TIMEOUT": "300"}, MLX_REPO, "--name", "tiny-resumed"
    )
    try:
        assert stall.reached.wait(120), "the download never started"
        wait_for(lambda: pull_row(name="tiny-resumed").done_bytes >= cut, what="the progress row")
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=30)
    finally:
        stall.released.set()
    row = pull_row(name="tiny-resumed")
    assert row.state == "downloading"  # a killed process marks nothing
    partial = list((models_dir / ".pulls").rglob("model.safetensors.incomplete"))
    assert len(partial) == 1 and partial[0].stat().st_size == cut
    # Its process is gone: once its heartbeat is older than the lease, the next pull takes it.
    an_hour_ago = timezone.now() - datetime.timedelta(hours=1)
    ModelPull.objects.filter(pk=row.pk).update(heartbeat_at=an_hour_ago)
    since = len(local_hub.requests)
    second = start_pull(env, MLX_REPO, "--name", "tiny-resumed")
    _, err = second.communicate(timeout=120)
    assert second.returncode == 0, err
    assert f"Resuming pull #{row.pk}" in err
    ranges = [
        r.range
        for r in local_hub.requests[since:]
        if r.path.endswith("model.safetensors") and r.method == "GET"
    ]
    assert ranges == [f"bytes={cut}-"]
    assert (models_dir / "tiny-resumed" / "model.safetensors").read_bytes() == weights
    row.refresh_from_db()
    assert (row.state, row.attempts) == ("done", 2)
    assert ModelPull.objects.aggregate(n=Sum("attempts"))["n"] == 2
    assert leftovers(models_dir)[:2] == [".pulls", "tiny-resumed"]
    assert not any(name.startswith(".pulls/") for name in leftovers(models_dir))


def to_a_thread_not_main(pid: int, signum: int) -> None:
    """Send `signum` to a thread of process `pid` other than its main thread (Linux's tgkill):
    Python's C handler runs there and only sets a flag, as when a Ctrl-C lands after the main
    thread's last check for signals but before it blocks in a read."""
    tid = next(int(t) for t in sorted(os.listdir(f"/proc/{pid}/task")) if int(t) != pid)
    assert ctypes.CDLL(None, use_errno=True).tgkill(pid, tid, signum) == 0


@pytest.mark.parametrize(
    "interrupt",
    [
        pytest.param(lambda process: process.send_signal(signal.SIGINT), id="ctrl-c"),
        pytest.param(
            lambda process: to_a_thread_not_main(process.pid, signal.SIGINT),
            id="ctrl-c-while-the-main-thread-blocks",
            marks=pytest.mark.skipif(
                sys.platform != "linux", reason="signals one thread with tgkill, a Linux call"
            ),
        ),
    ],
)
def test_ctrl_c_stops_a_pull_and_keeps_its_partial_download(
    transactional_db, local_hub, models_dir, interrupt
):
    env = {**shell_env(local_hub, models_dir), "HF_HUB_DOWNLOAD_TIMEOUT": "300"}
    stall = local_hub.stall_once(MLX_REPO, "model.safetensors", 15 << 20)
    process = start_pull(env, MLX_REPO, "--name", "interrupted")
    try:
        assert stall.reached.wait(120)
        wait_for(lambda: pull_row(name="interrupted").done_bytes >= 10 << 20, what="progress")
        interrupt(process)
        _, err = finish(process, timeout=60)
    finally:
        stall.released.set()
    assert process.returncode == 1
    assert err.strip().splitlines()[-1] == f"CommandError: {MESSAGE_INTERRUPTED}"
    row = pull_row(name="interrupted")
    assert (row.state, row.error) == ("cancelled", MESSAGE_INTERRUPTED)
    partial = list((models_dir / ".pulls").rglob("model.safetensors.incomplete"))
    assert [p.stat().st_size for p in partial] == [10 << 20]
    assert not ModelEntry.objects.exists()
