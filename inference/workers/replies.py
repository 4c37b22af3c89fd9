"""What a web process waits for from its engine workers, and how each wait ends.

Token events and call results arrive on one reply channel per process, numbered per worker run:
they are put back in order (ordering.py), and a message that never arrives (the channel layer
drops what expires or overflows) is skipped after GAP_TIMEOUT_S; each choice's last event
carries the engine's count of generated tokens, so a reply that lost events ends with an error
instead of passing as complete. A request its worker's beats stop listing is settled (handed to
another worker when nothing came back yet, else ended with an error), and what a dead worker
held ends at once: its requests with an error, its calls with ModelNotLoadedError.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from engine import GenerationOutput, GenerationRequest, ModelNotLoadedError
from inference.workers.fleet import Worker
from inference.workers.ordering import EventOrder
from inference.workers.wire import decode_output

logger = logging.getLogger(__name__)

# A request its worker's beats stop listing is given up this long after (its last events may
# still be on the way); a beat is taken to know of a request sent SEND_LATENCY_S before it.
SETTLE_GRACE_S = 2.0
SEND_LATENCY_S = 0.5
ERROR_LOST = "Part of this reply was lost between the engine worker and the web server."
ERROR_WORKER_GONE = "The engine worker serving this request stopped responding."


@dataclass
class Flight:
    request: GenerationRequest
    worker_id: str
    run_id: str = ""
    sent_at: float = field(default_factory=time.monotonic)
    missing_since: float | None = None  # its worker's beats stopped listing it
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    received: dict[int, int] = field(default_factory=dict)  # tokens per choice
    finished: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class Rejected:
    error: dict[str, Any]


@dataclass
class Call:
    future: asyncio.Future
    worker_id: str
    model: str | None  # the model it works on, counted in its worker's load meanwhile


class Replies:
    """The requests (`flights`) and calls this web process has out on its workers, by id, and
    the order of each worker run's messages on its reply `channel`."""

    def __init__(self) -> None:
        self.channel: str | None = None
        self.flights: dict[str, Flight] = {}
        self.calls: dict[str, Call] = {}
        self.orders: dict[tuple[str, str], EventOrder] = {}  # per worker run

    def in_flight(self, worker_id: str, model: str) -> int:
        """Open choices and calls this process has on a worker for a model."""
        choices = sum(
            f.request.sampling.n - len(f.finished)
            for f in self.flights.values()
            if f.worker_id == worker_id and f.request.model == model
        )
        calls = sum(1 for c in self.calls.values() if (c.worker_id, c.model) == (worker_id, model))
        return choices + calls

    # Arriving
    def arrived(self, message: dict) -> None:
        key = (message["worker"], message.get("run", ""))
        ready = self.orders.setdefault(key, EventOrder()).arrive(message, time.monotonic())
        if ready is None:
            logger.warning("dropping a late message %d from %s", message["seq"], key[0])
        for each in ready or ():
            self._apply(each)

    def close_gaps(self) -> None:
        now = time.monotonic()
        for (worker_id, _), order in self.orders.items():
            if ready := order.skip_gap(now):
                logger.warning("messages before %d from %s never came", ready[0]["seq"], worker_id)
                for each in ready:
                    self._apply(each)

    def _apply(self, message: dict) -> None:
        worker_id, run_id = message["worker"], message.get("run", "")
        for kind, ident, payload in message["events"]:
            if kind == "res":
                call = self.calls.get(ident)
                if call is not None and not call.future.done():
                    call.future.set_result(payload)
                continue
            flight = self.flights.get(ident)
            if flight is None or (flight.worker_id, flight.run_id) != (worker_id, run_id):
                continue  # its caller has gone, or it was handed to another worker
            if kind == "rej":
                flight.queue.put_nowait(Rejected(payload))
                continue
            output = decode_output(payload)
            if output.index in flight.finished:
                continue  # ended already (its worker was given up for dead)
            received = flight.received.get(output.index, 0) + len(output.token_ids)
            flight.received[output.index] = received
            if output.finish_reason is not None:
                flight.finished.add(output.index)
                if output.num_generated_tokens > received:
                    output = dataclasses.replace(output, finish_reason="error", error=ERROR_LOST)
            flight.queue.put_nowait(output)

    # Settling
    def settle(self, workers: dict[str, Worker], now: float, refresh_s: float) -> None:
        """End the requests whose worker no longer lists them in its beats although their
        last events never came (lost on the way, a Redis outage say): after SETTLE_GRACE_S
        more, those that got nothing yet go to another worker, the others end with an error.
        A beat seen well after a request was sent lists it until its last events are out."""
        for flight in list(self.flights.values()):
            known = workers.get(flight.worker_id)
            if known is None or known.seen_at - refresh_s - SEND_LATENCY_S < flight.sent_at:
                continue
            listed = flight.request.request_id in known.beat.open_requests.get(self.channel, ())
            if listed or len(flight.finished) == flight.request.sampling.n:
                flight.missing_since = None
            elif flight.missing_since is None:
                flight.missing_since = now
            elif now - flight.missing_since > SETTLE_GRACE_S:
                self._give_up(flight, ERROR_LOST)

    def worker_lost(self, worker_id: str) -> int:
        """A worker stopped beating: end what it held; the number of requests ended."""
        for key in [k for k in self.orders if k[0] == worker_id]:
            del self.orders[key]
        flights = [f for f in self.flights.values() if f.worker_id == worker_id]
        for flight in flights:
            self._give_up(flight, ERROR_WORKER_GONE)
        for call in list(self.calls.values()):
            if call.worker_id == worker_id and not call.future.done():
                call.future.set_exception(ModelNotLoadedError(ERROR_WORKER_GONE))
        return len(flights)

    def _give_up(self, flight: Flight, error: str) -> None:
        """End what is left of a request its worker will not finish."""
        if not flight.received and not flight.finished:
            # Nothing came back yet: the request may never have reached it; another worker
            # takes it.
            flight.finished.update(range(flight.request.sampling.n))
            flight.queue.put_nowait(Rejected({"retry": True, "message": error}))
            return
        for index in range(flight.request.sampling.n):
            if index not in flight.finished:
                flight.finished.add(index)
                flight.queue.put_nowait(_error_output(flight, index, error))


def _error_output(flight: Flight, index: int, error: str) -> GenerationOutput:
    return GenerationOutput(
        index=index,
        text="",
        token_ids=(),
        finish_reason="error",
        num_prompt_tokens=len(flight.request.prompt_token_ids),
        error=error,
    )
