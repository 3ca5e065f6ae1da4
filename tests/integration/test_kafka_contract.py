"""The Kafka-contract path of ``pipeline.kafka`` against a broker that keeps Kafka's
contract (``contractbroker``): which broker a process is talking to, the idempotent
producer, static group members, and watermarks from ListOffsets."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import replace

import pytest
from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
from contractbroker import KAFKA_MIN_SESSION

from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import CollectingHandler, ConsumerLoop
from pipeline.kafka.embedded.tansu import TANSU
from pipeline.kafka.kind import broker_of
from pipeline.kafka.lag import LagReader, total_lag
from pipeline.kafka.producer import KafkaEventSink
from pipeline.kafka.profile import KAFKA
from topics.records import CaptureAdmission

pytestmark = [pytest.mark.kafka_contract, pytest.mark.anyio]

GROUP = KAFKA_MIN_SESSION


def admissions(count: int) -> list[CaptureAdmission]:
    return [
        CaptureAdmission(
            rollout_id=f"r{i % 16}", call_id=f"c{i:05d}", prev_len=0, mode="text", admitted_at=float(i)
        )
        for i in range(count)
    ]


def loop_for(
    config: KafkaConfig, sink: KafkaEventSink, handler: CollectingHandler, instance_id: str | None
) -> ConsumerLoop:
    return ConsumerLoop(
        config,
        group_id=f"{config.names.prefix}-g",
        topics=[config.names.admission],
        handler=handler,
        dead_letters=sink,
        stage="test",
        tuning=GROUP,
        instance_id=instance_id,
    )


@asynccontextmanager
async def running(loop: ConsumerLoop) -> AsyncIterator[None]:
    task = asyncio.create_task(loop.run())
    try:
        await asyncio.wait_for(loop.wait_assigned(), 20)
        yield
    finally:
        loop.request_stop()
        await asyncio.wait_for(task, 20)


async def test_an_attached_process_tells_the_embedded_broker_from_kafka(
    contract_config: KafkaConfig, kafka_config: KafkaConfig
) -> None:
    """``--broker-kind auto``: the cluster id says which profile a client takes."""
    asked_contract = await broker_of(replace(contract_config, broker=None))
    asked_embedded = await broker_of(replace(kafka_config, broker=None))
    assert (asked_contract, asked_embedded) == (KAFKA, TANSU)


async def test_the_producer_is_idempotent_where_the_broker_serves_it(contract_config: KafkaConfig) -> None:
    await ensure_topics(contract_config)
    records = admissions(64)
    async with KafkaEventSink(replace(contract_config, broker=None)) as sink:
        await sink.publish(records)
        producer = sink._require_producer()
        assert sink._require_broker() == KAFKA
        assert producer._txn_manager is not None and producer._txn_manager.producer_id >= 0
    async with LagReader(contract_config) as reader:
        marks = await reader.watermarks(await reader.partitions([contract_config.names.admission]))
    assert sum(mark.highwater for mark in marks.values()) == len(records)


async def test_static_members_split_the_partitions_and_see_every_record_once(
    contract_config: KafkaConfig,
) -> None:
    """Members with an instance id join as static members (``group.instance.id``) where
    the broker supports it, and the group works as a dynamic one does."""
    await ensure_topics(contract_config)
    records = admissions(40)
    first, second = CollectingHandler(), CollectingHandler()
    async with KafkaEventSink(contract_config) as sink:
        loop_a = loop_for(contract_config, sink, first, "member-a")
        loop_b = loop_for(contract_config, sink, second, "member-b")
        async with running(loop_a), running(loop_b):
            half = contract_config.names.partitions // 2
            await _until(lambda: len(loop_a.assignment) == len(loop_b.assignment) == half, "a split")
            assert not loop_a.assignment & loop_b.assignment
            await sink.publish(records)
            await _until(lambda: len(first.consumed) + len(second.consumed) >= len(records), "every record")
            await asyncio.sleep(0.3)  # a duplicate would show up now
    ids = sorted(item.event.event_id for item in [*first.consumed, *second.consumed])
    assert ids == sorted(f"adm/{r.rollout_id}/{r.call_id}" for r in records)
    assert first.consumed and second.consumed


async def test_watermarks_come_from_list_offsets_and_follow_deleted_records(
    contract_config: KafkaConfig,
) -> None:
    await ensure_topics(contract_config)
    records = admissions(48)
    tp = TopicPartition(contract_config.names.admission, 0)
    async with KafkaEventSink(contract_config, linger_ms=20) as sink:
        await asyncio.gather(*(sink.publish(records[i : i + 8]) for i in range(0, len(records), 8)))
    async with LagReader(contract_config) as reader:
        before = await reader.watermarks([tp])
        assert before[tp].log_start == 0 and before[tp].highwater > 2
        admin = AIOKafkaAdminClient(**contract_config.client_kwargs())
        await admin.start()
        try:
            await admin.delete_records({tp: RecordsToDelete(before_offset=2)})
        finally:
            await admin.close()
        after = await reader.watermarks([tp])
        rows = await reader.group_lag("nobody", [tp.topic])
    assert after[tp] == replace(before[tp], log_start=2)
    assert total_lag(rows) == len(records) - 2  # a group that never committed starts at the log start


async def _until(predicate: object, what: str, within: float = 20.0) -> None:
    assert callable(predicate)
    for _ in range(int(within / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
