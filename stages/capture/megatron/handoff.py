"""A non-blocking hand-off from the engine's thread to a task on the capture loop.

Megatron calls its completion hook on model-parallel rank 0 inside the engine step,
from whatever thread runs the engine; the capture core and its writer live on their own
asyncio loop. ``put`` appends under a lock held for a list append and, only when the
consumer is idle, wakes it with one ``call_soon_threadsafe``: no waiting, no I/O beyond
the loop's self-pipe wake-up. The queue is bounded; light items (failures) may be forced
past the bound so that no call goes unreported.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class HandoffClosed(RuntimeError):
    """The consumer's loop is gone (never started, stopped or closed)."""


class Handoff(Generic[T]):
    """Many producer threads, one consumer coroutine on ``loop``."""

    def __init__(self, max_pending: int = 4096) -> None:
        if max_pending <= 0:
            raise ValueError(f"max_pending: must be > 0, got {max_pending}")
        self.max_pending = max_pending
        self.loop: asyncio.AbstractEventLoop | None = None
        self._items: deque[T] = deque()
        self._lock = threading.Lock()
        self._wake_pending = False
        self._wake: asyncio.Event | None = None

    def bind(self) -> None:
        """Attach to the running loop; call from the consumer's loop before ``put``."""
        self.loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._items)

    def put(self, item: T, *, force: bool = False) -> bool:
        """Queue ``item``; False when full (unless ``force``). Raises ``HandoffClosed``."""
        loop, wake = self.loop, self._wake
        if loop is None or wake is None or loop.is_closed():
            raise HandoffClosed("the capture loop is not running")
        with self._lock:
            if not force and len(self._items) >= self.max_pending:
                return False
            self._items.append(item)
            if self._wake_pending:
                return True
            self._wake_pending = True
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError as exc:  # closed between the check and the call
            raise HandoffClosed(str(exc)) from None
        return True

    def take(self) -> list[T]:
        """Everything queued, oldest first (consumer side)."""
        with self._lock:
            items = list(self._items)
            self._items.clear()
            self._wake_pending = False
        return items

    async def wait(self) -> None:
        """Until something may have been queued (consumer side)."""
        assert self._wake is not None, "bind() first"
        self._wake.clear()
        if self.pending:
            return
        await self._wake.wait()

    def wake(self) -> None:
        """Wake the consumer from its own loop (used to stop it)."""
        if self._wake is not None:
            self._wake.set()


__all__ = ["Handoff", "HandoffClosed"]
