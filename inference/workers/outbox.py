"""A worker's events for the web processes, sent in batches.

Engine threads post an event per token; whatever was posted since the last send goes out as one
message per web process (reply channel), so a busy batch costs about one Redis write per engine
step rather than one per token. Messages to a web process are numbered (`seq`) so it can
restore their order, and each web process has its own sender: one that stops reading holds up
only itself, and after SEND_RETRY_FOR_S its requests are given up (`on_unreachable`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from channels.exceptions import ChannelFull

from engine import GenerationOutput
from inference.workers.wire import encode_output

logger = logging.getLogger(__name__)

# A reply channel that stays full this long belongs to a web process that no longer reads it:
# its requests are aborted rather than generated for nobody.
SEND_RETRY_FOR_S = 5.0
# A web process's sender task ends after this long without anything to send it.
SENDER_IDLE_S = 60.0

Event = tuple[str, str, Any]  # [kind, id, payload]: wire.py names the kinds


class Outbox:
    """`post` from any thread; `run` sends on the worker's event loop. `on_output` sees each
    generation output as it leaves (the worker's bookkeeping of open requests)."""

    def __init__(
        self,
        *,
        layer,
        worker_id: str,
        run_id: str,
        on_output: Callable[[str, GenerationOutput], None],
        on_unreachable: Callable[[str], None],
    ):
        self.layer = layer
        self.worker_id = worker_id
        self.run_id = run_id
        self.on_output = on_output
        self.on_unreachable = on_unreachable
        self._seq: dict[str, int] = {}  # per reply channel
        self._pending: list[tuple[str, Event]] = []
        self._pending_lock = threading.Lock()
        self._sending = 0  # batches taken from `_pending` and not yet sent
        self._senders: dict[str, tuple[asyncio.Queue, asyncio.Task]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake = asyncio.Event()

    def post(self, reply: str, event: Event) -> None:
        """Queue an event for a web process (any thread; engine threads call it per token)."""
        with self._pending_lock:
            self._pending.append((reply, event))
            first = len(self._pending) == 1
        if first:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:
                pass  # the loop is closed: the process is exiting

    async def run(self) -> None:
        """Sort what the engine threads posted into one batch per web process and hand each
        to that process's sender."""
        self._loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            with self._pending_lock:
                pending, self._pending = self._pending, []
                self._sending += 1
            try:
                batches: dict[str, list] = {}
                for reply, (kind, ident, payload) in pending:
                    if kind == "out":
                        self.on_output(ident, payload)
                        payload = encode_output(payload)
                    batches.setdefault(reply, []).append([kind, ident, payload])
                for reply, events in batches.items():
                    sender = self._senders.get(reply)
                    if sender is None or sender[1].done():
                        queue: asyncio.Queue = asyncio.Queue()
                        task = asyncio.create_task(self._sender(reply, queue))
                        sender = self._senders[reply] = (queue, task)
                    with self._pending_lock:
                        self._sending += 1
                    sender[0].put_nowait(events)
            finally:
                with self._pending_lock:
                    self._sending -= 1

    async def flushed(self) -> None:
        """Return once everything posted has been sent (or after five seconds)."""
        for _ in range(500):
            with self._pending_lock:
                if not self._pending and not self._sending:
                    return
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        senders = [task for _, task in self._senders.values()]
        for task in senders:
            task.cancel()
        await asyncio.gather(*senders, return_exceptions=True)

    async def _sender(self, reply: str, queue: asyncio.Queue) -> None:
        """Send one web process its batches in order; ends after SENDER_IDLE_S without any."""
        while True:
            try:
                async with asyncio.timeout(SENDER_IDLE_S):
                    events = await queue.get()
            except TimeoutError:
                if queue.empty():
                    self._senders.pop(reply, None)
                    return
                continue
            try:
                # Whatever queued meanwhile goes in the same message.
                while not queue.empty():
                    more = queue.get_nowait()
                    events = events + more
                    with self._pending_lock:
                        self._sending -= 1
                await self._send(reply, events)
            finally:
                with self._pending_lock:
                    self._sending -= 1

    async def _send(self, reply: str, events: list) -> None:
        seq = self._seq.get(reply, 0)
        self._seq[reply] = seq + 1
        message = {
            "type": "events",
            "worker": self.worker_id,
            "run": self.run_id,
            "seq": seq,
            "events": events,
        }
        deadline = time.monotonic() + SEND_RETRY_FOR_S
        while True:
            try:
                await self.layer.send(reply, message)
                return
            except ChannelFull:
                reason = "does not read its channel"
            except Exception as exc:
                # Redis away for a moment: the batch is kept and sent again.
                reason = f"cannot be reached ({type(exc).__name__}: {exc})"
            if time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        logger.warning("%s %s; aborting its requests", reply, reason)
        self.on_unreachable(reply)
