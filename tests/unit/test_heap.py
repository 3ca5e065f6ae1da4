"""A settled heap: start-up's objects frozen, the youngest collection per 50,000 allocations,
cycles still collected. In a process of its own: the test run's collector stays as it is."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json
from pipeline.process.heap import settle_heap

class Node:
    pass

settle_heap()
frozen = gc.get_freeze_count()
cycle = Node(); cycle.self = cycle
gone = []
import weakref
ref = weakref.ref(cycle, lambda _: gone.append(True))
del cycle
gc.collect()
print(json.dumps({"threshold": gc.get_threshold(), "frozen": frozen, "cycle_collected": bool(gone)}))
"""


def test_settling_freezes_start_up_and_raises_the_young_threshold() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    found = json.loads(out)
    assert found["threshold"] == [50_000, 20, 100]
    assert found["frozen"] > 1000  # the interpreter's and the imports' objects
    assert found["cycle_collected"]
