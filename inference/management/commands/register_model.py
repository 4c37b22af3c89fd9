from django.core.management.base import BaseCommand, CommandError

from inference.models import ModelEntry
from inference.parsers.registry import REASONING_PARSERS, TOOL_PARSERS
from inference.services.registry import model_register


class Command(BaseCommand):
    help = "Add or update a model registry entry for an mlx-lm model folder."

    def add_arguments(self, parser):
        parser.add_argument("name")
        parser.add_argument("path", help="mlx-lm model folder (config.json, weights, tokenizer)")
        parser.add_argument("--engine", choices=ModelEntry.Engine.values, default="batched")
        parser.add_argument(
            "--kind",
            choices=ModelEntry.Kind.values,
            default="chat",
            help="embedding: a sentence-transformers encoder folder for /v1/embeddings",
        )
        parser.add_argument(
            "--tool-parser",
            default="",
            choices=["", *TOOL_PARSERS],
            help="empty (the default): detected from the chat template",
        )
        parser.add_argument(
            "--reasoning-parser",
            default="",
            choices=["", *REASONING_PARSERS],
            help="empty (the default): detected from the chat template",
        )
        parser.add_argument("--default", action="store_true", help="make it the default model")
        parser.add_argument(
            "--draft-model",
            default=None,
            help="a registered chat model of the same tokenizer that drafts for this one "
            "(speculative decoding)",
        )

    def handle(self, *args, **options):
        try:
            entry = model_register(
                name=options["name"],
                path=options["path"],
                engine=options["engine"],
                tool_parser=options["tool_parser"],
                reasoning_parser=options["reasoning_parser"],
                make_default=options["default"],
                kind=options["kind"],
                draft_model=options["draft_model"],
            )
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        default = " (default)" if entry.is_default else ""
        self.stdout.write(f"Registered {entry.name}{default}: {entry.path} [{entry.engine}]")
