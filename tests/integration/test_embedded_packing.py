"""Packing, on the durable embedded broker (DESIGN §3): old batches become few objects, and
every record is read back as it was written, from the log start, from inside a pack, and by
a consumer group whose commit a pack now covers."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.commits import commit_offsets
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.embedded.broker import BUCKET_DIR, EmbeddedBroker
from pipeline.kafka.embedded.objectstore import Upkeep
from pipeline.kafka.reader import assigned_reader
from topics.codec import decode, encode_record
from topics.names import TopicNames
from topics.records import CaptureAdmission

pytestmark = [pytest.mark.broker, pytest.mark.anyio]

WRITTEN, COMMITTED = 120, 90
"""Batches written, one record each, and an offset inside the pack they become."""


@pytest.fixture(scope="module")
def packing_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    """Packing at once, every 0.2 s: what waits ``PACK_AFTER_S`` in a run."""
    data_dir = tmp_path_factory.mktemp("packing")
    with EmbeddedBroker(
        storage="durable", data_dir=data_dir, upkeep=Upkeep(pack_every_s=0.2, pack_after_s=0.0)
    ) as broker:
        yield broker


@pytest.fixture
def config(packing_broker: EmbeddedBroker) -> KafkaConfig:
    names = TopicNames(prefix=f"p{uuid.uuid4().hex[:10]}", partitions=2)
    return packing_broker.kafka_config(names, client_id="tokentrail-test")


def admission(index: int) -> CaptureAdmission:
    return CaptureAdmission(
        rollout_id=f"r{index}", call_id=f"c{index:05d}", prev_len=0, mode="text", admitted_at=float(index)
    )


async def publish_one_per_batch(config: KafkaConfig, partition: int, count: int) -> None:
    """``count`` admissions to one partition, each sent alone: one batch each, as a worker writes."""
    producer = AIOKafkaProducer(**config.client_kwargs(), linger_ms=0)
    await producer.start()
    try:
        for index in range(count):
            key, value, headers = encode_record(admission(index))
            await producer.send_and_wait(
                config.names.admission, value, key=key, partition=partition, headers=headers
            )
    finally:
        await producer.stop()


def stored_batches(broker: EmbeddedBroker, tp: TopicPartition) -> list[Path]:
    assert broker.data_dir is not None
    folders = (broker.data_dir / BUCKET_DIR).glob(
        f"*/clusters/*/topics/{tp.topic}/partitions/{tp.partition:010d}"
    )
    return sorted(path for folder in folders for path in (folder / "records").glob("*.batch"))


def first_offsets(broker: EmbeddedBroker, tp: TopicPartition) -> list[int]:
    return [int(path.stem) for path in stored_batches(broker, tp)]


async def packed(broker: EmbeddedBroker, tp: TopicPartition, below: int) -> list[int]:
    """Wait until the batches below ``below`` are one pack; the partition's first offsets then."""
    deadline = time.monotonic() + 20
    while True:
        offsets = first_offsets(broker, tp)
        if sum(base < below for base in offsets) <= 1:
            return offsets
        assert time.monotonic() < deadline, f"the store never packed below {below}: {offsets}"
        await asyncio.sleep(0.1)


async def read_from(config: KafkaConfig, tp: TopicPartition, offset: int | None) -> list[tuple[int, str]]:
    """Offsets and call ids from ``offset`` (None: the log start) to the end, outside any group."""
    read: list[tuple[int, str]] = []
    async with assigned_reader(config, {tp: offset}) as consumer:
        deadline = time.monotonic() + 20
        while not read or read[-1][0] < WRITTEN - 1:
            assert time.monotonic() < deadline, f"stopped at {read[-1:]}"
            for records in (await consumer.getmany(tp, timeout_ms=200)).values():
                read += [
                    (record.offset, call_id(record.key, record.value, record.headers)) for record in records
                ]
    return read


def call_id(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]]) -> str:
    payload = decode(key, value, headers).payload
    assert isinstance(payload, CaptureAdmission)
    return payload.call_id


async def first_fetch(
    config: KafkaConfig, tp: TopicPartition, *, group: str | None, seek: int | None = None
) -> list[int]:
    """The offsets one fetch of a plain aiokafka consumer returns: in ``group`` from its
    commit, or at ``seek``."""
    consumer = AIOKafkaConsumer(**config.client_kwargs(), group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([tp])
        if seek is not None:
            consumer.seek(tp, seek)
        return [record.offset for record in (await consumer.getmany(tp, timeout_ms=5000))[tp]]
    finally:
        await consumer.stop()


async def test_old_batches_become_one_pack_holding_every_record(
    config: KafkaConfig, packing_broker: EmbeddedBroker
) -> None:
    await ensure_topics(config)
    tp = TopicPartition(config.names.admission, 0)
    await publish_one_per_batch(config, 0, WRITTEN)
    assert await packed(packing_broker, tp, WRITTEN - 1) == [0, WRITTEN - 1]  # the newest stays
    written = [(offset, f"c{offset:05d}") for offset in range(WRITTEN)]
    assert await read_from(config, tp, None) == written
    assert await read_from(config, tp, COMMITTED) == written[COMMITTED:]  # from inside the pack
    # aiokafka's own consumer, outside the project's reader, reads it the same
    assert await first_fetch(config, tp, group=None, seek=COMMITTED) == list(range(COMMITTED, WRITTEN))


async def test_a_group_resumes_at_its_commit_inside_a_pack(
    config: KafkaConfig, packing_broker: EmbeddedBroker
) -> None:
    await ensure_topics(config)
    tp = TopicPartition(config.names.admission, 1)
    await publish_one_per_batch(config, 1, WRITTEN)
    await commit_offsets(config, "readers", {tp: COMMITTED})
    await packed(packing_broker, tp, WRITTEN - 1)
    assert await first_fetch(config, tp, group="readers") == list(range(COMMITTED, WRITTEN))
