"""The workers behind the gateway: sticky to a session's last worker, else the least loaded.

A session's next call goes to the worker that served its last call while that worker
is healthy (its prefix cache and chain cache hold the conversation). Otherwise the
healthy worker with the fewest calls in flight takes it. A worker that fails a call
(connection refused, reset, 5xx before any byte of the reply) is taken out for
``cooldown_s`` and the call is retried on another worker as a new attempt. Each worker's
calls are shared fairly among sessions (``slots.FairSlots``) in slots whose number
``slots`` sets (None: learned per worker, ``capacity``; 0: no bound); a call waits for
its slot while it counts in flight.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass

from pipeline.gateway.capacity import LearnedCapacity
from pipeline.gateway.slots import FairSlots, SlotUse


class NoWorker(RuntimeError):
    """Every worker is out; the call cannot be served now (a 503)."""


@dataclass(slots=True)
class _Worker:
    url: str
    slots: FairSlots | None
    in_flight: int = 0
    out_until: float = 0.0
    served: int = 0
    failures: int = 0


class Workers:
    """The worker pool; ``choose`` picks, ``serving`` counts a call in flight, ``failed`` benches."""

    def __init__(
        self,
        urls: Sequence[str],
        *,
        cooldown_s: float = 10.0,
        slots: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not urls:
            raise ValueError("urls: at least one worker is required")
        if slots is not None and slots < 0:
            raise ValueError(f"worker_slots: must be >= 0 (0: no bound), got {slots}")
        self._workers = {url.rstrip("/"): _Worker(url.rstrip("/"), _slots(slots)) for url in urls}
        self.cooldown_s = cooldown_s
        self.clock = clock

    @property
    def urls(self) -> list[str]:
        return list(self._workers)

    def healthy(self, url: str) -> bool:
        worker = self._workers.get(url)
        return worker is not None and worker.out_until <= self.clock()

    def choose(self, preferred: str | None = None, *, avoid: Sequence[str] = ()) -> str:
        if preferred is not None and preferred not in avoid and self.healthy(preferred):
            return preferred
        candidates = [w for w in self._workers.values() if w.url not in avoid and self.healthy(w.url)]
        if not candidates:
            raise NoWorker(f"no healthy worker (of {len(self._workers)}) can take the call")
        return min(candidates, key=lambda w: (w.in_flight, w.served)).url

    @asynccontextmanager
    async def serving(self, url: str, session: str) -> AsyncIterator[SlotUse]:
        """One call of ``session`` on the worker: in its slot (waited for), counted in flight."""
        worker = self._workers[url]
        async with AsyncExitStack() as stack:
            use = (
                SlotUse()
                if worker.slots is None
                else await stack.enter_async_context(worker.slots.hold(session))
            )
            worker.in_flight += 1
            try:
                yield use
            finally:
                worker.in_flight -= 1
                worker.served += 1

    def failed(self, url: str) -> None:
        worker = self._workers[url]
        worker.failures += 1
        worker.out_until = self.clock() + self.cooldown_s

    def stats(self) -> list[tuple[str, int, int, bool]]:
        """(url, in flight, failures, healthy) per worker, for metrics."""
        return [(w.url, w.in_flight, w.failures, self.healthy(w.url)) for w in self._workers.values()]

    def slot_waits(self) -> list[tuple[str, int]]:
        """(url, calls that waited for a slot) per worker with slots, for metrics."""
        return [(w.url, w.slots.waited) for w in self._workers.values() if w.slots is not None]

    def capacities(self) -> list[tuple[str, int]]:
        """(url, slot capacity: fixed or learned) per worker with slots, for metrics."""
        return [(w.url, w.slots.limit) for w in self._workers.values() if w.slots is not None]


def _slots(slots: int | None) -> FairSlots | None:
    """A worker's fair slots: learned (None), none (0) or that many."""
    if slots == 0:
        return None
    return FairSlots(LearnedCapacity() if slots is None else slots)


__all__ = ["NoWorker", "Workers"]
