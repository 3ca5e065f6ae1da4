"""Retention that deletes, on the durable embedded broker (DESIGN §7.6): the store deletes
batches older than their topic's retention, the log start moves, and every reader told
of it: ``tokentrail lag`` exits 4 naming the lost range, the consumer loop counts the
lost records, and a rebuild that needs them stops, naming the offsets. A data
directory's log stays bounded over rounds of records."""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from pipeline.commands import lag as lag_command
from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import CollectingHandler, ConsumerLoop, ConsumerTuning
from pipeline.kafka.embedded.broker import BUCKET_DIR, BrokerError, EmbeddedBroker
from pipeline.kafka.embedded.objectstore import Upkeep
from pipeline.kafka.lag import LagReader, Watermarks
from pipeline.kafka.producer import KafkaEventSink
from pipeline.kafka.retention import ROLES, TopicRetention
from pipeline.replay.rebuild import LogGone, read_log
from topics.names import TopicNames
from topics.records import CaptureAdmission

pytestmark = [pytest.mark.broker, pytest.mark.anyio]

RETENTION_MS = 1_500
OLD, FRESH, COMMITTED = 6, 2, 2
"""Batches published before retention passes, after it, and the group's commit among the old."""


@pytest.fixture(scope="module")
def durable_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedBroker]:
    data_dir = tmp_path_factory.mktemp("retention")
    with EmbeddedBroker(storage="durable", data_dir=data_dir, upkeep=Upkeep(retention_check_s=0.2)) as broker:
        yield broker


@pytest.fixture
def config(durable_broker: EmbeddedBroker) -> KafkaConfig:
    """One partition per topic, every topic kept ``RETENTION_MS``."""
    names = TopicNames(prefix=f"r{uuid.uuid4().hex[:10]}", partitions=1)
    kept = TopicRetention(**dict.fromkeys(ROLES, RETENTION_MS))
    return replace(durable_broker.kafka_config(names, client_id="tokentrail-test"), retention=kept)


def admission(index: int) -> CaptureAdmission:
    return CaptureAdmission(
        rollout_id=f"r{index}", call_id=f"c{index:05d}", prev_len=0, mode="text", admitted_at=float(index)
    )


async def publish_one_per_batch(config: KafkaConfig, first: int, count: int) -> None:
    async with KafkaEventSink(config, linger_ms=0) as sink:
        for index in range(first, first + count):
            await sink.publish([admission(index)])


