import shutil
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from engine import convert_gguf
from inference.services.registry import model_register

DTYPES = ("float32", "bfloat16", "quantized")


class Command(BaseCommand):
    help = (
        "Convert a GGUF file into an mlx-lm model folder under $ORCHARD_HOME/models/NAME and "
        "register it. float32 is the default: on CPU it is the fastest (BLAS) path."
    )

    def add_arguments(self, parser):
        parser.add_argument("path", help="the .gguf file")
        parser.add_argument("name", help="model name clients will use")
        parser.add_argument("--dtype", choices=DTYPES, default="float32")
        parser.add_argument("--engine", choices=("batched", "simple"), default="batched")
        parser.add_argument("--default", action="store_true", help="make it the default model")
        parser.add_argument("--force", action="store_true", help="replace an existing folder")

    def handle(self, *args, **options):
        out_dir = Path(settings.ORCHARD_MODELS_DIR) / options["name"]
        if out_dir.exists() and any(out_dir.iterdir()):
            if not options["force"]:
                raise CommandError(f"{out_dir} exists; pass --force to convert again.")
            shutil.rmtree(out_dir)
        try:
            folder = convert_gguf(options["path"], out_dir, dtype=options["dtype"])
        except (FileNotFoundError, ValueError) as exc:
            raise CommandError(str(exc)) from None
        entry = model_register(
            name=options["name"],
            path=folder,
            engine=options["engine"],
            make_default=options["default"],
        )
        self.stdout.write(f"Imported {entry.name} ({options['dtype']}) into {folder}")
