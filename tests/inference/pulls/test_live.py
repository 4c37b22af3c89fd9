"""End to end over real HTTP: `manage.py pull` of a transformers checkpoint (to be converted
and quantized to 4 bits) is killed mid-download; a web process that starts afterwards finds
the pull its runner left, resumes the download with a Range request, converts, quantizes and
registers it; and the model answers a chat through the official `openai` SDK."""

import datetime
import json
import signal

import openai
import pytest
from django.utils import timezone

from inference.models import ModelEntry, ModelPull
from tests.fixtures.daphne import free_port, server_env, start_daphne, stop_daphne
from tests.fixtures.hub import HF_REPO
from tests.inference.pulls.conftest import shell_env, start_pull, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def test_a_pull_left_by_a_killed_shell_is_finished_by_the_web_process_and_serves_a_chat(
    local_hub, models_dir, make_key, tmp_path
):
    env = {**shell_env(local_hub, models_dir), "HF_HUB_DOWNLOAD_TIMEOUT": "300"}
    cut = 10 << 20  # what huggingface_hub has written when the hub stops (see test_command.py)
    stall = local_hub.stall_once(HF_REPO, "model.safetensors", cut + (5 << 20))
    shell = start_pull(env, HF_REPO, "--quantize", "4", "--name", "tiny-q4")
    try:
        assert stall.reached.wait(120)
        wait_for(lambda: ModelPull.objects.filter(done_bytes__gte=cut).exists(), what="progress")
        shell.send_signal(signal.SIGKILL)
        shell.communicate(timeout=30)
    finally:
        stall.released.set()
    pull = ModelPull.objects.get()
    assert (pull.state, pull.origin) == ("downloading", "shell")
    # The shell's process is gone: its pull looks as it will once the lease has passed.
    ModelPull.objects.filter(pk=pull.pk).update(
        heartbeat_at=timezone.now() - datetime.timedelta(hours=1)
    )

    since = len(local_hub.requests)
    port = free_port()
    web_env = {
        **server_env(),
        "ORCHARD_PULL_RUNNER": "1",
        "ORCHARD_HOME": env["ORCHARD_HOME"],
        "HF_ENDPOINT": local_hub.url,
        "HF_TOKEN_PATH": env["HF_TOKEN_PATH"],
    }
    server = start_daphne(port=port, env=web_env, log_path=tmp_path / "daphne.log")
    try:
        done = wait_for(
            lambda: ModelPull.objects.filter(pk=pull.pk, state__in=["done", "failed"]).first(),
            timeout=240,
            what="the web process to finish the pull",
        )
        assert done.state == "done", done.error
        assert done.attempts == 2 and done.runner.split(":")[1] == str(server.pid)
        ranges = [
            r.range
            for r in local_hub.requests[since:]
            if r.method == "GET" and r.path.endswith("model.safetensors")
        ]
        assert ranges == [f"bytes={cut}-"]
        entry = ModelEntry.objects.get(name="tiny-q4")
        assert (entry.source, entry.quantization_bits) == (HF_REPO, 4)
        config = json.loads((models_dir / "tiny-q4" / "config.json").read_text())
        assert config["quantization"]["bits"] == 4

        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key=make_key(), max_retries=0
        )
        reply = client.chat.completions.create(
            model="tiny-q4",
            messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=5,
            temperature=0,
        )
        assert reply.model == "tiny-q4"
        assert reply.usage.completion_tokens == 5 and reply.choices[0].finish_reason == "length"
    finally:
        stop_daphne(server)
