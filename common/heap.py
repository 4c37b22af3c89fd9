"""The startup heap kept out of Python's full garbage collections.

A serving process imports Django, DRF, Channels, transformers and mlx-lm before it serves: about
190,000 objects the cycle collector tracks and will never free. Python's full collection walks
all of them, with the interpreter lock held, whenever enough new objects have survived: measured
here, 80-90 ms each, during which every request of the process waits (the event loop, the
engine's thread, every token stream). Under one team's flood of requests, which allocate the
survivors that trigger it, that pause is what other teams' quick requests see as their p99.

`settle` collects once and moves what is left to the permanent generation (`gc.freeze`), so later
full collections walk only what the process made while serving. Call it once, when the imports
are done and before threads that load models start: a model's objects stay collectable, so an
unloaded model's memory is given back.
"""

from __future__ import annotations

import gc
import logging
import time

logger = logging.getLogger(__name__)


def settle() -> int:
    """Collect, then freeze what survives; return how many objects are frozen."""
    start = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.debug(
        "froze %d startup objects in %.0f ms", frozen, (time.perf_counter() - start) * 1000
    )
    return frozen
