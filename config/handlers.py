"""The /v1 routes' Django handler (config/asgi.py wires it): importable without starting
anything, so tests can drive it in their own process."""

from django.conf import settings

from common.request_threads import PooledASGIHandler
from inference.middleware import answering_errors


class KeyedAPIHandler(PooledASGIHandler):
    """Django for the /v1 routes a key authenticates, with only the middleware they use
    (settings.API_MIDDLEWARE). The pages' middleware (sessions, CSRF, signed-in users, messages,
    frame options) runs synchronously: each is a hop to a thread and back, a dozen a request,
    which an API request paid for nothing but latency."""

    def load_middleware(self, is_async=False):
        # Django builds the chain from settings.MIDDLEWARE: swapped for this call only, once,
        # as the handler is made (config/asgi.py: as it loads, before anything serves).
        pages = settings.MIDDLEWARE
        settings.MIDDLEWARE = settings.API_MIDDLEWARE
        try:
            super().load_middleware(is_async)
        finally:
            settings.MIDDLEWARE = pages

    def make_view_atomic(self, view):
        # Django's hook on each request's view, before it is called: its APIErrors are
        # answered without Django's exception path (inference/middleware.py).
        return answering_errors(super().make_view_atomic(view))
