"""First-run setup for `make serve`: import the default model, register the default embedding
model, create an admin user and an API key (each printed once, on the run that creates them),
and close usage rows a crash left open."""

import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.core.management.base import BaseCommand

from accounts.services import api_key_create, team_membership_ensure
from engine import DEFAULT_EMBEDDING_MODEL, default_embedding_folder, default_gguf_path
from inference.models import ModelEntry
from inference.services.registry import model_register
from inference.services.usage import usage_close_stale

DEFAULT_MODEL = "smollm2-135m-instruct"
# SmolLM2's recommended sampling; OpenAI's default temperature of 1 makes a 135M model ramble.
DEFAULT_MODEL_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
# Replies a request leaves unsized stop here: the model can repeat itself to the end of its 8k
# context (8,155 tokens, over two minutes, on a 2-core CPU); 256 tokens take 5-15 s there, a
# few paragraphs. No ceiling: a client that asks for more gets it.
DEFAULT_MODEL_MAX_TOKENS = 256


class Command(BaseCommand):
    help = "Idempotent first-run setup: default model, admin user, first API key."

    def add_arguments(self, parser):
        parser.add_argument("--base-url", default="http://127.0.0.1:8000")

    def handle(self, *args, **options):
        self.base_url = options["base_url"].rstrip("/")
        closed = usage_close_stale()
        if closed:
            self.stdout.write(f"Closed {closed} usage row(s) left open by an earlier crash.")
        self._default_model()
        self._embedding_model()
        self._admin_and_key()

    def _default_model(self) -> None:
        entry = ModelEntry.objects.filter(name=DEFAULT_MODEL).first()
        if entry and (Path(entry.path) / "config.json").exists():
            return
        self.stdout.write(f"Importing the default model {DEFAULT_MODEL} (once)...")
        call_command(
            "import_gguf",
            str(default_gguf_path()),
            DEFAULT_MODEL,
            "--dtype",
            "float32",
            "--default",
            "--force",
            stdout=self.stdout,
        )
        ModelEntry.objects.filter(name=DEFAULT_MODEL).update(
            default_sampling=DEFAULT_MODEL_SAMPLING, default_max_tokens=DEFAULT_MODEL_MAX_TOKENS
        )

    def _embedding_model(self) -> None:
        """The default embedding model (all-MiniLM-L6-v2, shipped on PyPI), registered once."""
        entry = ModelEntry.objects.filter(name=DEFAULT_EMBEDDING_MODEL).first()
        if entry and (Path(entry.path) / "model.safetensors").exists():
            return
        folder = default_embedding_folder(settings.ORCHARD_MODELS_DIR)
        model_register(name=DEFAULT_EMBEDDING_MODEL, path=folder, kind=ModelEntry.Kind.EMBEDDING)
        self.stdout.write(f"Registered the embedding model {DEFAULT_EMBEDDING_MODEL}.")

    def _admin_and_key(self) -> None:
        User = get_user_model()
        if User.objects.filter(is_superuser=True).exists():
            return
        password = secrets.token_urlsafe(12)
        admin = User.objects.create_superuser(username="admin", email="", password=password)
        team, _ = team_membership_ensure(user=admin, team_name="default")
        _, raw_key = api_key_create(user=admin, team=team, name="first key", created_by=admin)
        line = "=" * 72
        self.stdout.write(
            f"\n{line}\nCreated once; store these now, they are not shown again:\n"
            f"  admin login:  admin / {password}   ({self.base_url}/admin/)\n"
            f"  API key:      {raw_key}   (OpenAI base_url: {self.base_url}/v1)\n{line}\n"
        )
