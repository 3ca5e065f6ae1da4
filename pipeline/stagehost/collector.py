"""What a stage process exports from state it does not count itself, read at scrape time.

The lag reading (written by the lag poller), the stage's ``gauges()`` and the
consumer loop's counters already exist; a collector reads them when Prometheus
scrapes instead of mirroring every change into metric objects.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pipeline.kafka.consumer import LoopStats
from pipeline.kafka.lag import PartitionLag
from stages.ports import StagePort


class StateCollector(Collector):
    """State read at scrape time: the lag reading, the stage's and the loop's counters.

    Scrapes run on the server's thread while the stage mutates its state on the event
    loop; every read here is a single ``len()``, attribute or dict copy, which the
    interpreter performs atomically.
    """

    def __init__(self, stage: str) -> None:
        self.stage = stage
        self.stage_source: StagePort | None = None
        self.loop: tuple[str, LoopStats] | None = None
        self.lag: dict[str, tuple[tuple[PartitionLag, ...], float]] = {}
        self.lag_errors: dict[str, int] = {}

    def collect(self) -> Iterator[Metric]:
        yield from self._lag()
        yield from self._stage()
        yield from self._loop()

    def _lag(self) -> Iterator[Metric]:
        lag = GaugeMetricFamily(
            "tokentrail_consumer_lag",
            "Records not yet committed by the group: highwater - committed, per partition",
            labels=["group", "topic", "partition"],
        )
        updated = GaugeMetricFamily(
            "tokentrail_consumer_lag_updated_timestamp_seconds",
            "When the group's lag was last read (Unix time)",
            labels=["group"],
        )
        errors = CounterMetricFamily(
            "tokentrail_consumer_lag_errors", "Failed lag readings", labels=["group"]
        )
        for group, (rows, at) in sorted(self.lag.items()):
            updated.add_metric([group], at)
            for row in rows:
                lag.add_metric([row.group, row.topic, str(row.partition)], row.lag)
        for group, count in sorted(dict(self.lag_errors).items()):
            errors.add_metric([group], count)
        yield from (lag, updated, errors)

    def _stage(self) -> Iterator[Metric]:
        labels = ["stage"]
        open_rollouts = GaugeMetricFamily(
            "tokentrail_open_rollouts",
            "Rollouts the ledger holds open (admitted, not receipted)",
            labels=labels,
        )
        duplicates = CounterMetricFamily(
            "tokentrail_stage_duplicates",
            "Events ignored as already applied (replays, redeliveries)",
            labels=labels,
        )
        late = CounterMetricFamily(
            "tokentrail_ledger_late_events", "Events for rollouts already receipted", labels=labels
        )
        swept = CounterMetricFamily(
            "tokentrail_staging_rows_swept",
            "Staging rows the finalizer's janitor deleted: of finalized rollouts, or past the TTL",
            labels=[*labels, "why"],
        )
        retained = GaugeMetricFamily(
            "tokentrail_finalizer_samples_retained",
            "Copies of samples the finalizer keeps until their owners committed past them",
            labels=labels,
        )
        retained_bytes = GaugeMetricFamily(
            "tokentrail_finalizer_samples_retained_bytes", "Memory those copies take", labels=labels
        )
        retention = CounterMetricFamily(
            "tokentrail_finalizer_samples_retention",
            "Kept copies by what became of them: released (acknowledged), over_budget (let go unread), "
            "restored (put back into a restarted data plane)",
            labels=[*labels, "what"],
        )
        if self.stage_source is not None:
            gauges = self.stage_source.gauges()
            if gauges.retained is not None:
                retained.add_metric([self.stage], gauges.retained["held"])
                retained_bytes.add_metric([self.stage], gauges.retained["held_bytes"])
                for what in ("released", "over_budget", "restored"):
                    retention.add_metric([self.stage, what], gauges.retained[what])
            duplicates.add_metric([self.stage], gauges.duplicates)
            if gauges.open_rollouts is not None:
                open_rollouts.add_metric([self.stage], gauges.open_rollouts)
            if gauges.late is not None:
                late.add_metric([self.stage], gauges.late)
            for why, count in (gauges.swept or {}).items():
                swept.add_metric([self.stage, why], count)
        yield from (open_rollouts, duplicates, late, swept, retained, retained_bytes, retention)

    def _loop(self) -> Iterator[Metric]:
        labels = ["stage", "group"]
        rebalances = CounterMetricFamily(
            "tokentrail_consumer_rebalances", "Partition revocations seen by this member", labels=labels
        )
        commits = CounterMetricFamily(
            "tokentrail_consumer_commits", "Offset commits made by this member", labels=labels
        )
        passed = CounterMetricFamily(
            "tokentrail_consumer_passed",
            "Records of a type this stage does not read, passed by without decoding",
            labels=labels,
        )
        lost = CounterMetricFamily(
            "tokentrail_consumer_lost_records",
            "Records the log deleted (retention) before this member read them, per partition",
            labels=[*labels, "topic", "partition"],
        )
        if self.loop is not None:
            group, stats = self.loop
            rebalances.add_metric([self.stage, group], stats.rebalances)
            commits.add_metric([self.stage, group], stats.commits)
            passed.add_metric([self.stage, group], stats.passed)
            for (topic, partition), count in sorted(dict(stats.lost).items()):
                lost.add_metric([self.stage, group, topic, str(partition)], count)
        yield from (rebalances, commits, passed, lost)


class HeapCollector(Collector):
    """The interpreter's own heap, beside the process's resident memory.

    Resident memory alone cannot tell a leak from the allocator's high-water mark: a
    stage that held a burst of large fetches keeps those pages after it freed them.
    Objects that pile up show in the allocated blocks (one per allocation, whatever its
    size); resident memory that rises while the blocks stay flat is larger buffers or
    pages the allocator kept, not more of the stage's state (DESIGN §7.9). The collector's pending counts show what waits for a
    collection, which stages run rarely (``pipeline.process.heap``).
    """

    def collect(self) -> Iterator[Metric]:
        blocks = GaugeMetricFamily(
            "tokentrail_python_allocated_blocks",
            "Memory blocks the interpreter has allocated (objects and their buffers) and not freed",
        )
        blocks.add_metric([], sys.getallocatedblocks())
        pending = GaugeMetricFamily(
            "tokentrail_python_gc_pending",
            "The garbage collector's counts per generation: allocations (generation 0) or "
            "collections of the younger generation since the generation was last collected",
            labels=["generation"],
        )
        for generation, count in enumerate(gc.get_count()):
            pending.add_metric([str(generation)], count)
        yield from (blocks, pending)
