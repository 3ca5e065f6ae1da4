"""The background writer: rows to the data plane, then one StagedEvent per call.

It runs on the worker's event loop, off the engine's path. Rows are batched by count
and by time; a batch that fails to write turns every call in it into
``capture_failed`` with its code. Nothing is dropped silently: a call the writer
cannot take (full queue) is still reported, through a light failure lane.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from stages.capture.retain import RetainedRows
from stages.ports import DataPlane, DataPlaneError, DataPlaneTimeout, EventSink
from topics.failures import WorkerFailure
from topics.records import CommitCoords, StagedEvent
from topics.staging import CallRow

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingCall:
    """One call on its way out: its row (None when capture already failed) and coords."""

    coords: CommitCoords
    row: CallRow | None
    response_id: str | None = None
    done: asyncio.Future[CommitCoords] | None = None


@dataclass(slots=True)
class WriterStats:
    staged: int = 0
    failed: Counter[str] = field(default_factory=Counter)
    batches: int = 0
    queue_full: int = 0


def failed_coords(coords: CommitCoords, code: WorkerFailure) -> CommitCoords:
    return coords.model_copy(update={"disposition": "capture_failed", "failure_reason": code})


class StagingWriter:
    """Batches rows into the data plane and publishes their staged events."""

    def __init__(
        self,
        data_plane: DataPlane,
        sink: EventSink,
        *,
        worker_id: str,
        max_queue: int = 4096,
        batch_rows: int = 32,
        batch_delay_s: float = 0.005,
        publish_retry_s: float = 0.5,
        on_failed: Callable[[str], None] | None = None,
        retained: RetainedRows | None = None,
    ) -> None:
        self.data_plane = data_plane
        self.retained = retained
        self.sink = sink
        self.worker_id = worker_id
        self.max_queue = max_queue
        self.batch_rows = batch_rows
        self.batch_delay_s = batch_delay_s
        self.publish_retry_s = publish_retry_s
        self.on_failed = on_failed
        self.stats = WriterStats()
        self._rows: deque[PendingCall] = deque()
        self._failures: deque[PendingCall] = deque()
        self._wake = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    @property
    def backlog(self) -> int:
        return len(self._rows) + len(self._failures)

    def submit(self, pending: PendingCall) -> bool:
        """Queue a row without waiting; False when the queue is full (the caller fails the call)."""
        if self._closing or len(self._rows) >= self.max_queue:
            self.stats.queue_full += 1
            return False
        self._rows.append(pending)
        self._wake.set()
        return True

    def submit_failure(self, pending: PendingCall) -> None:
        """Report a call whose capture failed; light, so this lane is never refused."""
        self._failures.append(pending)
        self._wake.set()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="staging-writer")

    async def stop(self) -> None:
        """Finish what is queued, then stop."""
        self._closing = True
        self._wake.set()
        if self._task is not None:
            await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            if not self._rows and not self._failures:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            if self._failures:
                failures = [self._failures.popleft() for _ in range(len(self._failures))]
                await self._publish(failures)
            if self._rows:
                if len(self._rows) < self.batch_rows and not self._closing:
                    await asyncio.sleep(self.batch_delay_s)
                batch = [self._rows.popleft() for _ in range(min(self.batch_rows, len(self._rows)))]
                await self._write(batch)

    async def _write(self, batch: list[PendingCall]) -> None:
        rows = [p.row for p in batch if p.row is not None]
        code: WorkerFailure | None = None
        try:
            await self.data_plane.put_calls(rows)
        except DataPlaneTimeout as exc:
            code, reason = WorkerFailure.STAGING_TIMEOUT, str(exc)
        except (DataPlaneError, OSError) as exc:
            code, reason = WorkerFailure.STAGING_WRITE_FAILED, str(exc)
        if code is None and self.retained is not None:
            await self._delete_late(self.retained.add(rows))
        if code is not None:
            log.warning("staging write of %d row(s) failed: %s", len(rows), reason)
            for pending in batch:
                pending.coords = failed_coords(pending.coords, code)
                if self.on_failed is not None:
                    self.on_failed(pending.coords.staging_key)
        self.stats.batches += 1
        await self._publish(batch)

    async def _delete_late(self, keys: list[str]) -> None:
        """Rows whose rollout was finalized before they were written: nobody else deletes them."""
        if not keys:
            return
        try:
            await self.data_plane.delete_calls(keys)
        except DataPlaneError as exc:
            log.warning(
                "could not delete %d row(s) written after their rollout was finalized: %s", len(keys), exc
            )

    async def restage(self, plane: DataPlane) -> int:
        """Stage every held row again into ``plane`` (a data plane that restarted empty);
        returns how many. Their staged events were published already: rows only."""
        if self.retained is None:
            return 0
        rows = self.retained.held()
        for start in range(0, len(rows), self.batch_rows):
            part = rows[start : start + self.batch_rows]
            await plane.put_calls(part)
            self.retained.stats.restaged += len(part)
        if rows:
            log.warning("staged %d held row(s) again into a restarted data plane", len(rows))
        return len(rows)

    async def _publish(self, batch: list[PendingCall]) -> None:
        """Publish until acknowledged: a staged event must never be lost."""
        now = time.time()
        events = [
            StagedEvent(
                coords=p.coords.call_coords(),
                response_id=p.response_id,
                worker_id=self.worker_id,
                staged_at=now,
            )
            for p in batch
        ]
        while True:
            try:
                await self.sink.publish(events)
                break
            except Exception as exc:  # the broker may be briefly away; keep the events
                log.warning("publishing %d staged event(s) failed, retrying: %s", len(events), exc)
                await asyncio.sleep(self.publish_retry_s)
        for pending in batch:
            if pending.coords.disposition == "staged":
                self.stats.staged += 1
            else:
                self.stats.failed[str(pending.coords.failure_reason)] += 1
            if pending.done is not None and not pending.done.done():
                pending.done.set_result(pending.coords)
