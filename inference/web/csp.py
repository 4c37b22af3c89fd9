"""A Content-Security-Policy on every page (not the /v1 API): scripts and styles from this
server only (no inline scripts), no framing, forms posting back here only."""

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.http import HttpRequest, HttpResponse

POLICY = "; ".join(
    [
        "default-src 'self'",
        "script-src 'self'",
        # Django admin's templates carry inline style attributes; scripts stay strict.
        "style-src 'self' 'unsafe-inline'",
        "img-src 'self' data:",
        "connect-src 'self'",
        "frame-ancestors 'none'",
        "base-uri 'self'",
        "form-action 'self'",
    ]
)


class ContentSecurityPolicyMiddleware:
    """Async-capable (an API request never hops threads for it)."""

    async_capable = True
    sync_capable = False

    def __init__(self, get_response):
        self.get_response = get_response
        if iscoroutinefunction(self.get_response):
            markcoroutinefunction(self)

    async def __call__(self, request: HttpRequest) -> HttpResponse:
        response = await self.get_response(request)
        if not request.path.startswith("/v1/"):
            response.setdefault("Content-Security-Policy", POLICY)
        return response
