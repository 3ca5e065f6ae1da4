"""A cluster mid-upgrade: the log holds what the schema-3 code wrote (admissions, staged
events, and the schema-3 ledger's call records and receipts); schema-4 stages take over
on the real broker and the real TransferQueue (DESIGN §4.6)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from schema3 import schema3_log, schema3_rows

from pipeline.dataplane.embedded import EmbeddedDataPlane
from pipeline.dataplane.transferqueue import TransferQueueDataPlane
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import FAST_GROUPS
from pipeline.kafka.producer import KafkaEventSink
from pipeline.replay.rebuild import compare, materialize, read_log, rebuild
from pipeline.replay.store import LedgerStore
from pipeline.stagehost.runner import serve_stage
from stages.ledger.stage import LedgerConfig
from stages.specs import FINALIZER, LEDGER, StageSettings
from topics.records import FinalizedEvent

pytestmark = [pytest.mark.broker, pytest.mark.dataplane]


async def write_schema3_log(config: KafkaConfig) -> None:
    """The records exactly as the schema-3 code encoded them, headers included."""
    names = config.names
    topics = {"admission": names.admission, "staged": names.staged, "committed": names.committed}
    producer = AIOKafkaProducer(**config.client_kwargs())
    await producer.start()
    try:
        for record in schema3_log():
            await producer.send_and_wait(
                topics[record.topic], record.value, key=record.key, headers=record.headers
            )
    finally:
        await producer.stop()


async def finalized(config: KafkaConfig) -> list[FinalizedEvent]:
    out: list[FinalizedEvent] = []
    async for events, _, _ in read_log(config, [config.names.finalized]):
        out += [e.event.payload for e in events if isinstance(e.event.payload, FinalizedEvent)]
    return out


def test_schema_4_stages_take_over_a_schema_3_log(kafka_config: KafkaConfig, tmp_path: Path) -> None:
    async def go() -> tuple[list[FinalizedEvent], list[str], int]:
        await ensure_topics(kafka_config)
        await write_schema3_log(kafka_config)
        with EmbeddedDataPlane.start() as server:
            async with (
                await TransferQueueDataPlane.attach(server.addresses, timeout_s=20.0) as plane,
                KafkaEventSink(kafka_config) as sink,
            ):
                await plane.put_calls(schema3_rows())
                settings = StageSettings(ledger=LedgerConfig(seal_grace_s=1.0))
                ledger = LEDGER.build(sink, settings=settings)
                finalizer = FINALIZER.build(sink, plane, settings)
                stop = asyncio.Event()
                tasks = [
                    asyncio.create_task(
                        serve_stage(stage, spec, kafka_config, sink, stop=stop, tuning=FAST_GROUPS)
                    )
                    for stage, spec in ((ledger, LEDGER), (finalizer, FINALIZER))
                ]
                deadline = time.monotonic() + 60
                while len(await finalized(kafka_config)) < 3 and time.monotonic() < deadline:  # noqa: ASYNC110 (the log, not an event)
                    await asyncio.sleep(0.5)
                stop.set()
                await asyncio.gather(*tasks)
        with (
            LedgerStore(tmp_path / "rebuilt.sqlite") as rebuilt,
            LedgerStore(tmp_path / "live.sqlite") as live,
        ):
            await rebuild(kafka_config, rebuilt, ledger=LedgerConfig(seal_grace_s=1.0))
            await materialize(kafka_config, live)
            differences = compare(rebuilt, live)
        return await finalized(kafka_config), differences, ledger.gauges().late or 0

    outcomes, differences, late = asyncio.run(go())
    assert sorted(f.status for f in outcomes) == ["accepted"] * 3
    assert differences == []  # a rebuild of the schema-3 log equals what the schema-3 ledger wrote
    assert late == 21  # it recalled the three receipted rollouts: all their 21 events are late
