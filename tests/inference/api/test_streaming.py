"""A streamed response is closed from the outside in when the client leaves while a chunk is
being sent: every generator of the chain is closed by the one above it, none is left to the
garbage collector (which closes them in no order and logs "aclose(): asynchronous generator is
already running" for each)."""

import asyncio
import gc
import logging

import pytest
from django.core.handlers.asgi import ASGIHandler

from inference.api.common import streaming_response


async def test_a_client_leaving_mid_send_closes_the_whole_chain(caplog):
    closed = []

    async def innermost():
        try:
            for i in range(100):
                yield f"data: {i}\n\n".encode()
                await asyncio.sleep(0)
        finally:
            await asyncio.sleep(0.01)  # closing takes awaits, as finishing a generation does
            closed.append("innermost")

    async def middle():
        try:
            async for event in innermost():
                yield event
        finally:
            closed.append("middle")

    response = streaming_response(middle(), {})
    sent = 0

    async def send(message):
        nonlocal sent
        sent += 1
        if sent == 3:  # the client is gone while the second chunk is sent
            await asyncio.sleep(3600)

    task = asyncio.create_task(ASGIHandler().send_response(response, send))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gc.collect()
    await asyncio.sleep(0.1)
    assert "innermost" in closed
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]
