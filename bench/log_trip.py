"""A record's trip into the log under load: what the ledger's log-time merge margin must cover.

The ledger releases an event only once every input partition is known to hold nothing
earlier, counting a caught-up partition as read to its last fetch less the merge margin
(DESIGN §7.2). On the embedded broker a record carries its producer's clock, so the margin
must cover the time from that timestamp until a fetch can return the record; a record
later than that can be ordered differently live than in a replay.

This runs the soak's cluster (``bench.cluster``: broker, data plane, ledger, finalizer,
the capture worker's driver and a sample owner) under ``--concurrency`` rollouts and
follows the ledger's input topics (admission, staged) from their ends, group-less, with
the stages' fetch wait. Per record: when it was first fetched less its timestamp, an
upper bound of its trip (it includes up to one fetch wait). Reported whole and per
minute (p50, p99, p99.9, max), beside the margin ``tokentrail run`` uses on that storage.

    tokentrail bench log-trip --minutes 5 --storage durable --json
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.cluster import Cluster, running
from bench.command import Benchmark, Option, Quick
from bench.common import machine, percentiles
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.embedded.tansu import TANSU
from pipeline.kafka.reader import assigned_reader, topic_ends
from pipeline.process.guard import guard_descendants

POINTS = (50, 99, 99.9, 100)


@dataclass(frozen=True, slots=True)
class LogTripConfig:
    minutes: float = 5.0
    storage: str = "durable"
    concurrency: int = 6
    """Rollouts the worker plays at once (the soak's default)."""

    def __post_init__(self) -> None:
        if self.minutes <= 0:
            raise ValueError(f"--minutes: must be > 0, got {self.minutes}")
        if self.storage not in ("memory", "durable"):
            raise ValueError(f"--storage: memory or durable, got {self.storage!r}")
        if self.concurrency < 1:
            raise ValueError(f"--concurrency: must be >= 1, got {self.concurrency}")


QUICK = Quick("half a minute", LogTripConfig(minutes=0.5))
OPTIONS = (
    Option("--minutes", "how long the load runs (default 5)", float),
    Option("--storage", "the broker's storage (default durable)", choices=("memory", "durable")),
    Option("--concurrency", "rollouts the worker plays at once (default 6)", int),
)


def run(config: LogTripConfig) -> dict[str, Any]:
    guard_descendants()  # the cluster's processes die with this one
    load_before = machine()
    with tempfile.TemporaryDirectory(prefix="log-trip-") as tmp:
        cluster = Cluster(
            Path(tmp), seed=7, storage=config.storage, concurrency=config.concurrency, sample_owner=True
        )
        with running(cluster):
            trips = asyncio.run(_follow(cluster.kafka, config.minutes * 60))
            margin_ms = cluster.broker.merge_margin_ms
    whole = _quantiles([trip for _, trip in trips])
    by_minute: dict[int, list[float]] = {}
    for at_s, trip in trips:
        by_minute.setdefault(int(at_s // 60), []).append(trip)
    return {
        "benchmark": "log-trip",
        "config": asdict(config),
        "records": len(trips),
        "trip_ms": whole,
        "by_minute": [
            {"minute": m, "records": len(t), **_quantiles(t)} for m, t in sorted(by_minute.items())
        ],
        "margin_ms": margin_ms,
        "within_margin": whole["max"] < margin_ms,
        "machine": {"before": load_before, "after": machine()},
    }


async def _follow(kafka: KafkaConfig, seconds: float) -> list[tuple[float, float]]:
    """``(seconds into the run, ms from timestamp to first fetch)`` of every record written to
    the ledger's inputs while following them for ``seconds``."""
    start = {**await topic_ends(kafka, kafka.names.admission), **await topic_ends(kafka, kafka.names.staged)}
    wait_ms = TANSU.fetch_wait_ms  # the stages' own on the embedded broker
    trips: list[tuple[float, float]] = []
    began = time.time()
    async with assigned_reader(kafka, start, fetch_max_wait_ms=wait_ms) as consumer:
        while (now := time.time()) - began < seconds:
            batch = await consumer.getmany(timeout_ms=wait_ms)
            fetched_ms = time.time() * 1000
            trips += [
                (now - began, fetched_ms - record.timestamp)
                for records in batch.values()
                for record in records
            ]
    return trips


def _quantiles(trips: list[float]) -> dict[str, float]:
    named = percentiles(trips, POINTS)
    return {("max" if point == 100 else f"p{point:g}"): round(named[f"p{point:g}"], 1) for point in POINTS}


def render(report: dict[str, Any]) -> str:
    config, trip = report["config"], report["trip_ms"]
    lines = [
        f"log trip, {config['storage']} broker, {config['concurrency']} rollouts at once, "
        f"{config['minutes']:g} min: {report['records']} records; ms from timestamp to first fetch "
        f"p50 {trip['p50']}, p99 {trip['p99']}, p99.9 {trip['p99.9']}, max {trip['max']} "
        f"(merge margin {report['margin_ms']} ms: {'covered' if report['within_margin'] else 'EXCEEDED'})",
        f"{'minute':>6} {'records':>8} {'p50':>7} {'p99':>7} {'p99.9':>7} {'max':>7}",
    ]
    lines += [
        f"{m['minute']:>6} {m['records']:>8} {m['p50']:>7} {m['p99']:>7} {m['p99.9']:>7} {m['max']:>7}"
        for m in report["by_minute"]
    ]
    return "\n".join(lines)


BENCHMARK = Benchmark("log-trip", __doc__, LogTripConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
