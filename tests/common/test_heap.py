"""The startup heap frozen out of full collections (common/heap.py), in fresh interpreters: a
freeze is for the life of a process, and the test process's own collections are not this
test's to change."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent

SETTLE = """
import gc, json, weakref
from common import heap

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a

kept = [cycle() for _ in range(1000)]
garbage = cycle()
dead = weakref.ref(garbage)
del garbage
alive = len(gc.get_objects())
frozen = heap.settle()
after = cycle()
gone = weakref.ref(after)
del after
collected = gc.collect()
print(json.dumps({
    "alive": alive, "frozen": frozen, "garbage_collected_first": dead() is None,
    "kept_alive": all(node.other.other is node for node in kept),
    "new_cycle_collected": gone() is None, "collected": collected,
}))
"""


def run(code: str, **env: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_settle_freezes_the_live_heap_and_leaves_new_objects_collectable():
    facts = run(SETTLE)
    # What was garbage at the call is collected, not frozen; what lived is frozen and intact.
    assert facts["garbage_collected_first"]
    assert facts["frozen"] >= 2000  # the kept cycles' nodes at least
    assert facts["frozen"] >= 0.95 * facts["alive"]
    assert facts["kept_alive"]
    # Cycles made afterwards are still the collector's.
    assert facts["new_cycle_collected"]
    assert facts["collected"] >= 2


def test_the_asgi_application_settles_its_imports_before_serving(tmp_path):
    facts = run(
        "import gc, json, config.asgi\n"
        "print(json.dumps({'frozen': gc.get_freeze_count(), 'tracked': len(gc.get_objects())}))",
        DJANGO_SETTINGS_MODULE="config.settings",
        ORCHARD_HOME=str(tmp_path),
        ORCHARD_PRELOAD_MODELS="0",
        ORCHARD_PULL_RUNNER="0",
        ORCHARD_BATCH_RUNNER="0",
    )
    # Django, DRF, Channels, transformers and mlx-lm: most of what the collector would walk.
    assert facts["frozen"] > 50_000
    assert facts["tracked"] < facts["frozen"] / 4
