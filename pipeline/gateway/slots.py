"""A worker's concurrent calls, divided fairly among the sessions that want them.

On an engine whose step cost grows with its batch (any CPU engine; a GPU one past its
sweet spot), a session's latency depends on how many calls share the batch. Quotas bound
what one session may have in flight; they do not stop a session that uses all of its
quota from filling the batch beside a polite one. So each worker has ``capacity`` slots,
and a call runs only in a slot:

- **The share.** With ``active`` sessions wanting the worker, one session may hold at
  most ``fair_share(capacity, active)`` slots; a session alone may hold them all.
- **Who is active.** A session holding or waiting for a slot, or one that released its
  last slot within ``idle_s``: an agent making sequential calls keeps its share between
  calls, so a flooder cannot take the slot back in the gap and make it wait.
- **Who goes next.** A freed slot goes to the waiting session holding the fewest, the
  longest waiting first on a tie: max-min fairness across sessions, first in, first out
  within one.

A call waits (its quota still counts it in flight), it is never refused here: a session
over its share is slowed, not failed.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager


def fair_share(capacity: int, active: int) -> int:
    """Slots one of ``active`` sessions may hold on a worker of ``capacity`` slots: an equal
    split, at least one (so every active session makes progress), all of them when alone."""
    return max(1, capacity // max(1, active))


class FairSlots:
    """One worker's slots (``capacity``); ``hold(session)`` waits for one and frees it after."""

    def __init__(
        self, capacity: int, *, idle_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity < 1:
            raise ValueError(f"worker_slots: must be >= 1, got {capacity}")
        self.capacity = capacity
        self.idle_s = idle_s
        self.clock = clock
        self.held: Counter[str] = Counter()
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._released: dict[str, float] = {}
        self.waited = 0
        """Calls that waited for a slot: a session over its share, or a full worker."""

    @property
    def busy(self) -> int:
        return sum(self.held.values())

    @asynccontextmanager
    async def hold(self, session: str) -> AsyncIterator[None]:
        await self._acquire(session)
        try:
            yield
        finally:
            self._release(session)

    def _active(self) -> int:
        now = self.clock()
        for session, at in list(self._released.items()):
            if now - at > self.idle_s:
                del self._released[session]
        return len(self.held.keys() | self._waiting.keys() | self._released.keys())

    def _may_start(self, session: str) -> bool:
        share = fair_share(self.capacity, self._active())
        return self.busy < self.capacity and self.held[session] < share

    async def _acquire(self, session: str) -> None:
        self._released.pop(session, None)
        turn = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(session, deque()).append(turn)
        self._grant()
        if not turn.done():
            self.waited += 1
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():  # granted as it was cancelled: give it back
                self._release(session)
            else:
                self._forget(session, turn)
            raise

    def _release(self, session: str) -> None:
        self.held[session] -= 1
        if self.held[session] <= 0:
            del self.held[session]
            self._released[session] = self.clock()
        self._grant()

    def _grant(self) -> None:
        """Free slots to waiting sessions, fewest held first (the longest waiting on a tie)."""
        while self._waiting and self.busy < self.capacity:
            ready = [s for s in self._waiting if self._may_start(s)]
            if not ready:
                return
            session = min(ready, key=lambda s: self.held[s])  # min keeps the first (oldest) on a tie
            queue = self._waiting[session]
            turn = queue.popleft()
            if not queue:
                del self._waiting[session]
            self.held[session] += 1
            turn.set_result(None)

    def _forget(self, session: str, turn: asyncio.Future[None]) -> None:
        queue = self._waiting.get(session)
        if queue is not None and turn in queue:
            queue.remove(turn)
            if not queue:
                del self._waiting[session]
        self._grant()


__all__ = ["FairSlots", "fair_share"]
