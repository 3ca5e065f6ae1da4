"""An attached data plane that follows its owner across restarts.

When the process that owns the data plane dies and a new one starts, it publishes new
addresses. Attached clients (workers, the finalizer) notice by themselves: a watcher
reads the address file every ``poll_s``, and a call that fails looks at it too. On a
new owner the client attaches to it, tells whoever registered (a worker stages the rows
it holds again, the finalizer puts back the samples their owners have not acknowledged),
and retries the failed call once. A client that must not fail while an owner is being
replaced (the finalizer, whose sample copies die with it) sets ``owner_wait_s``: a call
that failed because its owner's process is gone waits that long for the successor.

Rows and samples come back only as fast as their holders put them back, so a reader
that decides they are lost (the finalizer, a trainer feed) sets ``restage_grace_s``:
while the owner is younger than that (it has just started: after a crash, the holders
are putting back what they keep) a read that finds rows or samples missing waits for
them instead of reporting them lost at once. That
holds as well for a client that attached to the new owner from scratch, such as a
finalizer restarted after the old owner died. Other readers keep their own bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pipeline.dataplane.addresses import AddressesError, DataPlaneAddresses
from pipeline.dataplane.transferqueue import TransferQueueDataPlane
from stages.ports import DataPlane, DataPlaneError, MissingRows
from topics.records import StagedCall, TrainingSample
from topics.staging import CallRow

log = logging.getLogger(__name__)

T = TypeVar("T")
Reattached = Callable[[DataPlane], Awaitable[object]]

POLL_S = 1.0
RETRY_READ_S = 0.5


class ReattachingDataPlane:
    """The ``DataPlane`` port on an attached TransferQueue, re-attaching to a new owner."""

    def __init__(
        self,
        plane: TransferQueueDataPlane,
        addresses_path: Path,
        *,
        options: dict[str, Any],
        restage_grace_s: float = 0.0,
        owner_wait_s: float = 0.0,
    ) -> None:
        self._plane = plane
        self.addresses_path = addresses_path
        self._options = options
        self.restage_grace_s = restage_grace_s
        self.owner_wait_s = owner_wait_s
        self.reattaches = 0
        self._listeners: list[Reattached] = []
        self._retiring: set[asyncio.Task[None]] = set()
        self._lock = asyncio.Lock()

    @property
    def addresses(self) -> DataPlaneAddresses | None:
        return self._plane.addresses

    def on_reattach(self, listener: Reattached) -> None:
        """Await ``listener(plane)`` after every re-attach (a worker re-stages its rows)."""
        self._listeners.append(listener)

    async def watch(self, poll_s: float = POLL_S) -> None:
        """Follow the address file until cancelled."""
        while True:
            await asyncio.sleep(poll_s)
            try:
                await self.follow()
            except DataPlaneError as exc:
                log.warning("data plane at %s: %s", self.addresses_path, exc)
            except Exception:  # the watcher must outlive any one failed attempt
                log.exception("following the data plane at %s failed", self.addresses_path)

    async def follow(self) -> bool:
        """Attach to the owner the address file names now, if it is a new one."""
        published = self._published()
        if published is None or _same_owner(published, self._plane.addresses):
            return False
        async with self._lock:
            if _same_owner(published, self._plane.addresses):
                return True  # another caller re-attached meanwhile
            fresh = await TransferQueueDataPlane.attach(published, **self._options)
            stale, self._plane = self._plane, fresh
            self.reattaches += 1
            log.warning("data plane owner changed (pid %s); re-attached to %s", published.pid, fresh.endpoint)
            self._retire(stale)
        for listener in self._listeners:
            try:
                await listener(self)
            except Exception:
                log.exception("re-attach listener failed")
        return True

    async def close(self) -> None:
        for task in self._retiring:
            task.cancel()
        await self._plane.close()

    def _retire(self, stale: TransferQueueDataPlane) -> None:
        """Close the old client once calls still in flight on it have timed out: closing
        it under them would cancel them instead of letting them fail as errors."""

        async def later() -> None:
            await asyncio.sleep(stale.timeout_s + 1.0)
            with contextlib.suppress(Exception):
                await stale.close()

        task = asyncio.create_task(later(), name="dataplane-retire")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    # ------------------------------------------------------------ the DataPlane port

    async def put_calls(self, rows: Sequence[CallRow]) -> None:
        await self._call(lambda plane: plane.put_calls(rows))

    async def get_calls(self, keys: Sequence[str]) -> dict[str, StagedCall]:
        return await self._read(lambda plane: plane.get_calls(keys))

    async def delete_calls(self, keys: Sequence[str]) -> None:
        await self._call(lambda plane: plane.delete_calls(keys))

    async def put_samples(self, samples: Sequence[TrainingSample]) -> None:
        await self._call(lambda plane: plane.put_samples(samples))

    async def get_samples(self, keys: Sequence[str]) -> dict[str, TrainingSample]:
        return await self._read(lambda plane: plane.get_samples(keys))

    async def delete_samples(self, keys: Sequence[str]) -> None:
        await self._call(lambda plane: plane.delete_samples(keys))

    async def list_keys(self, partition: str) -> list[str]:
        return await self._call(lambda plane: plane.list_keys(partition))

    # ------------------------------------------------------------ internals

    async def _call(self, work: Callable[[TransferQueueDataPlane], Awaitable[T]]) -> T:
        plane = self._plane
        try:
            return await work(plane)
        except MissingRows:
            raise
        except DataPlaneError:
            moved = plane is not self._plane or await self._successor(plane)
            if not moved:
                raise
        return await work(self._plane)

    async def _successor(self, failed: TransferQueueDataPlane) -> bool:
        """Attach to a new owner if one is published now or, while the failed call's owner is
        dead, within ``owner_wait_s`` (a restarted owner takes seconds to publish)."""
        deadline = time.monotonic() + self.owner_wait_s
        while not await self.follow():
            addresses = failed.addresses
            dead = addresses is not None and addresses.owner_alive() is False
            if not dead or time.monotonic() >= deadline:
                return False
            await asyncio.sleep(RETRY_READ_S)
        return True

    async def _read(self, work: Callable[[TransferQueueDataPlane], Awaitable[T]]) -> T:
        """A read that, while the owner is young, waits for rows still being staged again."""
        while True:
            try:
                return await self._call(work)
            except MissingRows:
                addresses = self._plane.addresses
                if addresses is None or time.time() - addresses.created_at > self.restage_grace_s:
                    raise
                await asyncio.sleep(RETRY_READ_S)

    def _published(self) -> DataPlaneAddresses | None:
        try:
            return DataPlaneAddresses.read(self.addresses_path)
        except (AddressesError, OSError):
            return None  # not (yet) published: the owner is starting or gone


def _same_owner(a: DataPlaneAddresses, b: DataPlaneAddresses | None) -> bool:
    return b is not None and (a.pid, a.created_at, a.controller_address) == (
        b.pid,
        b.created_at,
        b.controller_address,
    )


if TYPE_CHECKING:

    def _implements_the_port(plane: ReattachingDataPlane) -> DataPlane:
        return plane
