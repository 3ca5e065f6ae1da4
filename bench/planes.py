"""Data planes for the benchmarks: where TransferQueue runs, and an injected delay.

Placements:

- ``separate``: a ``tokentrail dataplane`` child process owns TransferQueue and the
  benchmark attaches with the ordinary client, as a worker or a stage does in
  production (its server threads do not share this interpreter's GIL);
- ``embedded``: controller and storage unit inside this process, the single-machine
  default of ``tokentrail run``;
- ``memory``: a dict (``stages.memory.MemoryDataPlane``), for smoke tests only.

``DelayedDataPlane`` adds a fixed sleep to every call, standing in for a data plane
that is further away or busier than the local one: how capture reacts to data-plane
latency is what separates blocking capture from capture that never waits.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Literal

from stages.memory import MemoryDataPlane
from stages.ports import DataPlane
from topics.records import StagedCall, TrainingSample
from topics.staging import CallRow

Placement = Literal["separate", "embedded", "memory"]
PLACEMENTS: tuple[Placement, ...] = ("separate", "embedded", "memory")


@contextlib.asynccontextmanager
async def open_plane(placement: Placement, *, timeout_s: float = 60.0) -> AsyncIterator[DataPlane]:
    """A running data plane of the given placement, stopped on exit."""
    if placement == "memory":
        yield MemoryDataPlane()
        return
    if placement == "embedded":
        from pipeline.dataplane.embedded import embedded_data_plane

        async with embedded_data_plane(timeout_s=timeout_s) as plane:
            yield plane
        return
    if placement == "separate":
        from bench.dataplane import separate_data_plane

        async with separate_data_plane(timeout_s) as attached:
            yield attached
        return
    raise ValueError(f"placement: one of {PLACEMENTS}, got {placement!r}")


class DelayedDataPlane:
    """Every call sleeps ``delay_s`` first, then goes to ``inner``."""

    def __init__(self, inner: DataPlane, delay_s: float) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s: must be >= 0, got {delay_s}")
        self.inner = inner
        self.delay_s = delay_s
        self.calls = 0

    async def _wait(self) -> None:
        self.calls += 1
        await asyncio.sleep(self.delay_s)

    async def put_calls(self, rows: Sequence[CallRow]) -> None:
        await self._wait()
        await self.inner.put_calls(rows)

    async def get_calls(self, keys: Sequence[str]) -> dict[str, StagedCall]:
        await self._wait()
        return await self.inner.get_calls(keys)

    async def delete_calls(self, keys: Sequence[str]) -> None:
        await self._wait()
        await self.inner.delete_calls(keys)

    async def put_samples(self, samples: Sequence[TrainingSample]) -> None:
        await self._wait()
        await self.inner.put_samples(samples)

    async def get_samples(self, keys: Sequence[str]) -> dict[str, TrainingSample]:
        await self._wait()
        return await self.inner.get_samples(keys)

    async def delete_samples(self, keys: Sequence[str]) -> None:
        await self._wait()
        await self.inner.delete_samples(keys)

    async def list_keys(self, partition: str) -> list[str]:
        await self._wait()
        return await self.inner.list_keys(partition)


def with_delay(plane: DataPlane, delay_s: float) -> DataPlane:
    """``plane`` itself for no delay, else wrapped."""
    return plane if delay_s <= 0 else DelayedDataPlane(plane, delay_s)


__all__ = ["PLACEMENTS", "DelayedDataPlane", "Placement", "open_plane", "with_delay"]
