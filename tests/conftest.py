"""Suite-wide fixtures: a live daphne server (the real `config.asgi` in a subprocess, sharing the
test database) and registered models for the API tests."""

import engine  # noqa: F401  (OpenBLAS before anything imports mlx)

# isort: split
import os
import socket
import threading
from pathlib import Path

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.db import connections

from tests.fixtures.daphne import free_port, server_env, start_daphne, stop_daphne
from tests.fixtures.tiny_models import build_tiny_model

# Tests whose outcome does not depend on the Python interpreter, marked `once`: CI runs them on
# its first Python only (`make test-interpreter` leaves them out on the second). What they test
# runs outside Python or is the same bytes whatever runs it: pages in Chromium, the Codex CLI
# (Node.js), the C kernels' numerics, the docs. Each native kernel keeps a per-interpreter
# smoke test outside this list where Python's ABI is involved (the MLX extension).
ONCE = (
    "tests/browser/",
    "tests/docs/",
    "tests/inference/api/test_codex.py",
    "tests/engine/test_activation_kernel.py",
    "tests/engine/test_attention_kernel.py",
    "tests/engine/test_blas.py",
    "tests/engine/test_sgemm.py",
    "tests/engine/test_rope_kernel.py",
)
ROOT = Path(__file__).resolve().parent.parent

# The test servers serve many tiny models at once (every test's registrations): each gets a
# small share of the memory budget for its caches, so none waits for room (tests of the budget
# itself set their own). Servers started by the tests inherit the environment.
os.environ.setdefault("ORCHARD_MODEL_CACHE_SHARE", "0.02")
settings.ORCHARD_MODEL_CACHE_SHARE = float(os.environ["ORCHARD_MODEL_CACHE_SHARE"])
# No prefix-cache disk tier: a test server's cache would outlive it, and the next run's servers
# would hit what earlier runs computed (tests/engine/ test the tier on folders of their own).
os.environ.setdefault("ORCHARD_PREFIX_DISK_BYTES", "0")
if os.environ["ORCHARD_PREFIX_DISK_BYTES"] == "0":
    settings.ORCHARD_PREFIX_DISK_BYTES = 0
# A test run starts dozens of servers, each with pools of tokenizer processes (~250 MB each, and
# ~80 MB a tokenizer more): each process keeps two tokenizers and stops after 20 s without a job,
# so the servers of a run that serves many tokenizers stay within the machine's memory.
os.environ.setdefault("ORCHARD_TOKENIZERS_PER_PROCESS", "2")
os.environ.setdefault("ORCHARD_TOKENIZER_IDLE_SECONDS", "20")
settings.ORCHARD_TOKENIZERS_PER_PROCESS = int(os.environ["ORCHARD_TOKENIZERS_PER_PROCESS"])
settings.ORCHARD_TOKENIZER_IDLE_SECONDS = float(os.environ["ORCHARD_TOKENIZER_IDLE_SECONDS"])


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.relative_to(ROOT).as_posix().startswith(ONCE):
            item.add_marker(pytest.mark.once)


@pytest.fixture(scope="session")
def live_server_url(django_db_setup, tmp_path_factory):
    """A real daphne serving config.asgi; the engine runs inside it, as in `make serve`."""
    port = free_port()
    log_path = tmp_path_factory.mktemp("daphne") / "server.log"
    process = start_daphne(port=port, env=server_env(), log_path=log_path)
    yield f"http://127.0.0.1:{port}"
    stop_daphne(process)


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    """A random-weight qwen3-architecture model with the real Qwen3 tokenizer and template."""
    return build_tiny_model(model_type="qwen3", tokenizer="qwen3", seed=0)


@pytest.fixture(scope="session")
def local_hub(tmp_path_factory):
    """A Hugging Face hub on 127.0.0.1 serving the tiny models (tests/fixtures/hub.py)."""
    from tests.fixtures.hub import LocalHub, serve_tiny_models

    hub = LocalHub()
    serve_tiny_models(hub, tmp_path_factory.mktemp("hub"))
    yield hub
    hub.close()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The default model, converted from its GGUF once per cache (float32)."""
    from engine.models.gguf import convert_gguf, default_gguf_path

    folder = Path(settings.ORCHARD_HOME) / "cache" / "test-models" / "smollm2-135m-f32"
    if not (folder / "config.json").exists():
        convert_gguf(default_gguf_path(), folder, dtype="float32")
    return folder


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """The default embedding model, all-MiniLM-L6-v2, extracted once per cache."""
    from engine.models.embeddings import default_embedding_folder

    return default_embedding_folder(Path(settings.ORCHARD_HOME) / "cache" / "test-models")


@pytest.fixture
def silent_redis():
    """A TCP server that accepts connections and never answers: a stalled Redis."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    accepted = []
    stop = threading.Event()

    def accept():
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"redis://127.0.0.1:{server.getsockname()[1]}/0"
    stop.set()
    thread.join()
    for conn in accepted:
        conn.close()
    server.close()


@pytest.fixture
async def sync_thread_db():
    """For async tests whose code reaches the database through sync_to_async: close the
    connection that asgiref's sync thread opened, so the test database can be dropped."""
    yield
    await sync_to_async(connections.close_all)()


@pytest.fixture(autouse=True)
def fast_password_hashing(settings):
    """Hash test users' passwords cheaply (PBKDF2's iterations cost ~0.3 s a user). Page tests
    whose passwords the live server checks restore the real hashers (tests/browser)."""
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
