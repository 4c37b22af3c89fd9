"""ASGI entry point: HTTP goes through the body cap (inference/body_cap.py: a body over
ORCHARD_MAX_BODY_BYTES, or its route's own cap, e.g. the file limit on uploads to /v1/files, is a
413 before Django reads it; daphne drops such a body as it arrives, parses none, and reads each
team's bodies at most at ORCHARD_BODY_RATE_BYTES: common/daphne_requests.py) to Django's own ASGI
handler (it notices client disconnects while streaming and cancels the view, which aborts the
generation), with each request's sync thread taken from a pool (common/request_threads.py): a key
whose rpm refusal is held is answered before Django (inference/refused_keys.py), the /v1 routes a
key authenticates go to a handler with the API's own middleware only, everything else to one with
the pages' middleware. Websockets (the live engine status) go to Channels with the session's user.
At start the process begins loading the enabled models and starts its pull runner
(inference/services/pulls/runner.py) and its batch runner (inference/batches/runner.py)."""

import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

import django
from channels.auth import AuthMiddlewareStack
from channels.routing import ProtocolTypeRouter, URLRouter
from channels.security.websocket import AllowedHostsOriginValidator

django.setup(set_prefix=False)

from django.conf import settings  # noqa: E402
from django.urls import path, reverse  # noqa: E402

from common import daphne_requests, heap  # noqa: E402
from common.request_threads import PooledASGIHandler  # noqa: E402
from config.handlers import KeyedAPIHandler  # noqa: E402
from inference.batches.file_views import upload_body_cap  # noqa: E402
from inference.body_cap import BodyCapMiddleware  # noqa: E402
from inference.body_rate import body_rate  # noqa: E402
from inference.refused_keys import RefusedKeyMiddleware  # noqa: E402
from inference.web.consumers import StatusConsumer  # noqa: E402

pages_app = PooledASGIHandler()
api_app = KeyedAPIHandler()


# Load balancers' probes: no session or CSRF to run.
HEALTH_PATHS = ("/healthz", "/readyz")


async def by_route(scope, receive, send):
    """/v1 by key and the health probes to the API's handler; the usage API (which a signed-in
    team owner's session may read), the pages, the admin and /metrics to the full one."""
    path = scope["path"]
    keyed = path.startswith("/v1/") and not path.startswith("/v1/organization/")
    await (api_app if keyed or path in HEALTH_PATHS else pages_app)(scope, receive, send)


django_asgi_app = BodyCapMiddleware(
    RefusedKeyMiddleware(by_route),
    max_bytes=settings.ORCHARD_MAX_BODY_BYTES,
    route_max_bytes={
        reverse("v1-embeddings"): settings.ORCHARD_MAX_EMBEDDINGS_BODY_BYTES,
        # Uploads: the file limit (ORCHARD_FILE_MAX_BYTES) and the multipart around it.
        reverse("v1-files"): upload_body_cap(),
    },
)
# Under daphne: no body parsed by Twisted, one over its cap dropped as it arrives, and each team's
# bodies read at most as fast as ORCHARD_BODY_RATE_BYTES (inference/body_rate.py).
daphne_requests.install(django_asgi_app.cap_for, body_rate())


application = ProtocolTypeRouter(
    {
        "http": django_asgi_app,
        # The live engine status for signed-in users (session cookie), same-origin only.
        "websocket": AllowedHostsOriginValidator(
            AuthMiddlewareStack(URLRouter([path("ws/status/", StatusConsumer.as_asgi())]))
        ),
    }
)

# What the imports made, out of every later full garbage collection (common/heap.py): before
# the threads below start loading models, so a model's objects stay collectable.
heap.settle()

if settings.ORCHARD_PRELOAD_MODELS:
    from inference.services.engines import preload_models

    preload_models()

if settings.ORCHARD_PULL_RUNNER:
    from inference.services.pulls import start_pull_runner

    start_pull_runner()

if settings.ORCHARD_BATCH_RUNNER:
    from inference.batches.runner import start_batch_runner

    start_batch_runner()
