"""A worker keeps what a rollout in flight needs until the rollout is finalized.

Its staged rows (``RetainedRows``) and its chain-cache links are let go as
``tokentrail.finalized`` reports each rollout done (read from the topic's end, outside
any consumer group): without that, both grow with every rollout served until their
byte bounds, hours into a run. A data plane that re-attaches to a new owner gets every
held row staged again. A finalized rollout's rows are deleted once more by the worker:
a copy staged again, or written late, after the finalizer's own delete would otherwise
stay.
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
from stages.capture.core import CaptureCore
from stages.ports import DataPlane, DataPlaneError
from topics.codec import HEADER_TYPE
from topics.events import EventType

log = logging.getLogger(__name__)

POLL_MS = 500


@contextlib.asynccontextmanager
async def retaining(core: CaptureCore, plane: DataPlane, kafka: KafkaConfig) -> AsyncIterator[None]:
    """While the block runs: let go of finalized rollouts, re-stage held rows on re-attach."""
    if core.writer.retained is not None and isinstance(plane, ReattachingDataPlane):
        plane.on_reattach(core.writer.restage)
    start = await topic_ends(kafka, kafka.names.finalized)
    task = asyncio.create_task(release_finalized(kafka, start, core, plane), name="release-finalized")
    task.add_done_callback(_report_failure)
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def release_finalized(
    kafka: KafkaConfig, start: Mapping[TopicPartition, int], core: CaptureCore, plane: DataPlane
) -> None:
    """Follow the finalized topic from ``start``; let go of each finalized rollout."""
    wanted = (HEADER_TYPE, EventType.FINALIZED.value.encode())
    async with assigned_reader(kafka, start, fetch_max_wait_ms=POLL_MS) as consumer:
        while True:
            batch = await consumer.getmany(timeout_ms=POLL_MS)
            done: list[str] = []
            for records in batch.values():
                for record in records:
                    if record.key is not None and wanted in list(record.headers):
                        done += core.finalized(record.key.decode(errors="replace"))
            if done:
                try:
                    await plane.delete_calls(done)
                except DataPlaneError as exc:
                    log.warning("could not delete %d row(s) of finalized rollouts: %s", len(done), exc)


def _report_failure(task: asyncio.Task[None]) -> None:
    """Without the follower rows and links are only let go over their budgets: say so loudly."""
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "following finalized rollouts stopped; held rows and cached links now go only over their budgets",
            exc_info=task.exception(),
        )
