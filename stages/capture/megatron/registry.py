"""Prepared calls handed from the async prefetch to the engine's hooks, across threads.

A call's prefix is resolved by ``prefetch`` on the capture loop while the request waits
to enter the engine; ``prepare_prompt`` later runs on the engine's thread and must not
wait, so it only looks here. A prefetch that has not finished by then is marked
abandoned (its late result is dropped) and the call is served from its plain prompt.
The call as served is then parked until the payload stager picks it up at completion.

Everything is under one lock held for dictionary operations only, never across I/O or
awaits, and both maps are bounded so that requests that never reach the engine (or
never finish) cannot grow memory without limit.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass

from stages.capture.core import PreparedCall

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Slot:
    prepared: PreparedCall | None = None
    abandoned: bool = False


class PreparedCalls:
    """Staging key → prefetched call (before admission) and → served call (until completion)."""

    def __init__(self, max_entries: int = 65536) -> None:
        if max_entries <= 0:
            raise ValueError(f"max_entries: must be > 0, got {max_entries}")
        self.max_entries = max_entries
        self.evicted = 0
        self._lock = threading.Lock()
        self._prefetched: OrderedDict[str, _Slot] = OrderedDict()
        self._served: OrderedDict[str, PreparedCall] = OrderedDict()

    def __len__(self) -> int:
        with self._lock:
            return len(self._prefetched) + len(self._served)

    def begin(self, key: str) -> None:
        """A prefetch for ``key`` has started."""
        with self._lock:
            self._prefetched[key] = _Slot()
            dropped = self._bound(self._prefetched)
        _warn(dropped)

    def resolve(self, key: str, prepared: PreparedCall) -> bool:
        """The prefetch finished; False when the call was already admitted without it."""
        with self._lock:
            slot = self._prefetched.get(key)
            if slot is None or slot.abandoned:
                self._prefetched.pop(key, None)
                return False
            slot.prepared = prepared
            return True

    def claim(self, key: str) -> tuple[bool, PreparedCall | None]:
        """At admission: (whether a prefetch was started, its result if it has finished).

        An unfinished prefetch is abandoned: its result, when it comes, is dropped.
        """
        with self._lock:
            slot = self._prefetched.get(key)
            if slot is None:
                return False, None
            if slot.prepared is None:
                slot.abandoned = True
                return True, None
            del self._prefetched[key]
            return True, slot.prepared

    def hold(self, key: str, prepared: PreparedCall) -> None:
        """Park the call as served until its completion is staged."""
        with self._lock:
            self._served[key] = prepared
            dropped = self._bound(self._served)
        _warn(dropped)

    def release(self, key: str) -> PreparedCall | None:
        """The served call for ``key``, removed; None if it was never held (or evicted)."""
        with self._lock:
            return self._served.pop(key, None)

    def _bound(self, entries: OrderedDict[str, _Slot] | OrderedDict[str, PreparedCall]) -> list[str]:
        dropped: list[str] = []
        while len(entries) > self.max_entries:
            key, _ = entries.popitem(last=False)
            dropped.append(key)
        self.evicted += len(dropped)
        return dropped


def _warn(dropped: list[str]) -> None:
    """Logged outside the lock: a log handler may write to a slow stream."""
    for key in dropped:
        log.warning("prepared-call registry full: dropped %s (its capture will fail)", key)


__all__ = ["PreparedCalls"]