async def commit(config: KafkaConfig, group: str, tp: TopicPartition, offset: int) -> None:
    consumer = AIOKafkaConsumer(**config.client_kwargs(), group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.commit({tp: OffsetAndMetadata(offset, "")})
    finally:
        await consumer.stop()


async def watermarks(config: KafkaConfig, tp: TopicPartition) -> Watermarks:
    async with LagReader(config) as reader:
        return (await reader.watermarks([tp]))[tp]


async def cut_log(config: KafkaConfig, group: str) -> tuple[TopicPartition, Watermarks]:
    """``OLD`` batches, a group committed at ``COMMITTED``, then ``FRESH`` batches once the
    old ones are past retention; returns the admission partition once the store deleted them."""
    await ensure_topics(config)
    tp = TopicPartition(config.names.admission, 0)
    await publish_one_per_batch(config, 0, OLD)
    await commit(config, group, tp, COMMITTED)
    await asyncio.sleep(RETENTION_MS / 1000 + 0.3)
    await publish_one_per_batch(config, OLD, FRESH)
    deadline = time.monotonic() + 15
    while (marks := await watermarks(config, tp)).log_start < OLD:
        assert time.monotonic() < deadline, f"the log start never passed the expired batches: {marks}"
        await asyncio.sleep(0.1)
    return tp, marks


def batch_offsets(broker: EmbeddedBroker, tp: TopicPartition) -> list[int]:
    """The first offset of every batch the store holds for ``tp``."""
    assert broker.data_dir is not None
    folders = (broker.data_dir / BUCKET_DIR).glob(
        f"*/clusters/*/topics/{tp.topic}/partitions/{tp.partition:010d}"
    )
    return sorted(int(path.stem) for folder in folders for path in (folder / "records").glob("*.batch"))


async def test_the_store_deletes_expired_batches_and_the_log_start_moves(
    config: KafkaConfig, durable_broker: EmbeddedBroker
) -> None:
    tp, marks = await cut_log(config, f"{config.names.prefix}-g")
    assert marks.highwater == OLD + FRESH
    assert OLD <= marks.log_start <= OLD + FRESH - 1  # the newest batch always stays
    assert batch_offsets(durable_broker, tp) == list(range(marks.log_start, OLD + FRESH))
    reader = AIOKafkaConsumer(**config.client_kwargs())  # ListOffsets(earliest), as the loop asks it
    await reader.start()
    try:
        assert (await reader.beginning_offsets([tp]))[tp] == marks.log_start
    finally:
        await reader.stop()
    more = 3
    await publish_one_per_batch(config, OLD + FRESH, more)  # a produce keeps the moved log start
    after = await watermarks(config, tp)
    assert after.highwater == OLD + FRESH + more and after.log_start >= marks.log_start


async def test_lag_exits_4_naming_the_lost_range(
    config: KafkaConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    group = f"{config.names.prefix}-g"
    tp, marks = await cut_log(config, group)
    parser = argparse.ArgumentParser()
    lag_command.add_parser(parser.add_subparsers())
    args = parser.parse_args(["lag", "--bootstrap", config.bootstrap, "--group", group])
    assert await asyncio.to_thread(args.run, args) == lag_command.EXIT_RECORDS_LOST
    err = capsys.readouterr().err
    assert f"group {group} lost {tp.topic}[0] offsets {COMMITTED} to {marks.log_start - 1}" in err


async def test_the_consumer_loop_counts_what_retention_deleted_before_it_read(
    config: KafkaConfig, fast_group: ConsumerTuning
) -> None:
    group = f"{config.names.prefix}-g"
    tp, marks = await cut_log(config, group)
    handled = CollectingHandler()
    async with KafkaEventSink(config) as sink:
        loop = ConsumerLoop(
            config,
            group_id=group,
            topics=[tp.topic],
            handler=handled,
            dead_letters=sink,
            stage="test",
            tuning=fast_group,
        )
        task = asyncio.create_task(loop.run())
        try:
            deadline = time.monotonic() + 20
            while len(handled.consumed) < marks.highwater - marks.log_start:
                assert time.monotonic() < deadline and not task.done(), (
                    "the loop did not read the kept records"
                )
                await asyncio.sleep(0.05)
        finally:
            loop.request_stop()
            await asyncio.wait_for(task, 20)
    assert loop.stats.lost == {(tp.topic, 0): marks.log_start - COMMITTED}
    assert [item.offset for item in handled.consumed] == list(range(marks.log_start, marks.highwater))


async def test_a_rebuild_stops_naming_the_deleted_offsets(config: KafkaConfig) -> None:
    tp, marks = await cut_log(config, f"{config.names.prefix}-g")
    with pytest.raises(LogGone, match=rf"{tp.topic}:0 offsets 0\.\.{marks.log_start - 1}"):
        async for _ in read_log(config, [tp.topic], complete=True):
            pass


async def test_a_data_directorys_log_stays_bounded_over_rounds(
    config: KafkaConfig, durable_broker: EmbeddedBroker
) -> None:
    """Round after round of records, each outliving its retention: what the store holds
    stays one round's worth while what was written grows."""
    await ensure_topics(config)
    tp = TopicPartition(config.names.admission, 0)
    per_round, rounds, held = 10, 4, []
    for number in range(rounds):
        await publish_one_per_batch(config, number * per_round, per_round)
        await asyncio.sleep(RETENTION_MS / 1000 + 0.5)
        held.append(len(batch_offsets(durable_broker, tp)))
    assert all(count <= per_round for count in held) and held[-1] < rounds * per_round, held
    assert batch_offsets(durable_broker, tp)[-1] == rounds * per_round - 1
    first_held = batch_offsets(durable_broker, tp)[0]
    deadline = time.monotonic() + 15  # tansu reads the moved log start again within seconds
    while (await watermarks(config, tp)).log_start != first_held:
        assert time.monotonic() < deadline, "the broker never reported the log start the store moved"
        await asyncio.sleep(0.2)


def test_the_check_interval_is_refused_unless_above_zero(tmp_path: Path) -> None:
    with pytest.raises(BrokerError, match="retention_check_s: 0 is not a number of seconds above 0"):
        EmbeddedBroker(storage="durable", data_dir=tmp_path, upkeep=Upkeep(retention_check_s=0))
