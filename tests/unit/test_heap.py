"""The collector runs per batch of events: the youngest generation every 50,000
allocations, and cycles are still collected. In a process of its own, so that the test
run's collector stays as it is."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json, weakref
from pipeline.process.heap import collect_per_batch

class Node:
    pass

collect_per_batch()
gone = []
cycle = Node()
cycle.self = cycle
ref = weakref.ref(cycle, lambda _: gone.append(True))
del cycle
kept = [Node() for _ in range(60_000)]  # net allocations past the threshold, no explicit collect
print(json.dumps({"threshold": gc.get_threshold(), "cycle_collected": bool(gone)}))
"""


def test_the_collector_runs_per_batch_and_still_frees_cycles() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
    found = json.loads(out)
    assert found["threshold"] == [50_000, 20, 100]
    assert found["cycle_collected"]
