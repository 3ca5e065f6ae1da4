"""What each recently closed rollout covered: how the ledger tells a late event from a duplicate.

An event for a rollout whose receipt is out is either a copy of one the receipt already
accounts for (a redelivery, a replay) or new: a call the receipt never saw. The first
is counted; the second is dead-lettered, so that nothing is dropped silently. For that
the ledger keeps, per closed rollout, an 8-byte hash of every call id it covered (a
sorted array: a few bytes a call, looked up by bisection), within a byte budget, the
oldest rollouts forgotten first. The hash is Python's own string hash (64-bit SipHash,
keyed at random per process; nothing here outlives the process): the ids are already
keys of the rollout's dictionaries, so their hashes are computed and cached, and
closing a rollout hashes nothing again. A rollout it does not remember (closed before
a restart, or forgotten) cannot be judged: its late events are counted (DESIGN §7).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Iterable

DEFAULT_BUDGET_BYTES = 16 * 2**20
ROLLOUT_OVERHEAD_BYTES = 200
"""A remembered rollout's id, array header and dictionary slot."""


class ClosedRollouts:
    """Covered call ids per closed rollout, oldest forgotten first over ``budget_bytes``."""

    def __init__(self, budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes: must be >= 0, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._covered: OrderedDict[str, array[int]] = OrderedDict()
        self._bytes = 0

    def add(self, rollout_id: str, call_ids: Iterable[str]) -> None:
        hashes = array("q", sorted({hash(call_id) for call_id in call_ids}))
        previous = self._covered.pop(rollout_id, None)
        if previous is not None:
            self._bytes -= _size(previous)
        self._covered[rollout_id] = hashes
        self._bytes += _size(hashes)
        while self._covered and self._bytes > self.budget_bytes:
            _, oldest = self._covered.popitem(last=False)
            self._bytes -= _size(oldest)

    def covers(self, rollout_id: str, call_id: str) -> bool | None:
        """Whether the rollout's receipt accounted for ``call_id``; ``None`` when the
        rollout is not remembered. A hash collision (one in 2^64) reads as covered."""
        hashes = self._covered.get(rollout_id)
        if hashes is None:
            return None
        wanted = hash(call_id)
        at = bisect_left(hashes, wanted)
        return at < len(hashes) and hashes[at] == wanted

    def __len__(self) -> int:
        return len(self._covered)


def _size(hashes: array[int]) -> int:
    return ROLLOUT_OVERHEAD_BYTES + hashes.itemsize * len(hashes)
