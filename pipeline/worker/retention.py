"""A worker keeps its staged rows until their rollout is finalized (``RetainedRows``).

Two things make that useful: the rows are let go as ``tokentrail.finalized`` reports each
rollout done (read from the topic's end, outside any consumer group), and a data plane
that re-attaches to a new owner gets every held row staged again. A finalized rollout's
rows are deleted once more by the worker: a copy staged again, or written late, after
the finalizer's own delete would otherwise stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping

from aiokafka import TopicPartition

from pipeline.dataplane.reattach import ReattachingDataPlane
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.reader import assigned_reader, topic_ends
from stages.capture.writer import StagingWriter
from stages.ports import DataPlane, DataPlaneError
from topics.codec import HEADER_TYPE
from topics.events import EventType

log = logging.getLogger(__name__)

POLL_MS = 500


@contextlib.asynccontextmanager
async def retaining(writer: StagingWriter, plane: DataPlane, kafka: KafkaConfig) -> AsyncIterator[None]:
    """While the block runs: release finalized rollouts' rows, re-stage on re-attach."""
    if writer.retained is None:
        yield
        return
    if isinstance(plane, ReattachingDataPlane):
        plane.on_reattach(writer.restage)
    start = await topic_ends(kafka, kafka.names.finalized)
    task = asyncio.create_task(release_finalized(kafka, start, writer, plane), name="release-finalized")
    task.add_done_callback(_report_failure)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def release_finalized(
    kafka: KafkaConfig, start: Mapping[TopicPartition, int], writer: StagingWriter, plane: DataPlane
) -> None:
    """Follow the finalized topic from ``start``; let go of each finalized rollout's rows."""
    assert writer.retained is not None
    wanted = (HEADER_TYPE, EventType.FINALIZED.value.encode())
    async with assigned_reader(kafka, start, fetch_max_wait_ms=POLL_MS) as consumer:
        while True:
            batch = await consumer.getmany(timeout_ms=POLL_MS)
            done: list[str] = []
            for records in batch.values():
                for record in records:
                    if record.key is not None and wanted in list(record.headers):
                        done += writer.retained.release(record.key.decode(errors="replace"))
            if done:
                try:
                    await plane.delete_calls(done)
                except DataPlaneError as exc:
                    log.warning("could not delete %d row(s) of finalized rollouts: %s", len(done), exc)


def _report_failure(task: asyncio.Task[None]) -> None:
    """Without the follower rows are only let go over the budget: say so loudly."""
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "following finalized rollouts stopped; held rows now go only over the budget",
            exc_info=task.exception(),
        )
