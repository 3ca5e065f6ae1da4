"""Run a stage as a long-lived Kafka consumer: producer, consumer loop, graceful stop.

A stage is a ``StageHandler`` plus the topics it reads and its consumer group. The
runner owns the producer the stage publishes with (also the dead-letter sink) and
stops on request after the in-flight batch is handled and committed.

With ``metrics`` the runner meters the handler, exports the loop's counters, keeps
the group's lag gauge fresh and flips readiness; the caller serves the registry
(``MetricsServer``) and gives the stage ``metrics.sink(...)`` to publish with, so
that its outputs are counted too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import ConsumerLoop
from pipeline.kafka.tail import recent_keys
from pipeline.lag_gauge import DEFAULT_INTERVAL_S, poll_lag
from pipeline.metrics import StageMetrics
from stages.finalize.stage import FinalizerStage
from stages.ledger.stage import LedgerStage
from stages.ports import EventSink, StageHandler, TopicPartition
from topics.events import EventType
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


async def recall_answered(
    stage: LedgerStage | FinalizerStage, config: KafkaConfig, partitions: Iterable[int] | None = None
) -> int:
    """Seed the stage's memory of answered rollouts from the tail of its output topic
    (only the given partition numbers, if any), so that input replayed after a restart
    or a rebalance is not answered a second time; returns how many it recalled."""
    if isinstance(stage, LedgerStage):
        memory, topic, kind = stage.receipted, config.names.committed, EventType.RECEIPT
    else:
        memory, topic, kind = stage.finalized, config.names.finalized, EventType.FINALIZED
    keys = await recent_keys(config, topic, kind, per_partition=memory.capacity, partitions=partitions)
    memory.update(keys)
    log.info("stage %s recalled %d answered rollout(s) from %s", stage.name, len(keys), topic)
    return len(keys)


async def serve_stage(
    handler: StageHandler,
    config: KafkaConfig,
    sink: EventSink,
    *,
    stage: str,
    group: str,
    topics: list[str],
    stop: asyncio.Event,
    tuning: ConsumerTuning = ConsumerTuning(),
    started: asyncio.Event | None = None,
    metrics: StageMetrics | None = None,
    lag_interval_s: float = DEFAULT_INTERVAL_S,
) -> ConsumerLoop:
    """Consume until ``stop`` is set; returns the loop (its stats) once it has left the group.

    ``sink`` receives the dead letters of records that do not decode.
    """
    if lag_interval_s <= 0:
        raise ValueError(f"lag_interval_s: must be > 0, got {lag_interval_s}")

    async def recall(assigned: frozenset[TopicPartition]) -> None:
        if isinstance(handler, LedgerStage | FinalizerStage):
            await recall_answered(handler, config, {partition for _, partition in assigned})

    loop = ConsumerLoop(
        config,
        group_id=group,
        topics=topics,
        handler=handler if metrics is None else metrics.handler(handler),
        dead_letters=sink,
        stage=stage,
        max_records=tuning.max_records,
        idle_poll_ms=tuning.idle_poll_ms,
        session_timeout_ms=tuning.session_timeout_ms,
        heartbeat_interval_ms=tuning.heartbeat_interval_ms,
        on_assigned=recall,
    )

    async def stop_when_asked() -> None:
        await stop.wait()
        loop.request_stop()

    async def report_started() -> None:
        await loop.wait_assigned()
        if metrics is not None:
            metrics.health.set_ready(True)
        if started is not None:
            started.set()

    watchers = [asyncio.create_task(stop_when_asked()), asyncio.create_task(report_started())]
    if metrics is not None:
        metrics.watch_loop(group, loop.stats)
        lag = poll_lag(config, metrics, group=group, topics=topics, interval_s=lag_interval_s)
        watchers.append(asyncio.create_task(lag, name=f"lag-{stage}"))
    try:
        log.info("stage %s consuming %s as %s", stage, ", ".join(topics), group)
        await loop.run()
    finally:
        if metrics is not None:
            metrics.health.set_ready(False)
        for task in watchers:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return loop
