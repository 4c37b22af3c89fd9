"""ASGI entry point: HTTP goes through the body cap (inference/body_cap.py: a body over
ORCHARD_MAX_BODY_BYTES, or its route's own cap, is a 413 before Django reads it) to Django's own
ASGI handler (it notices client disconnects while streaming and cancels the view, which aborts
the generation), with each request's sync thread taken from a pool
(common/request_threads.py); websockets (the live engine status) go to Channels with the
session's user."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import django
from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter
from channels.security.websocket import AllowedHostsOriginValidator

django.setup(set_prefix=False)

from django.conf import settings  # noqa: E402
from django.urls import path, reverse  # noqa: E402

from common.request_threads import PooledASGIHandler  # noqa: E402
from inference.body_cap import BodyCapMiddleware  # noqa: E402
from inference.web.consumers import StatusConsumer  # noqa: E402

django_asgi_app = BodyCapMiddleware(
    PooledASGIHandler(),
    max_bytes=settings.ORCHARD_MAX_BODY_BYTES,
    route_max_bytes={reverse("v1-embeddings"): settings.ORCHARD_MAX_EMBEDDINGS_BODY_BYTES},
)


application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        # The live engine status for signed-in users (session cookie), same-origin only.
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter([path("ws/status/", StatusConsumer.as_asgi())]))
        ),
    }
)

if settings.ORCHARD_PRELOAD_MODELS:
    from inference.services.engines import preload_models

    preload_models()
