"""ASGI entry point: HTTP goes to Django's own ASGI handler (it notices client disconnects while
streaming and cancels the view, which aborts the generation)."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from channels.routing import ProtocolTypeRouter
from django.core.asgi import get_asgi_application

django_asgi_app = get_asgi_application()


application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
    }
)

from django.conf import settings  # noqa: E402

if settings.ORCHARD_PRELOAD_MODELS:
    from inference.engine_access import preload_models

    preload_models()
