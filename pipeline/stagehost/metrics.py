"""Prometheus metrics of a long-lived stage process (DESIGN §7: the pipeline is watched
through consumer lag, throughput, latency and outcomes).

The stages know nothing of Prometheus, and should not: metering wraps their ports.
``StageMetrics.sink`` wraps the ``EventSink`` a stage publishes with, so every output
the broker acknowledged is counted by event type, outcomes by status and reason, and
latencies are taken from the records' own timestamps. ``StageMetrics.handler`` wraps
the ``StageHandler`` the consumer loop drives, so inputs and batches are counted and
every tick proves the loop still makes progress (the liveness probe). What only a
stage knows (open rollouts, duplicates) is read from its ``gauges()`` at scrape time.

Latency clocks. Every interval is the difference of two wall-clock (``time.time()``)
readings, usually taken on different hosts, so keep the hosts NTP-synchronised:

- admission → staged: ``CallRecord.staged_at`` (worker clock, when its background
  writer published) − ``admitted_at`` (driver clock, when it admitted the call);
- staged → committed: the ledger's clock when the broker acknowledged the
  ``CallRecord`` − ``staged_at``;
- seal → receipt: the ledger's clock when the receipt was acknowledged −
  ``sealed_at`` (driver clock; the ledger's own for a rollout it closed as never sealed);
- seal → finalized: ``FinalizedEvent.finalized_at`` (finalizer clock) − the receipt's
  ``sealed_at``.

A negative interval (clock skew) is observed as 0 and counted in
``tokentrail_latency_clock_skew_total``, so skew shows up instead of bending the
histograms. Each process has its own registry: several stages, or tests, in one
interpreter never collide.
"""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.gc_collector import GCCollector
from prometheus_client.process_collector import ProcessCollector

from pipeline.dataplane.timed import TimedDataPlane, timed
from pipeline.kafka.consumer import LoopStats
from pipeline.kafka.lag import PartitionLag
from pipeline.stagehost.collector import HeapCollector, StateCollector
from stages.ports import Consumed, DataPlane, EventSink, StageHandler, StagePort, TopicPartition
from topics.events import PAYLOAD_TYPES
from topics.records import CallRecord, DeadLetter, FailedCall, FinalizedEvent, Record, RolloutReceipt

LATENCY_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
"""Seconds; the top buckets cover seal grace periods and a stage catching up on lag."""
BATCH_BUCKETS: Final = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
"""Events per handled batch (the consumer's ``max_records`` is 500 by default)."""

_EVENT_TYPE: Final[dict[type[Record], str]] = {cls: kind.value for kind, cls in PAYLOAD_TYPES.items()}


