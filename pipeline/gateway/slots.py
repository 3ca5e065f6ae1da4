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

The capacity is a number set by hand or, by default, learned from the worker's measured
speed (``capacity.LearnedCapacity``). A learned one bounds only how far a session goes
past one call: a session holding no slot starts its call at once, whatever the limit (a
polite, sequential agent never waits), and each call reports its generated tokens
(``SlotUse``) for the capacity to learn from.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from pipeline.gateway.capacity import LearnedCapacity


def fair_share(capacity: int, active: int) -> int:
    """Slots one of ``active`` sessions may hold on a worker of ``capacity`` slots: an equal
    split, at least one (so every active session makes progress), all of them when alone."""
    return max(1, capacity // max(1, active))


@dataclass(slots=True)
class SlotUse:
    """One call in its slot: ``generated`` reports its tokens once the reply is in (a learned
    capacity learns from them; otherwise they are ignored)."""

    number: int = 0
    """The call's grant number on a learned capacity (0: nothing learns from it)."""
    batch: int = 0
    """Calls running on the worker, this one included, when it was granted."""
    started: float = 0.0
    ended: float | None = None
    learner: LearnedCapacity | None = None
    clock: Callable[[], float] = time.monotonic

    def generated(self, tokens: int | None) -> None:
        if self.learner is None or tokens is None:
            return
        ended = self.clock() if self.ended is None else self.ended
        self.learner.observe(
            number=self.number, batch=self.batch, seconds=ended - self.started, tokens=tokens
        )
        self.learner = None  # one report per call


class FairSlots:
    """One worker's slots; ``hold(session)`` waits for one and frees it after.

    ``capacity`` is a fixed number of slots, or a ``LearnedCapacity`` whose limit the calls
    teach (a session holding none may then always start one).
    """

    def __init__(
        self,
        capacity: int | LearnedCapacity,
        *,
        idle_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if isinstance(capacity, int) and capacity < 1:
            raise ValueError(f"worker_slots: must be >= 1, got {capacity}")
        self.learned = capacity if isinstance(capacity, LearnedCapacity) else None
        self.fixed = capacity if isinstance(capacity, int) else 0
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

    @property
    def limit(self) -> int:
        """The capacity now: the fixed one, or the learned one."""
        return self.fixed if self.learned is None else self.learned.limit

    @asynccontextmanager
    async def hold(self, session: str) -> AsyncIterator[SlotUse]:
        await self._acquire(session)
        use = SlotUse(batch=self.busy, started=self.clock(), clock=self.clock)
        if self.learned is not None:
            use.number, use.learner = self.learned.granted(), self.learned
        try:
            yield use
        finally:
            use.ended = self.clock()
            self._release(session)

    def _active(self) -> int:
        self._forget_idle()
        return len(self.held.keys() | self._waiting.keys() | self._released.keys())

    def _forget_idle(self) -> None:
        """Drop the sessions that released their last slot over ``idle_s`` ago. Run on every
        release too, not only when a share is computed: on a learned capacity a session's
        first call starts without one, so sequential agents never compute it, and every
        session the gateway served would stay here. ``_released`` is in release order
        (a session is popped when it acquires again), so the idle ones are at its front."""
        now = self.clock()
        while self._released:
            session, at = next(iter(self._released.items()))
            if now - at <= self.idle_s:
                return
            del self._released[session]

    def _may_start(self, session: str) -> bool:
        held = self.held[session]
        if held == 0 and self.learned is not None:
            return True  # one call per session runs whatever the learned limit
        return self.busy < self.limit and held < fair_share(self.limit, self._active())

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
            self._forget_idle()
            self._released[session] = self.clock()
        self._grant()

    def _grant(self) -> None:
        """Free slots to waiting sessions, fewest held first (the longest waiting on a tie)."""
        while self._waiting:
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


__all__ = ["FairSlots", "SlotUse", "fair_share"]
