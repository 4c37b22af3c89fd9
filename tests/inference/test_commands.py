"""register_model, import_gguf and bootstrap, as operators run them."""

import io
import re

import pytest
from django.core.management import CommandError, call_command

from accounts.authentication import authenticate_header
from inference.models import ModelEntry, UsageRecord

pytestmark = pytest.mark.django_db


def run(*args) -> str:
    out = io.StringIO()
    call_command(*args, stdout=out, stderr=io.StringIO())
    return out.getvalue()


def test_register_model_adds_updates_and_switches_default(tiny_model_path):
    run("register_model", "a", str(tiny_model_path))
    assert ModelEntry.objects.get(name="a").is_default  # the first model becomes the default
    run(
        "register_model",
        "b",
        str(tiny_model_path),
        "--engine",
        "simple",
        "--default",
        "--tool-parser",
        "hermes",
    )
    b = ModelEntry.objects.get(name="b")
    assert (b.engine, b.tool_parser, b.is_default) == ("simple", "hermes", True)
    assert not ModelEntry.objects.get(name="a").is_default
    run("register_model", "a", str(tiny_model_path), "--engine", "simple")
    assert ModelEntry.objects.get(name="a").engine == "simple"
    assert ModelEntry.objects.count() == 2


def test_register_model_rejects_a_folder_that_is_not_a_model(tmp_path):
    with pytest.raises(CommandError, match="not an mlx-lm model folder"):
        run("register_model", "x", str(tmp_path))


@pytest.mark.slow
def test_import_gguf_converts_and_registers(settings, tmp_path):
    from engine.models.gguf import default_gguf_path

    settings.ORCHARD_MODELS_DIR = tmp_path / "models"
    output = run("import_gguf", str(default_gguf_path()), "smol", "--default")
    entry = ModelEntry.objects.get(name="smol")
    assert entry.is_default and entry.path == str((tmp_path / "models" / "smol").resolve())
    assert "Imported smol" in output
    with pytest.raises(CommandError, match="exists"):
        run("import_gguf", str(default_gguf_path()), "smol")


def test_import_gguf_reports_a_bad_file(settings, tmp_path):
    settings.ORCHARD_MODELS_DIR = tmp_path / "models"
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    with pytest.raises(CommandError):
        run("import_gguf", str(bad), "bad")
    assert not ModelEntry.objects.filter(name="bad").exists()


@pytest.mark.slow
def test_bootstrap_prints_admin_and_key_once(settings, tmp_path):
    settings.ORCHARD_MODELS_DIR = tmp_path / "models"
    first = run("bootstrap")
    key = re.search(r"API key:\s+(sk-orch-\S+)", first).group(1)
    assert re.search(r"admin login:\s+admin / \S+", first)
    assert authenticate_header(f"Bearer {key}").user.username == "admin"
    assert ModelEntry.objects.get(name="smollm2-135m-instruct").is_default
    embedding = ModelEntry.objects.get(name="all-minilm-l6-v2")
    assert embedding.kind == ModelEntry.Kind.EMBEDDING and not embedding.is_default
    assert (tmp_path / "models" / "all-minilm-l6-v2" / "model.safetensors").exists()
    second = run("bootstrap")
    assert "sk-orch-" not in second and "admin login" not in second
    assert "embedding model" not in second
    assert ModelEntry.objects.count() == 2


def test_bootstrap_closes_rows_left_open_by_a_crash(tiny_model_path):
    from django.utils import timezone

    from accounts.services import api_key_create, team_membership_ensure, user_get_or_create

    user = user_get_or_create(username="u")
    team, _ = team_membership_ensure(user=user, team_name="t")
    key, _ = api_key_create(user=user, team=team)
    UsageRecord.objects.create(
        request_id="req_crashed",
        api_key=key,
        team=team,
        user=user,
        model="m",
        endpoint="chat.completions",
        started_at=timezone.now() - timezone.timedelta(hours=2),
    )
    # The default model is already there, so bootstrap only sweeps (and creates the admin).
    run("register_model", "smollm2-135m-instruct", str(tiny_model_path))
    run("bootstrap")
    row = UsageRecord.objects.get(request_id="req_crashed")
    assert row.status == UsageRecord.Status.FAILED
