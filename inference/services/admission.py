"""A metered request's way in, the same for every /v1 endpoint that runs a model or its tokenizer.

`request_intake` lets a request in as soon as its key is known, before anything is read: it
spends a request of the key's rpm window and holds one of its parallel slots (`limits.enter`),
so every authenticated request counts, a 400 included, and a key's requests cannot prepare more
at once than it may run. Everything the request costs before admission grows with its input and
runs on the preparation gate, fair between teams and never on the event loop
(`Intake.in_thread`, `Intake.prepare`: inference/services/prework.py). `Intake.model_entry`
finds the model (one this key may use, of the endpoint's kind); `Intake.reserve` reserves the
request's tokens and hands back its `Settlement` (the way out: usage row, release). A request
that ends before that (a 400, a refusal, a client that left) gives its slot back once the
preparation work it started has really ended.

A refusal is counted (a metric, and the day's roll-up without a row of its own:
inference/services/refusals.py) and answered: 429 with the x-ratelimit-* headers, 503 when the
limits cannot be checked.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from asgiref.sync import sync_to_async
from django.utils import timezone

from accounts import limits
from accounts.models import ApiKey
from common.request_threads import detach
from engine import ModelCapacityError, ModelLoadError, ModelUnavailableError
from inference.errors import APIError, model_not_found
from inference.models import ModelEntry
from inference.services import metrics, prework
from inference.services.held_refusals import refused_keys
from inference.services.prices import FREE, Price, price_at
from inference.services.refusals import refusals
from inference.services.registry import model_for_key
from inference.services.settlement import Settlement
from inference.services.usage import DEFAULT_TIER

logger = logging.getLogger(__name__)

# What a request for a model of the other kind is told, by the kind the endpoint serves.
ERROR_WRONG_KIND = {
    ModelEntry.Kind.CHAT: "The model '{name}' is an embedding model; use /v1/embeddings.",
    ModelEntry.Kind.EMBEDDING: (
        "The model '{name}' is not an embedding model; use it with /v1/chat/completions."
    ),
}
ERROR_LOAD_FAILED = (
    "The model '{name}' could not be loaded; an administrator must check its registry entry."
)

T = TypeVar("T")


class Intake:
    """A request let in by its key's limits, being prepared (see the module docstring)."""

    def __init__(
        self,
        *,
        api_key: ApiKey,
        request_id: str,
        endpoint: str,
        admission: limits.Admission,
        batch_id: str = "",
    ) -> None:
        self.api_key = api_key
        self.request_id = request_id
        self.endpoint = endpoint
        self.admission = admission
        self.batch_id = batch_id  # a batch line's batch (its usage row is marked with it)
        # The request's images by URL, read once however often its prompt is rendered (a
        # response truncated to fit renders it again: inference/services/responses.py).
        self.images: dict[str, Any] = {}  # (inference/images ImageInput)
        self.model = ""  # once known, for refusals
        self.price: Price = FREE  # the model's, when it is found: what the request is billed at
        self._work: set[asyncio.Future] = set()
        self._settled_by: Settlement | None = None

    async def model_entry(self, *, name: str, kind: str) -> ModelEntry:
        """The registry entry `name` stands for, if this key may use it (404 otherwise) and it
        is of the endpoint's `kind` (400 otherwise)."""
        entry, self.price = await sync_to_async(_model_and_price)(self.api_key, name)
        if entry is None:
            raise model_not_found(name)
        if entry.kind != kind:
            raise APIError(400, ERROR_WRONG_KIND[kind].format(name=entry.name), param="model")
        self.model = entry.name
        return entry

    async def in_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` (work that grows with the input) on a preparation thread."""
        gate = prework.gate()
        return await self._queued(
            gate.in_thread(self.api_key.team_id, fn, *args, started=self._started)
        )

    async def prepare(self, work: Callable[[], Awaitable[T]]) -> T:
        """Await `work()` (a render, tokenizing: work done elsewhere under a deadline) as one
        of the request's preparation jobs."""
        gate = prework.gate()
        return await self._queued(gate.run(self.api_key.team_id, work, started=self._started))

    async def _queued(self, job: Awaitable[T]) -> T:
        try:
            return await job
        except prework.QueueFull as exc:
            _counted_refusal(self.api_key, self.model, self.endpoint, "queue_full")
            raise APIError(
                429, exc.message, code=limits.CODE_RATE_LIMIT, headers={"retry-after": "1"}
            ) from None

    def _started(self, work: asyncio.Future) -> None:
        self._work.add(work)
        work.add_done_callback(self._work.discard)

    async def reserve(
        self,
        *,
        model: str,
        reserved_tokens: int,
        min_tokens: int | None = None,
        service_tier: str = DEFAULT_TIER,
        images: int = 0,
    ) -> Settlement:
        """Reserve the request's tokens (with `min_tokens`, admission may grant fewer, never
        fewer than that: `Settlement.granted_tokens`); the request is metered in `service_tier`.
        The caller must `settle()` what this returns; its release is the settlement's from then
        on."""
        await _limited(
            self.admission.reserve(
                reserved_tokens=reserved_tokens,
                min_tokens=min_tokens,
                # (Per token of the least it may be granted, which holds the whole prompt.)
                token_cost=self.price.reservation_cost(
                    reserved_tokens if min_tokens is None else min(min_tokens, reserved_tokens),
                    images,
                ),
            ),
            api_key=self.api_key,
            model=model,
            endpoint=self.endpoint,
        )
        self._settled_by = Settlement(
            self.api_key,
            self.request_id,
            model,
            self.endpoint,
            self.admission,
            service_tier,
            price=self.price,
            batch_id=self.batch_id,
            images=images,
        )
        return self._settled_by

    async def close(self) -> None:
        """Give the slot back unless a settlement took it over: at once when no preparation
        work runs, else once it has ended (in the background)."""
        if self._settled_by is not None:
            return
        pending = list(self._work)
        releasing = detach(_release_after(self.admission, pending, self.request_id))
        if not pending:
            await asyncio.shield(releasing)


def _model_and_price(api_key: ApiKey, name: str) -> tuple[ModelEntry | None, Price]:
    """The model `name` stands for, if the key may use it, and its price now."""
    entry = model_for_key(api_key, name)
    if entry is None:
        return None, FREE
    return entry, price_at(model=entry.name, at=timezone.now())


async def _release_after(
    admission: limits.Admission, work: list[asyncio.Future], request_id: str
) -> None:
    if work:
        await asyncio.wait(work)
    try:
        await admission.release(used_tokens=0)
    except Exception:
        logger.exception("limiter release of %s failed", request_id)


@contextlib.asynccontextmanager
async def request_intake(
    *, api_key: ApiKey, request_id: str, endpoint: str, path: str = ""
) -> AsyncIterator[Intake]:
    """Let the request in (429 and nothing held if the key's limits refuse it; a refusal for
    the key's rpm is held for the route's `path`: inference/services/held_refusals.py); its slot
    is given back when the block ends unless `Intake.reserve` handed it to a settlement."""
    admission = await _limited(
        limits.enter(api_key), api_key=api_key, model="", endpoint=endpoint, path=path
    )
    if path:
        refused_keys.admitted(api_key)  # a held refusal's probe let in: the hold ends
    intake = Intake(api_key=api_key, request_id=request_id, endpoint=endpoint, admission=admission)
    try:
        yield intake
    finally:
        await intake.close()


@contextlib.asynccontextmanager
async def batch_line_intake(
    *, api_key: ApiKey, request_id: str, endpoint: str, batch_id: str
) -> AsyncIterator[Intake]:
    """`request_intake` for a line of a batch: the key's budgets apply (a 429 when one has run
    out), not its rpm, tpm or parallel slots, which are for interactive traffic (the batch
    runner paces its lines); the usage row is marked with `batch_id`."""
    admission = await _limited(
        limits.enter(api_key, budgets_only=True), api_key=api_key, model="", endpoint=endpoint
    )
    intake = Intake(
        api_key=api_key,
        request_id=request_id,
        endpoint=endpoint,
        admission=admission,
        batch_id=batch_id,
    )
    try:
        yield intake
    finally:
        await intake.close()


def model_unavailable(exc: ModelUnavailableError) -> APIError:
    """503 for a model nothing serves now; with Retry-After when the memory budget has no room
    for it (room frees as other models' requests end and they idle)."""
    headers = None
    if isinstance(exc, ModelCapacityError):
        headers = {"Retry-After": str(exc.retry_after_s)}
    return APIError(503, str(exc), code=exc.code, headers=headers)


def model_load_failed(entry: ModelEntry) -> APIError:
    return APIError(503, ERROR_LOAD_FAILED.format(name=entry.name), code=ModelLoadError.code)


async def _limited(
    check: Awaitable[T], *, api_key: ApiKey, model: str, endpoint: str, path: str = ""
) -> T:
    try:
        return await check
    except (limits.RateLimitExceeded, limits.LimiterUnavailable) as exc:
        _counted_refusal(api_key, model, endpoint, exc.code)
        if path and isinstance(exc, limits.RateLimitExceeded):
            refused_keys.remember(api_key, exc, path=path, endpoint=endpoint)
        if isinstance(exc, limits.LimiterUnavailable):
            logger.error("limits unavailable: %s", exc)
            raise APIError(503, limits.ERROR_UNAVAILABLE, code=exc.code) from None
        # OpenAI types an exhausted budget as its own error type, not a rate limit.
        error_type = "insufficient_quota" if exc.code == "insufficient_quota" else None
        raise APIError(
            429, exc.message, code=exc.code, type=error_type, headers=exc.headers
        ) from None


def _counted_refusal(api_key: ApiKey, model: str, endpoint: str, reason: str) -> None:
    metrics.request_rejected(endpoint=endpoint, model=model, reason=reason)
    refusals.count(api_key, model)
