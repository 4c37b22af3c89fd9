"""The Codex CLI (npm `@openai/codex`, installed by scripts/ensure_node_clients.sh) runs a turn
against a live Orchard over the Responses API, unmodified.

Codex's first request is ~10k tokens (its instructions, a `namespace` tool, `web_search`,
`store: false`, `reasoning`, `include`, `prompt_cache_key`, `client_metadata`;
docs/architecture.md), so the model is a tiny Qwen3 with a 32k context whose reply the test-only
scripted daphne forces to "pong" and the end of its turn: the real template renders Codex's prompt
and tools, the real engine prefills it, and the stream Codex reads is the server's own."""

import os
import subprocess
from pathlib import Path

from django.conf import settings

from inference.models import StoredResponse, UsageRecord
from inference.services.registry import model_register
from tests.fixtures.daphne import stop_daphne
from tests.fixtures.tiny_models import build_tiny_model
from tests.inference.api.responses.scripted import start_scripted
from tests.inference.api.test_chat import finished_row

CODEX = Path(settings.BASE_DIR) / "node_modules" / ".bin" / "codex"
MODEL = "tiny-codex"
CONFIG = """\
model = "{model}"
model_provider = "orchard"

[model_providers.orchard]
name = "Orchard"
base_url = "{url}/v1"
env_key = "ORCHARD_API_KEY"
wire_api = "responses"
"""


def test_codex_exec_completes_a_turn(make_key, tmp_path, transactional_db):
    path = build_tiny_model(
        model_type="qwen3", tokenizer="qwen3", overrides={"max_position_embeddings": 32768}
    )
    model_register(name=MODEL, path=path)
    key = make_key()
    process, url = start_scripted(tmp_path)
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(CONFIG.format(model=MODEL, url=url))
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "CODEX_HOME": str(home), "ORCHARD_API_KEY": key, "NO_COLOR": "1"}
    try:
        result = subprocess.run(
            [str(CODEX), "exec", "--skip-git-repo-check", "Reply with the word pong"],
            cwd=work,
            stdin=subprocess.DEVNULL,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        stop_daphne(process)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "pong", result.stdout[-2000:]
    row = UsageRecord.objects.get(endpoint="responses")
    row = finished_row(row.request_id)
    assert row.status == UsageRecord.Status.COMPLETED
    assert row.prompt_tokens > 5000  # Codex's whole prompt and tools reached the template
    assert not StoredResponse.objects.exists()  # Codex sends store: false
