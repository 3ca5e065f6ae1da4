"""Run a stage as a long-lived Kafka consumer: producer, consumer loop, graceful stop.

A stage is a ``StageHandler`` plus the topics it reads and its consumer group. The
runner owns the producer the stage publishes with (also the dead-letter sink) and
stops on request after the in-flight batch is handled and committed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import ConsumerLoop
from pipeline.kafka.log import KafkaEventSink
from stages.ports import StageHandler
from topics.names import TopicNames

log = logging.getLogger(__name__)

LEDGER_GROUP = "tokentrail-ledger"
FINALIZER_GROUP = "tokentrail-finalizer"


@dataclass(frozen=True, slots=True)
class ConsumerTuning:
    """Group timings; tests and the single-machine run use short ones so joins are quick."""

    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    max_records: int = 500
    idle_poll_ms: int = 100


FAST_GROUPS = ConsumerTuning(session_timeout_ms=1_000, heartbeat_interval_ms=300)


def ledger_topics(names: TopicNames) -> list[str]:
    return [names.admission, names.staged]


def finalizer_topics(names: TopicNames) -> list[str]:
    return [names.committed]


async def serve_stage(
    handler: StageHandler,
    config: KafkaConfig,
    sink: KafkaEventSink,
    *,
    stage: str,
    group: str,
    topics: list[str],
    stop: asyncio.Event,
    tuning: ConsumerTuning = ConsumerTuning(),
    started: asyncio.Event | None = None,
) -> ConsumerLoop:
    """Consume until ``stop`` is set; returns the loop (its stats) once it has left the group."""
    loop = ConsumerLoop(
        config,
        group_id=group,
        topics=topics,
        handler=handler,
        dead_letters=sink,
        stage=stage,
        max_records=tuning.max_records,
        idle_poll_ms=tuning.idle_poll_ms,
        session_timeout_ms=tuning.session_timeout_ms,
        heartbeat_interval_ms=tuning.heartbeat_interval_ms,
    )

    async def stop_when_asked() -> None:
        await stop.wait()
        loop.request_stop()

    async def report_started() -> None:
        await loop.wait_assigned()
        if started is not None:
            started.set()

    watchers = [asyncio.create_task(stop_when_asked()), asyncio.create_task(report_started())]
    try:
        log.info("stage %s consuming %s as %s", stage, ", ".join(topics), group)
        await loop.run()
    finally:
        for task in watchers:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return loop
