"""Replay speed: events/s rebuilding the ledger from the beginning of the log.

For each size, an embedded tansu broker (memory engine) is filled with that many
ledger input events (admissions, staged events and seals of 8-call rollouts,
``bench.events``), then ``pipeline.replay.rebuild.rebuild`` reads them back and runs the
ledger stage's own logic into a SQLite ``LedgerStore``, exactly as ``tokentrail replay``
does, once for each ``--processes`` count (shards in processes of their own,
``pipeline.replay.parallel``), alternating ``--rounds`` times on the same topics. Only
the rebuild is timed: wall time, and the CPU time of the replay's processes (this one and
its shards; the broker apart), so events/s per core is events per CPU second.

To say where the time goes, the same events are also measured without the broker:
decoding alone (``topics.codec.decode``: orjson + pydantic validation) and the ledger
stage alone on already decoded events (in memory, outputs kept in a list).

    tokentrail bench replay [--quick] [--json] [--sizes 10000,100000,1000000] [--processes 1,2]
"""

from __future__ import annotations

import asyncio
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.command import Benchmark, Option, Quick, ints
from bench.common import machine, process_cpu_s, versions
from bench.events import rollout_events
from topics.records import Record

TARGET_EVENTS_PER_S = 50_000  # DESIGN §9


@dataclass(frozen=True, slots=True)
class ReplayConfig:
    sizes: tuple[int, ...] = (10_000, 100_000, 1_000_000)
    calls: int = 8
    partitions: int = 4
    sample: int = 50_000  # events for the broker-free measurements
    processes: tuple[int, ...] = (1, 2)
    rounds: int = 2  # each processes count, alternating, on the same topics


QUICK = Quick("10,000 events only", ReplayConfig(sizes=(10_000,), sample=10_000, rounds=1))
OPTIONS = (
    Option("--sizes", "events per replay (default 10000,100000,1000000)", ints),
    Option("--calls", "calls per rollout (default 8)", int),
    Option("--processes", "processes counts to compare (default 1,2)", ints),
    Option("--rounds", "rebuilds per processes count, alternating (default 2)", int),
)


