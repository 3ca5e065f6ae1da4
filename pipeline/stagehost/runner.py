"""Run a stage as a long-lived Kafka consumer: consumer loop, recall, graceful stop.

A stage is a ``StagePort`` plus its ``StageSpec`` (the topics it reads and writes and
its consumer group). The caller owns the producer the stage publishes with (also the
dead-letter sink); the runner stops on request after the in-flight batch is handled
and committed.

With ``metrics`` the runner meters the handler, exports the loop's counters, keeps
the group's lag gauge fresh and flips readiness; the caller serves the registry
(``MetricsServer``) and gives the stage ``metrics.sink(...)`` to publish with, so
that its outputs are counted too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import DEFAULT_TUNING, ConsumerLoop, ConsumerTuning
from pipeline.stagehost.lag import DEFAULT_INTERVAL_S, poll_lag
from pipeline.stagehost.metrics import StageMetrics
from pipeline.stagehost.recall import recall_answered
from stages.ports import EventSink, StagePort, TopicPartition
from stages.specs import StageSpec

log = logging.getLogger(__name__)


async def serve_stage(
    stage: StagePort,
    spec: StageSpec,
    config: KafkaConfig,
    sink: EventSink,
    *,
    stop: asyncio.Event,
    group: str | None = None,
    tuning: ConsumerTuning = DEFAULT_TUNING,
    instance_id: str | None = None,
    started: asyncio.Event | None = None,
    metrics: StageMetrics | None = None,
    lag_interval_s: float = DEFAULT_INTERVAL_S,
) -> ConsumerLoop:
    """Consume ``spec``'s inputs as ``group`` (default: the spec's) until ``stop`` is set;
    returns the loop (its stats) once it has left the group.

    ``sink`` receives the dead letters of records that do not decode; ``instance_id``
    makes the member static where the broker supports it (``ConsumerLoop``).
    """
    if lag_interval_s <= 0:
        raise ValueError(f"lag_interval_s: must be > 0, got {lag_interval_s}")
    group = group or spec.group
    topics = spec.inputs(config.names)

    async def recall(assigned: frozenset[TopicPartition]) -> None:
        await recall_answered(stage, spec, config, {partition for _, partition in assigned})

    loop = ConsumerLoop(
        config,
        group_id=group,
        topics=topics,
        handler=stage if metrics is None else metrics.handler(stage),
        dead_letters=sink,
        stage=spec.name,
        tuning=tuning,
        log_time_order=spec.log_time_order(config.names) if spec.log_time_order else None,
        on_assigned=recall,
        reads=spec.reads,
        instance_id=instance_id,
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
        watchers.append(asyncio.create_task(lag, name=f"lag-{spec.name}"))
    try:
        log.info("stage %s consuming %s as %s", spec.name, ", ".join(topics), group)
        await loop.run()
    finally:
        if metrics is not None:
            metrics.health.set_ready(False)
        for task in watchers:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return loop
