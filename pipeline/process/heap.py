"""Garbage collection for long-lived processes that allocate per event.

CPython runs its youngest collection every 700 net allocations of container objects,
and older ones every 10 of those; a stage allocates a few dozen per event (records,
dicts, tuples), so it ran the collector thousands of times a second, and every older
collection walked again what start-up left behind (torch, TransferQueue, the stage's
own tables). Nothing a stage keeps per event is a reference cycle that only the
collector can free: reference counting frees it. So once start-up is done, what exists
moves where no collection walks it (``gc.freeze``) and the youngest collection runs
every 50,000 allocations. Measured replaying the ledger: 20–25 % more events per CPU
second (bench/RESULTS.md). Cycles are still collected, less often.
"""

from __future__ import annotations

import gc

YOUNG_THRESHOLD = 50_000
OLDER_THRESHOLDS = (20, 100)


def settle_heap() -> None:
    """Call once start-up is done (it may be called again after a restart of the work)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_THRESHOLD, *OLDER_THRESHOLDS)
