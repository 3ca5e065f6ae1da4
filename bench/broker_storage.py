"""How fast a consumer reads small record batches back from tansu, memory vs durable storage.

A worker publishes most events on their own (an admission per call, a seal per
rollout), so the log holds many batches of one record each. Both storage engines are
run side by side on the same records: ``--batches`` admissions published one per batch
by the project's producer over 4 partitions, then one group-less reader reads them all
from the beginning. For durable storage the report adds the store server's CPU per
batch, written and read back: flat in ``--batches`` when listings cost nothing extra as
the log grows.

    tokentrail bench broker-storage --batches 300 --json

``--tail`` measures what a live consumer meets instead: ``--batches`` single-record
batches in one partition, then a reader placed ``TAIL_BATCHES`` before its end reads
them with the stages' fetch wait. tansu finds each batch it serves by listing the
partition from its first batch, within the fetch's wait, so the further the log, the
fewer batches a fetch returns, and past some length none (DESIGN §3).

    tokentrail bench broker-storage --tail --batches 3000 --json

``--expired`` (with ``--tail``) lets the durable store delete all but the last
``TAIL_BATCHES`` by retention before they are read: whether a partition as long but
mostly deleted reads like a short one (the listing is what grows; DESIGN §3).

    tokentrail bench broker-storage --tail --expired --batches 6000 --json

``--packed`` (with ``--tail``) lets the durable store pack all but the last ``TAIL_BATCHES``
before they are read: whether a partition as long but packed reads like a short one, with
every record kept (DESIGN §3).

    tokentrail bench broker-storage --tail --packed --batches 6000 --json
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition

from bench.command import Benchmark, Option, Quick
from bench.common import machine, process_cpu_s, versions
from bench.events import rollout_events
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.embedded.broker import BUCKET_DIR, EmbeddedBroker, StorageMode
from pipeline.kafka.embedded.objectstore import Upkeep
from pipeline.kafka.embedded.tansu import TANSU
from pipeline.kafka.lag import LagReader
from pipeline.kafka.producer import KafkaEventSink
from pipeline.kafka.reader import assigned_reader
from pipeline.kafka.retention import ROLES, TopicRetention
from topics.names import TopicNames

PARTITIONS = 4
READ_LIMIT_S = 60.0
TAIL_BATCHES = 300
TAIL_LIMIT_S = 30.0
EXPIRED_RETENTION_MS = 10_000
"""``--expired``: long enough for the tail to be read before it expires too."""
STORE_CHECK_S = 0.5
EXPIRY_LIMIT_S = 120.0
PACKED_OBJECTS = 10


@dataclass(frozen=True, slots=True)
class BrokerStorageConfig:
    batches: int = 300
    """Single-record batches written, then read."""
    tail: bool = False
    """Read the last ``TAIL_BATCHES`` of one partition, as a live consumer, instead of all from the start."""
    expired: bool = False
    """With ``tail``: the batches before the tail are past retention, deleted (durable storage) before it is read."""
    packed: bool = False
    """With ``tail``: the batches before the tail are packed (durable storage) before it is read."""

    def __post_init__(self) -> None:
        if self.expired and self.packed:
            raise ValueError("--expired and --packed: choose one")

    def upkeep(self) -> Upkeep | None:
        if self.expired:
            return Upkeep(retention_check_s=STORE_CHECK_S)
        return Upkeep(pack_every_s=STORE_CHECK_S, pack_after_s=0.0) if self.packed else None


QUICK = Quick("100 batches", BrokerStorageConfig(batches=100))
OPTIONS = (
    Option("--batches", "single-record batches to write and read (default 300)", int),
    Option(
        "--tail", f"read the last {TAIL_BATCHES} batches of one partition, as a live consumer", switch=True
    ),
    Option(
        "--expired",
        f"with --tail: the durable store deletes all but the last {TAIL_BATCHES} by retention before they are read",
        switch=True,
    ),
    Option(
        "--packed",
        f"with --tail: the durable store packs all but the last {TAIL_BATCHES} before they are read",
        switch=True,
    ),
)


async def _publish_one_per_batch(config: KafkaConfig, batches: int) -> None:
    """``batches`` admissions, one record per request: one batch each, as a worker writes them."""
    admissions = [rollout_events(f"r{number}", 1)[0] for number in range(batches)]
    async with KafkaEventSink(config, linger_ms=0) as sink:
        for admission in admissions:
            await sink.publish([admission])


async def _measure(bootstrap: str, batches: int, store_pid: int | None) -> dict[str, float]:
    config = KafkaConfig(
        bootstrap_servers=bootstrap, names=TopicNames(prefix="bench-small", partitions=PARTITIONS)
    )
    await ensure_topics(config)
    store_cpu_before = process_cpu_s(store_pid) if store_pid is not None else None
    began = time.monotonic()
    await _publish_one_per_batch(config, batches)
    produced_s = time.monotonic() - began
    async with LagReader(config) as lag:
        partitions = await lag.partitions([config.names.admission])
    async with assigned_reader(config, dict.fromkeys(partitions)) as consumer:
        read, began = 0, time.monotonic()
        while read < batches and time.monotonic() - began < READ_LIMIT_S:
            fetched = await consumer.getmany(timeout_ms=200, max_records=500)
            read += sum(len(records) for records in fetched.values())
        read_s = time.monotonic() - began
    numbers = {"produced_per_s": batches / produced_s, "read": read, "read_per_s": read / read_s}
    store_cpu_after = process_cpu_s(store_pid) if store_pid is not None else None
    if store_cpu_before is not None and store_cpu_after is not None:
        numbers["store_cpu_ms_per_batch"] = (store_cpu_after - store_cpu_before) * 1000 / batches
    return numbers


async def _measure_tail(broker: EmbeddedBroker, batches: int, store: BrokerStorageConfig) -> dict[str, float]:
    expired = store.expired
    store_pid = broker.bucket_pid
    retention = TopicRetention(**dict.fromkeys(ROLES, EXPIRED_RETENTION_MS)) if expired else TopicRetention()
    config = KafkaConfig(
        bootstrap_servers=broker.bootstrap,
        names=TopicNames(prefix="bench-tail", partitions=1),
        retention=retention,
    )
    await ensure_topics(config)
    tp = TopicPartition(config.names.admission, 0)
    start = max(0, batches - TAIL_BATCHES)
    await _publish_one_per_batch(config, start)
    numbers: dict[str, float] = {}
    if expired and store_pid is not None:
        numbers["log_start"] = await _expired_up_to(config, tp, start - 1)
    if store.packed and broker.data_dir is not None:
        numbers["objects_before_tail"] = await _packed_before(tp, start, broker.data_dir)
    await _publish_one_per_batch(config, batches - start)
    store_cpu_before = process_cpu_s(store_pid) if store_pid is not None else None
    async with assigned_reader(config, {tp: start}, fetch_max_wait_ms=TANSU.fetch_wait_ms) as consumer:
        read, began = 0, time.monotonic()
        while read < batches - start and time.monotonic() - began < TAIL_LIMIT_S:
            fetched = await consumer.getmany(timeout_ms=200)
            read += sum(len(records) for records in fetched.values())
        read_s = time.monotonic() - began
    numbers |= {"read": read, "of": batches - start, "read_per_s": read / read_s}
    store_cpu_after = process_cpu_s(store_pid) if store_pid is not None else None
    if store_cpu_before is not None and store_cpu_after is not None:
        numbers["store_cpu_ms_per_batch"] = (store_cpu_after - store_cpu_before) * 1000 / max(read, 1)
    return numbers


async def _expired_up_to(config: KafkaConfig, tp: TopicPartition, log_start: int) -> int:
    """Wait until the store has deleted the partition up to ``log_start``; the log start then."""
    began = time.monotonic()
    async with LagReader(config) as lag:
        while (marks := (await lag.watermarks([tp]))[tp]).log_start < log_start:
            if time.monotonic() - began > EXPIRY_LIMIT_S:
                raise RuntimeError(f"the store did not delete {tp.topic}[0] up to {log_start}: {marks}")
            await asyncio.sleep(STORE_CHECK_S)
    return marks.log_start


async def _packed_before(tp: TopicPartition, start: int, data_dir: Path) -> int:
    """Wait until the store has packed the batches before ``start`` into at most
    ``PACKED_OBJECTS``; how many objects they are then."""
    records = data_dir / BUCKET_DIR
    began = time.monotonic()
    while True:
        bases = [
            int(path.name.removesuffix(".batch"))
            for path in records.glob(
                f"*/clusters/*/topics/{tp.topic}/partitions/{tp.partition:010d}/records/*.batch"
            )
        ]
        before = sum(base < start for base in bases)
        if before <= PACKED_OBJECTS:
            return before
        if time.monotonic() - began > EXPIRY_LIMIT_S:
            raise RuntimeError(f"the store did not pack {tp.topic}[0] before {start}: {before} objects left")
        await asyncio.sleep(STORE_CHECK_S)


def run(config: BrokerStorageConfig = BrokerStorageConfig()) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for storage in ("memory", "durable"):
        mode: StorageMode = "durable" if storage == "durable" else "memory"
        with (
            tempfile.TemporaryDirectory() as data_dir,
            EmbeddedBroker(
                storage=mode,
                data_dir=data_dir if mode == "durable" else None,
                upkeep=config.upkeep(),
            ) as broker,
        ):
            if config.tail:
                measured = _measure_tail(broker, config.batches, config)
            else:
                measured = _measure(broker.bootstrap, config.batches, broker.bucket_pid)
            results[storage] = asyncio.run(measured)
    ratio = results["memory"]["read_per_s"] / max(results["durable"]["read_per_s"], 1e-9)
    return {
        "machine": machine(),
        "versions": versions(),
        "batches": config.batches,
        "tail": config.tail,
        "expired": config.expired,
        "packed": config.packed,
        "results": results,
        "read_ratio_memory_to_durable": ratio,
    }


def render(report: dict[str, Any]) -> str:
    lines = []
    for storage, numbers in report["results"].items():
        produced = (
            f"produce {numbers['produced_per_s']:8.0f} batches/s   " if "produced_per_s" in numbers else ""
        )
        store = (
            f"   store CPU {numbers['store_cpu_ms_per_batch']:.2f} ms/batch"
            if "store_cpu_ms_per_batch" in numbers
            else ""
        )
        start = f", log start {numbers['log_start']:.0f}" if "log_start" in numbers else ""
        if "objects_before_tail" in numbers:
            start += f", {numbers['objects_before_tail']:.0f} object(s) before it"
        lines.append(
            f"{storage:8s} {produced}read {numbers['read_per_s']:8.0f} records/s ({numbers['read']:.0f} read{start}){store}"
        )
    lines.append(f"read ratio memory/durable: {report['read_ratio_memory_to_durable']:.0f}x")
    return "\n".join(lines)


BENCHMARK = Benchmark("broker-storage", __doc__, BrokerStorageConfig(), QUICK, OPTIONS, run, render)

if __name__ == "__main__":
    sys.exit(BENCHMARK.main())
