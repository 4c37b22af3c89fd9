"""A request the key's limits refuse: recorded (a finished usage row with no tokens, a metric)
and answered with its HTTP error."""

from __future__ import annotations

import logging

from asgiref.sync import sync_to_async

from accounts import limits
from accounts.models import ApiKey
from inference.errors import APIError
from inference.services import metrics
from inference.services.usage import usage_reject

logger = logging.getLogger(__name__)


async def admission_refused(
    exc: limits.RateLimitExceeded | limits.LimiterUnavailable,
    *,
    request_id: str,
    api_key: ApiKey,
    model: str,
    endpoint: str,
) -> APIError:
    """Record a refused request (a finished usage row with no tokens) and build its error."""
    metrics.request_rejected(endpoint=endpoint, model=model, reason=exc.code)
    await sync_to_async(usage_reject)(
        request_id=request_id,
        api_key=api_key,
        model=model,
        endpoint=endpoint,
        error_code=exc.code,
    )
    if isinstance(exc, limits.LimiterUnavailable):
        logger.error("limits unavailable: %s", exc)
        return APIError(503, limits.ERROR_UNAVAILABLE, code=exc.code)
    # OpenAI types an exhausted budget as its own error type, not a rate limit.
    error_type = "insufficient_quota" if exc.code == "insufficient_quota" else None
    return APIError(429, exc.message, code=exc.code, type=error_type, headers=exc.headers)