def events(total: int, calls: int, *, chunk: int = 5_000, prefix: str = "r") -> Iterator[list[Record]]:
    """About ``total`` events in chunks of whole rollouts (``2 * calls + 1`` events each),
    the rollouts numbered after ``prefix``."""
    per_rollout = 2 * calls + 1
    rollouts = max(1, total // per_rollout)
    batch: list[Record] = []
    for number in range(rollouts):
        batch += rollout_events(f"{prefix}{number}", calls)
        if len(batch) >= chunk:
            yield batch
            batch = []
    if batch:
        yield batch


def decode_rate(sample: Sequence[Record]) -> float:
    """Events/s of the contract's decoder alone (bytes already in memory)."""
    from topics.codec import decode, encode_record

    encoded = [encode_record(event) for event in sample]
    start = time.perf_counter()
    for key, value, headers in encoded:
        decode(key, value, headers)
    return len(sample) / (time.perf_counter() - start)


async def ledger_rate(sample: Sequence[Record], batch: int = 500) -> float:
    """Events/s of the ledger stage's own logic on decoded events, outputs into a list."""
    from stages.ledger.stage import LedgerStage
    from stages.memory import RecordingSink
    from stages.ports import Consumed
    from topics.events import envelope

    items = [Consumed("in", 0, i, envelope(e)) for i, e in enumerate(sample)]
    stage = LedgerStage(RecordingSink())
    start = time.perf_counter()
    for i in range(0, len(items), batch):
        await stage.handle(items[i : i + batch])
        stage.committable({("in", 0): i + batch})
    return len(items) / (time.perf_counter() - start)


async def fill(
    broker: Any, size: int, config: ReplayConfig, tag: str, *, rollouts: str = "r"
) -> tuple[Any, int]:
    """Topics for one size (created if new), filled with ``size`` events of rollouts named
    after ``rollouts``; returns their Kafka config and the events published."""
    from pipeline.kafka.admin import ensure_topics
    from pipeline.kafka.producer import KafkaEventSink
    from topics.names import TopicNames

    kafka = broker.kafka_config(TopicNames(prefix=tag, partitions=config.partitions))
    await ensure_topics(kafka)
    published = 0
    async with KafkaEventSink(kafka, linger_ms=20) as sink:
        pending: set[asyncio.Task[None]] = set()
        for chunk in events(size, config.calls, prefix=rollouts):
            if len(pending) >= 4:
                _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            pending.add(asyncio.create_task(sink.publish(chunk)))
            published += len(chunk)
        for task in asyncio.as_completed(pending):
            await task
    return kafka, published


def replay_cpu_s() -> float:
    """CPU seconds of this process and of its children already waited for (the shards)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (process_cpu_s() or 0.0) + children.ru_utime + children.ru_stime


async def replay_once(kafka: Any, published: int, processes: int, broker_pid: int) -> dict[str, Any]:
    """One rebuild of filled topics in ``processes`` processes, timed."""
    from pipeline.replay.parallel import rebuild_parallel
    from pipeline.replay.store import LedgerStore

    with tempfile.TemporaryDirectory() as tmp, LedgerStore(Path(tmp) / "ledger.sqlite") as store:
        cpu, broker_cpu = replay_cpu_s(), process_cpu_s(broker_pid) or 0.0
        start = time.perf_counter()
        result = await rebuild_parallel(kafka, store, processes=processes)
        seconds = time.perf_counter() - start
        cpu_s, broker_cpu_s = replay_cpu_s() - cpu, (process_cpu_s(broker_pid) or 0.0) - broker_cpu
    if result.events != published or result.open_rollouts or result.stored.get("call_failed"):
        # Every generated call is staged in time: anything else is a wrong ledger, not a speed.
        raise RuntimeError(
            f"replayed {result.events} of {published} events into {result.stored}, "
            f"{result.open_rollouts} rollout(s) left open"
        )
    return {
        "events": result.events,
        "processes": processes,
        "seconds": round(seconds, 2),
        "events_per_s": round(result.events / seconds),
        "cpu_s": round(cpu_s, 2),
        "events_per_cpu_s": round(result.events / cpu_s),
        "broker_cpu_s": round(broker_cpu_s, 2),
        "stored": result.stored,
    }


async def replay_size(broker: Any, size: int, config: ReplayConfig) -> list[dict[str, Any]]:
    """Fill topics with ``size`` events, then rebuild them at every processes count."""
    kafka, published = await fill(broker, size, config, f"replay{size}")
    return [
        await replay_once(kafka, published, processes, broker.pid)
        for _ in range(config.rounds)
        for processes in config.processes
    ]


def summarize(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Best events/s; per processes count, at the largest size, the median events/s, events
    per CPU second, and the speed-up over one process."""
    largest = max(r["events"] for r in results)

    def median(processes: int, key: str) -> float:
        return float(
            statistics.median(
                r[key] for r in results if r["events"] == largest and r["processes"] == processes
            )
        )

    counts = sorted({r["processes"] for r in results})
    best = max(r["events_per_s"] for r in results)
    summary: dict[str, Any] = {
        "events_per_s": best,
        "target_events_per_s": TARGET_EVENTS_PER_S,
        "target_met": best >= TARGET_EVENTS_PER_S,
        "events_per_s_by_processes": {str(n): round(median(n, "events_per_s")) for n in counts},
        "events_per_cpu_s_by_processes": {str(n): round(median(n, "events_per_cpu_s")) for n in counts},
    }
    if 1 in counts:
        one = median(1, "events_per_s")
        summary["speedup_by_processes"] = {str(n): round(median(n, "events_per_s") / one, 2) for n in counts}
    return summary


async def run_async(config: ReplayConfig) -> dict[str, Any]:
    from pipeline.kafka.embedded.broker import EmbeddedBroker
    from pipeline.process.heap import collect_per_batch

    collect_per_batch()  # as ``tokentrail replay`` and its shards do
    started = time.perf_counter()
    load_before = machine()["load_average"]
    sample = [e for chunk in events(config.sample, config.calls) for e in chunk]
    parts = {
        "decode_events_per_s": round(decode_rate(sample)),
        "ledger_events_per_s": round(await ledger_rate(sample)),
    }
    broker = EmbeddedBroker(storage="memory")
    await asyncio.to_thread(broker.start)
    try:
        results = [result for size in config.sizes for result in await replay_size(broker, size, config)]
    finally:
        await asyncio.to_thread(broker.stop)
    return {
        "benchmark": "replay",
        "config": asdict(config),
        "machine": machine() | {"load_average_at_start": load_before},
        "versions": versions(),
        "without_broker": parts,
        "results": results,
        "summary": summarize(results),
        "seconds": round(time.perf_counter() - started, 1),
    }


def run(config: ReplayConfig | None = None) -> dict[str, Any]:
    """Run every size and return the report."""
    return asyncio.run(run_async(config or ReplayConfig()))


def render(report: dict[str, Any]) -> str:
    lines = [
        "| events | processes | seconds | events/s | events per CPU s | broker CPU s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["results"]:
        lines.append(
            f"| {r['events']:,} | {r['processes']} | {r['seconds']:.1f} | {r['events_per_s']:,} "
            f"| {r['events_per_cpu_s']:,} | {r['broker_cpu_s']:.1f} |"
        )
    parts = report["without_broker"]
    lines.append(
        f"without the broker: decode {parts['decode_events_per_s']:,} events/s, "
        f"ledger logic {parts['ledger_events_per_s']:,} events/s "
        f"(target {report['summary']['target_events_per_s']:,} events/s)"
    )
    return "\n".join(lines)


BENCHMARK = Benchmark("replay", __doc__, ReplayConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
