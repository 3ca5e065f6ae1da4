"""A ``DataPlane`` that times every call it forwards (for the data-plane latency metrics).

TransferQueue costs milliseconds per call and its RPCs can hang (DESIGN §3), so the
time spent in the data plane is the first thing to look at when a worker's staging
backlog or a finalizer's lag grows. Timing wraps the port, not its users: the
capture writer and the finalizer stay unaware of metrics.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from stages.ports import DataPlane, MissingRows
from topics.records import StagedCall, TrainingSample
from topics.staging import CallRow

T = TypeVar("T")

Observe = Callable[[str, str, float], None]
"""``observe(operation, outcome, seconds)``; outcome is ``ok``, ``missing`` or ``error``."""


class TimedDataPlane:
    """Forwards to ``inner`` and reports each call's duration and outcome to ``observe``."""

    def __init__(self, inner: DataPlane, observe: Observe) -> None:
        self.inner = inner
        self.observe = observe

    async def _timed(self, operation: str, call: Awaitable[T]) -> T:
        start = time.perf_counter()
        outcome = "error"
        try:
            result = await call
            outcome = "ok"
            return result
        except MissingRows:
            outcome = "missing"  # an answer, not a failure: callers act on the missing keys
            raise
        finally:
            self.observe(operation, outcome, time.perf_counter() - start)

    async def put_calls(self, rows: Sequence[CallRow]) -> None:
        await self._timed("put_calls", self.inner.put_calls(rows))

    async def get_calls(self, keys: Sequence[str]) -> dict[str, StagedCall]:
        return await self._timed("get_calls", self.inner.get_calls(keys))

    async def delete_calls(self, keys: Sequence[str]) -> None:
        await self._timed("delete_calls", self.inner.delete_calls(keys))

    async def put_samples(self, samples: Sequence[TrainingSample]) -> None:
        await self._timed("put_samples", self.inner.put_samples(samples))

    async def get_samples(self, keys: Sequence[str]) -> dict[str, TrainingSample]:
        return await self._timed("get_samples", self.inner.get_samples(keys))

    async def delete_samples(self, keys: Sequence[str]) -> None:
        await self._timed("delete_samples", self.inner.delete_samples(keys))

    async def list_keys(self, partition: str) -> list[str]:
        return await self._timed("list_keys", self.inner.list_keys(partition))


def timed(plane: DataPlane, observe: Observe) -> TimedDataPlane:
    """Wrap ``plane``; a plane already wrapped is re-wrapped at its core, never twice."""
    inner = plane.inner if isinstance(plane, TimedDataPlane) else plane
    return TimedDataPlane(inner, observe)
