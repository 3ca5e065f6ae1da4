"""How fast a consumer reads small record batches back from tansu, memory vs durable storage.

A worker publishes most events on their own (an admission per call, a seal per
rollout), so the log holds many batches of one record each. Both storage engines are
run side by side on the same records: ``--batches`` single-record batches spread over
4 partitions, then one consumer reads them all from the beginning.

    python -m bench.broker_storage --batches 300 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from bench.common import machine, versions
from pipeline.kafka.broker import EmbeddedBroker, StorageMode

TOPIC = "bench-small-batches"
PARTITIONS = 4
READ_LIMIT_S = 60.0


async def _measure(bootstrap: str, batches: int) -> dict[str, float]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    began = time.monotonic()
    try:
        for number in range(batches):  # one record per request: one batch each
            await producer.send_and_wait(
                TOPIC, b"x" * 300, key=b"r%d" % number, partition=number % PARTITIONS
            )
    finally:
        await producer.stop()
    produced_s = time.monotonic() - began
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None)
    await consumer.start()
    try:
        partitions = [TopicPartition(TOPIC, p) for p in range(PARTITIONS)]
        consumer.assign(partitions)
        await consumer.seek_to_beginning(*partitions)
        read, began = 0, time.monotonic()
        while read < batches and time.monotonic() - began < READ_LIMIT_S:
            fetched = await consumer.getmany(timeout_ms=200, max_records=500)
            read += sum(len(records) for records in fetched.values())
        read_s = time.monotonic() - began
    finally:
        await consumer.stop()
    return {"produced_per_s": batches / produced_s, "read": read, "read_per_s": read / read_s}


def run(batches: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for storage in ("memory", "durable"):
        mode: StorageMode = "durable" if storage == "durable" else "memory"
        with (
            tempfile.TemporaryDirectory() as data_dir,
            EmbeddedBroker(storage=mode, data_dir=data_dir if mode == "durable" else None) as broker,
        ):
            results[storage] = asyncio.run(_measure(broker.bootstrap, batches))
    ratio = results["memory"]["read_per_s"] / max(results["durable"]["read_per_s"], 1e-9)
    return {"batches": batches, "results": results, "read_ratio_memory_to_durable": ratio}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, default=300, help="single-record batches to write and read")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args()
    report = {"machine": machine(), "versions": versions(), **run(args.batches)}
    if args.json:
        print(json.dumps(report, indent=2))
        return
    for storage, numbers in report["results"].items():
        print(
            f"{storage:8s} produce {numbers['produced_per_s']:8.0f} batches/s   "
            f"read {numbers['read_per_s']:8.0f} records/s ({numbers['read']:.0f} read)"
        )
    print(f"read ratio memory/durable: {report['read_ratio_memory_to_durable']:.0f}x")


if __name__ == "__main__":
    main()
