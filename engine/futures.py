"""Futures the EngineWorker hands out (plain concurrent.futures helpers, no MLX)."""

from __future__ import annotations

import concurrent.futures
from typing import Any, Protocol


class Startable(Protocol):
    def start(self) -> Any: ...


def start_after(engine: Startable, ended: list[concurrent.futures.Future]) -> None:
    """Start `engine` once the `ended` futures are done (at most a minute's wait)."""
    concurrent.futures.wait(ended, timeout=60)
    engine.start()


def mirror(future: concurrent.futures.Future) -> concurrent.futures.Future:
    """A future of the caller's own that follows `future`: one waiter giving up (cancelling
    its future, as asyncio does when a client leaves) never cancels the load for the others."""
    mirrored: concurrent.futures.Future = concurrent.futures.Future()
    future.add_done_callback(lambda done: follow(done, mirrored))
    return mirrored


def follow(done: concurrent.futures.Future, into: concurrent.futures.Future) -> None:
    """Resolve `into` as `done` resolved (nothing if `into` was given up)."""
    try:
        if done.cancelled():
            into.cancel()
        elif done.exception() is not None:
            into.set_exception(done.exception())
        else:
            into.set_result(done.result())
    except concurrent.futures.InvalidStateError:
        pass  # this waiter gave up already


def resolved(value: Any) -> concurrent.futures.Future:
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(value)
    return future
