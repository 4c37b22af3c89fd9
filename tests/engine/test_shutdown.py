"""A process that served a model exits cleanly: an engine thread's MLX thread-local destructor
takes the GIL after `join` has returned, and if the interpreter is exiting by then the process
aborts ("terminate called without an active exception", exit status 134) unless stopping the
engine waits for its thread to be gone (engine/core/loop.py)."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fixtures.tiny_models import build_tiny_model

ROOT = Path(__file__).resolve().parent.parent.parent
SCRIPT = textwrap.dedent(
    """
    import asyncio
    import sys
    import time

    import engine
    from engine.local import LocalEngineClient
    from engine.protocol import GenerationRequest, ModelSpec, SamplingParams

    client = LocalEngineClient()

    async def main():
        await client.ensure_model(ModelSpec(name="t", path=sys.argv[1]))
        request = GenerationRequest("r", "t", (1, 2, 3), SamplingParams(max_tokens=3))
        async for _ in client.generate(request):
            pass

    class SlowToFinalize:
        # Finalizing takes a moment, as in a web process with its many modules: a wider
        # window for the abort the fix prevents, so two runs catch it as well as three did.
        def __del__(self):
            time.sleep(0.2)

    slow = SlowToFinalize()
    asyncio.run(main())
    client.close(10)  # what the web process's atexit hook does
    """
)


@pytest.mark.slow
def test_a_process_that_served_a_model_exits_with_status_zero():
    model = build_tiny_model()
    for _ in range(2):  # the abort is likely, not certain, on one run
        result = subprocess.run(
            [sys.executable, "-c", SCRIPT, str(model)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert "terminate called" not in result.stderr
        assert result.returncode == 0, result.stderr[-2000:]
