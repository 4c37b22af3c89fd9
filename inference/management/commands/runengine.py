"""`manage.py runengine`: an engine worker process serving models to every web process."""

import asyncio
import logging
import signal

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError
from django.db import close_old_connections

from common import heap
from inference.services.engines import enabled_specs, engine_worker, tokenizer_pool
from inference.workers.beats import BeatStore
from inference.workers.server import EngineServer

logger = logging.getLogger(__name__)


def _registry_specs() -> list:
    close_old_connections()
    try:
        return enabled_specs()
    finally:
        close_old_connections()


class Command(BaseCommand):
    help = (
        "Run an engine worker: serve the registry's enabled models, chat and embedding (or "
        "--models), to the web processes over the Channels layer on Redis. SIGTERM drains "
        "(finishes what runs, takes nothing new, exits); a second SIGTERM or SIGINT aborts what "
        "is left."
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--models",
            default="",
            help="Comma-separated registry names to serve (default: every enabled model).",
        )
        parser.add_argument("--worker-id", default=None, help="A name for this worker's beats.")

    def handle(self, *args, models: str, worker_id: str | None, **options):
        if not settings.REDIS_URL:
            raise CommandError("runengine needs REDIS_URL: workers meet the web processes there.")
        names = [name.strip() for name in models.split(",") if name.strip()] or None
        heap.settle()  # the imports, out of later full collections (common/heap.py)
        asyncio.run(self._serve(names, worker_id))

    async def _serve(self, names: list[str] | None, worker_id: str | None) -> None:
        loop = asyncio.get_running_loop()
        stop, abort = asyncio.Event(), asyncio.Event()

        def on_signal(signum: int) -> None:
            if stop.is_set():
                abort.set()
            else:
                logger.info("signal %d: draining (send it again to abort)", signum)
                stop.set()

        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, on_signal, signum)
        server = EngineServer(
            worker=engine_worker(),
            layer=get_channel_layer(),
            store=BeatStore(settings.REDIS_URL, settings.ORCHARD_WORKER_NAMESPACE),
            namespace=settings.ORCHARD_WORKER_NAMESPACE,
            desired=sync_to_async(_registry_specs, thread_sensitive=False),
            model_filter=names,
            heartbeat_s=settings.ORCHARD_WORKER_HEARTBEAT_SECONDS,
            timeout_s=settings.ORCHARD_WORKER_TIMEOUT_SECONDS,
            sync_s=settings.ORCHARD_WORKER_SYNC_SECONDS,
            worker_id=worker_id,
            render=tokenizer_pool(),
        )
        self.stdout.write(f"engine worker {server.worker_id} starting", ending="\n")
        self.stdout.flush()
        await server.run(stop, abort)
        self.stdout.write(f"engine worker {server.worker_id} stopped", ending="\n")
