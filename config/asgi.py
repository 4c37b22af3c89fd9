"""ASGI entry point: HTTP goes to Django's own ASGI handler (it notices client disconnects while
streaming and cancels the view, which aborts the generation), with each request's sync thread
taken from a pool (config/request_threads.py)."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import django
from channels.routing import ProtocolTypeRouter

django.setup(set_prefix=False)

from config.request_threads import PooledASGIHandler  # noqa: E402

django_asgi_app = PooledASGIHandler()


application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
    }
)

from django.conf import settings  # noqa: E402

if settings.ORCHARD_PRELOAD_MODELS:
    from inference.engine_access import preload_models

    preload_models()