class Health:
    """Liveness and readiness of a stage, as its probes see them.

    Live while the consumer loop ticked within ``stall_after_s`` (it ticks after every
    fetch, idle or not, so only a wedged handler or loop goes quiet); the process start
    counts as a tick, which gives a starting stage the same grace. Ready once the group
    gave this member its first assignment, until it starts to stop.
    """

    def __init__(self, stall_after_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        if stall_after_s <= 0:
            raise ValueError(f"stall_after_s: must be > 0, got {stall_after_s}")
        self.stall_after_s = stall_after_s
        self._clock = clock
        self._last_beat = clock()
        self._ready = False

    def beat(self) -> None:
        self._last_beat = self._clock()

    def set_ready(self, ready: bool) -> None:
        self._ready = ready

    @property
    def silent_for_s(self) -> float:
        return self._clock() - self._last_beat

    @property
    def live(self) -> bool:
        return self.silent_for_s <= self.stall_after_s

    @property
    def ready(self) -> bool:
        return self._ready and self.live


class StageMetrics:
    """Every metric of one stage process, in its own registry.

    Give the stage ``sink()`` to publish with (the consumer loop dead-letters through
    it too); ``serve_stage(..., metrics=...)`` meters the handler (``handler()``, which
    also exports the stage's ``gauges()``) and keeps the lag gauge fresh.
    """

    def __init__(self, stage: str, *, health: Health | None = None, process: bool = True) -> None:
        self.stage = stage
        self.health = health or Health()
        self.registry = CollectorRegistry()
        if process:  # memory and CPU of the process (DESIGN §9: memory stays bounded)
            ProcessCollector(registry=self.registry)
            GCCollector(registry=self.registry)
            self.registry.register(HeapCollector())
        self._state = StateCollector(stage)
        self.registry.register(self._state)
        self._sealed_at: dict[str, float] = {}
        reg = self.registry
        self.events_in = Counter(
            "tokentrail_stage_events_in_total",
            "Events handled by the stage, by event type (undecodable ones are dead letters instead)",
            ["stage", "event_type"],
            registry=reg,
        )
        self.events_out = Counter(
            "tokentrail_stage_events_out_total",
            "Events the stage published and the broker acknowledged, by event type",
            ["stage", "event_type"],
            registry=reg,
        )
        self.batch_events = Histogram(
            "tokentrail_stage_batch_events",
            "Events per batch handed to the stage",
            ["stage"],
            buckets=BATCH_BUCKETS,
            registry=reg,
        )
        self.handle_seconds = Histogram(
            "tokentrail_stage_handle_seconds",
            "Time to handle one batch, outputs acknowledged included",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self.dead_letters = Counter(
            "tokentrail_dead_letters_total",
            "Dead letters published, by the topic of the refused record",
            ["stage", "topic"],
            registry=reg,
        )
        self.receipts = Counter(
            "tokentrail_receipts_total", "Rollout receipts published", ["stage"], registry=reg
        )
        self.receipts_poisoned = Counter(
            "tokentrail_receipts_poisoned_total",
            "Receipts published as capture-poisoned, by failure code",
            ["stage", "reason"],
            registry=reg,
        )
        self.calls_failed = Counter(
            "tokentrail_calls_failed_total",
            "Calls the ledger published as failed, by failure code",
            ["stage", "reason"],
            registry=reg,
        )
        self.finalized = Counter(
            "tokentrail_rollouts_finalized_total",
            "Finalized events published, by status and rejection code (empty when accepted)",
            ["stage", "status", "reason"],
            registry=reg,
        )
        self.samples = Counter(
            "tokentrail_samples_finalized_total",
            "Samples (one per chain under a multi-sample policy) by policy, status and rejection code",
            ["stage", "policy", "status", "reason"],
            registry=reg,
        )
        self.skew = Counter(
            "tokentrail_latency_clock_skew_total",
            "Latency observations that came out negative (clocks out of sync) and were taken as 0",
            ["stage", "interval"],
            registry=reg,
        )
        self.dataplane_seconds = Histogram(
            "tokentrail_stage_dataplane_seconds",
            "Duration of the stage's data-plane calls, by operation and outcome",
            ["stage", "op", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=reg,
        )
        self._latency = {
            name: Histogram(
                f"tokentrail_{name}_seconds", doc, ["stage"], buckets=LATENCY_BUCKETS, registry=reg
            ).labels(stage)
            for name, doc in (
                ("admission_to_staged", "Call admitted (driver clock) to staged (worker clock)"),
                ("staged_to_committed", "Call staged (worker clock) to its CallRecord acknowledged"),
                ("seal_to_receipt", "Rollout sealed (driver clock) to its receipt acknowledged"),
                ("seal_to_finalized", "Rollout sealed (driver clock) to finalized (finalizer clock)"),
            )
        }

    # -- wiring ----------------------------------------------------------------

    def sink(self, inner: EventSink) -> MeteredSink:
        return MeteredSink(inner, self)

    def data_plane(self, inner: DataPlane) -> TimedDataPlane:
        """The data plane the stage uses, timed per call."""
        return timed(inner, self._observe_data_plane)

    def _observe_data_plane(self, op: str, outcome: str, seconds: float) -> None:
        self.dataplane_seconds.labels(self.stage, op, outcome).observe(seconds)

    def handler(self, stage: StagePort) -> MeteredHandler:
        """The metered handler; what only the stage knows (its gauges) is read at scrape time."""
        self._state.stage_source = stage
        return MeteredHandler(stage, self)

    def watch_loop(self, group: str, stats: LoopStats) -> None:
        """Export the consumer loop's rebalances and commits."""
        self._state.loop = (group, stats)

    def set_lag(self, group: str, rows: Sequence[PartitionLag], at: float) -> None:
        """Replace the group's lag reading (one atomic swap: a scrape sees all of it or none)."""
        self._state.lag = {**self._state.lag, group: (tuple(rows), at)}

    def lag_failed(self, group: str) -> None:
        self._state.lag_errors[group] = self._state.lag_errors.get(group, 0) + 1

    # -- observations ----------------------------------------------------------

    def consumed(self, batch: Sequence[Consumed]) -> None:
        """Note what the batch's outputs will be measured against: its receipts' seal times."""
        self._sealed_at = {
            item.event.payload.rollout_id: item.event.payload.sealed_at
            for item in batch
            if isinstance(item.event.payload, RolloutReceipt)
        }

    def handled(self, batch: Sequence[Consumed], seconds: float) -> None:
        kinds = Tally(item.event.event_type.value for item in batch)
        for kind, count in kinds.items():
            self.events_in.labels(self.stage, kind).inc(count)
        self.batch_events.labels(self.stage).observe(len(batch))
        self.handle_seconds.labels(self.stage).observe(seconds)

    def published(self, records: Iterable[Record], now: float) -> None:
        """Count acknowledged outputs and take the latencies their timestamps give."""
        kinds: Tally[str] = Tally()
        for record in records:
            kinds[_EVENT_TYPE.get(type(record), "other")] += 1
            if isinstance(record, CallRecord):
                self._observe("admission_to_staged", record.staged_at - record.admitted_at)
                self._observe("staged_to_committed", now - record.staged_at)
            elif isinstance(record, FailedCall):
                self.calls_failed.labels(self.stage, str(record.reason)).inc()
            elif isinstance(record, RolloutReceipt):
                self.receipts.labels(self.stage).inc()
                self._observe("seal_to_receipt", now - record.sealed_at)
                if record.capture_poisoned:
                    self.receipts_poisoned.labels(self.stage, str(record.failure_reason)).inc()
            elif isinstance(record, FinalizedEvent):
                self.finalized.labels(self.stage, record.status, str(record.rejection_reason or "")).inc()
                self._count_samples(record)
                sealed_at = self._sealed_at.get(record.rollout_id)
                if sealed_at is not None:
                    self._observe("seal_to_finalized", record.finalized_at - sealed_at)
            elif isinstance(record, DeadLetter):
                self.dead_letters.labels(self.stage, record.source_topic).inc()
        for kind, count in kinds.items():
            self.events_out.labels(self.stage, kind).inc(count)

    def _count_samples(self, event: FinalizedEvent) -> None:
        # Under the terminal policy the rollout is its one sample.
        outcomes = [(o.status, o.rejection_reason) for o in event.samples] or [
            (event.status, event.rejection_reason)
        ]
        for status, reason in outcomes:
            self.samples.labels(self.stage, event.sample_policy, status, str(reason or "")).inc()

    def _observe(self, interval: str, seconds: float) -> None:
        if seconds < 0:
            self.skew.labels(self.stage, interval).inc()
            seconds = 0.0
        self._latency[interval].observe(seconds)


class MeteredSink:
    """An ``EventSink`` that counts what the broker acknowledged (never what failed)."""

    def __init__(
        self, inner: EventSink, metrics: StageMetrics, clock: Callable[[], float] = time.time
    ) -> None:
        self.inner = inner
        self.metrics = metrics
        self._clock = clock

    async def publish(self, records: Sequence[Record]) -> None:
        await self.inner.publish(records)
        self.metrics.published(records, self._clock())


class MeteredHandler:
    """A ``StageHandler`` that counts batches and beats the liveness clock, then delegates."""

    def __init__(self, inner: StageHandler, metrics: StageMetrics) -> None:
        self.inner = inner
        self.metrics = metrics

    async def handle(self, batch: Sequence[Consumed]) -> None:
        self.metrics.consumed(batch)
        start = time.perf_counter()
        await self.inner.handle(batch)
        self.metrics.handled(batch, time.perf_counter() - start)
        self.metrics.health.beat()

    async def tick(self, now: float) -> None:
        await self.inner.tick(now)
        self.metrics.health.beat()

    def committable(self, positions: Mapping[TopicPartition, int]) -> Mapping[TopicPartition, int]:
        return self.inner.committable(positions)

    def on_revoked(self, partitions: Sequence[TopicPartition]) -> None:
        self.inner.on_revoked(partitions)
