"""Topic retention on the real (embedded tansu) broker (DESIGN §7.6): every topic is
created with its retention and reads it back; an existing topic's other retention is
reported, not altered; and what tansu does with retention, measured (DESIGN §3).

tansu itself deletes nothing (DeleteRecords is not implemented), so the memory engine
keeps every record; the durable store deletes what retention says, and the lost
ranges that makes are tested in ``test_embedded_retention.py``."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace

import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, RecordsToDelete
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaConnectionError

from pipeline.kafka.admin import ensure_topics
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.embedded.broker import EmbeddedBroker
from pipeline.kafka.lag import LagReader
from pipeline.kafka.retention import DEFAULT_RETENTION, FOREVER, ROLES, TopicRetention

pytestmark = pytest.mark.broker

DAY_MS = 86_400_000


async def topic_settings(config: KafkaConfig) -> dict[str, dict[str, str]]:
    """Every topic's configs as the broker describes them."""
    admin = AIOKafkaAdminClient(**config.client_kwargs())
    await admin.start()
    try:
        answers = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, topic) for topic in config.names.all()]
        )
    finally:
        await admin.close()
    return {
        topic: {entry[0]: entry[1] for entry in entries}
        for answer in answers
        for error_code, _, _, topic, entries in answer.resources
        if error_code == 0
    }


@pytest.mark.anyio
async def test_every_topic_is_created_with_its_retention(kafka_config: KafkaConfig) -> None:
    retention = DEFAULT_RETENTION.with_values([("admission", 5 * DAY_MS), ("deadletter", FOREVER)])
    config = replace(kafka_config, retention=retention)
    assert sorted(await ensure_topics(config)) == sorted(config.names.all())
    settings = await topic_settings(config)
    names = config.names
    assert set(settings) == set(names.all())
    for topic in names.all():
        assert settings[topic]["cleanup.policy"] == "delete"
        assert settings[topic]["retention.bytes"] == "-1"
        assert settings[topic]["message.timestamp.type"] == "LogAppendTime"
    assert settings[names.admission]["retention.ms"] == str(5 * DAY_MS)
    assert settings[names.staged]["retention.ms"] == str(3 * DAY_MS)
    assert settings[names.committed]["retention.ms"] == str(3 * DAY_MS)
    assert settings[names.finalized]["retention.ms"] == str(7 * DAY_MS)
    assert settings[names.deadletter]["retention.ms"] == "-1"


@pytest.mark.anyio
async def test_an_existing_topics_other_retention_is_reported_not_altered(
    kafka_config: KafkaConfig, caplog: pytest.LogCaptureFixture
) -> None:
    await ensure_topics(kafka_config)
    with caplog.at_level(logging.WARNING, "pipeline.kafka.admin"):
        assert await ensure_topics(kafka_config) == []
    assert caplog.records == []  # as asked: nothing to say
    longer = replace(kafka_config, retention=DEFAULT_RETENTION.with_values([("staged", 10 * DAY_MS)]))
    with caplog.at_level(logging.WARNING, "pipeline.kafka.admin"):
        assert await ensure_topics(longer) == []
    (record,) = caplog.records
    message = record.getMessage()
    assert f"topic {kafka_config.names.staged} exists with another retention than asked" in message
    assert "retention.ms: found 3d, asked 10d" in message
    assert "not altered" in message
    settings = await topic_settings(kafka_config)
    assert settings[kafka_config.names.staged]["retention.ms"] == str(3 * DAY_MS)


def test_tansu_accepts_retention_but_keeps_every_record_and_cannot_delete_records() -> None:
    """The measured fact of DESIGN §3: a topic kept 1 ms, records stamped long ago, and the
    log start never moves; DeleteRecords is refused (tansu's storage has no such operation:
    the connection is dropped). Its own broker: the refusal panics a broker thread."""

    async def go(config: KafkaConfig) -> tuple[int, int, bool]:
        await ensure_topics(config)
        producer = AIOKafkaProducer(**config.client_kwargs())
        await producer.start()
        try:
            for _ in range(5):
                await producer.send_and_wait(
                    config.names.admission, b"v", key=b"r", partition=0, timestamp_ms=1000
                )
        finally:
            await producer.stop()
        tp = TopicPartition(config.names.admission, 0)
        await asyncio.sleep(2.0)  # far past a 1 ms retention (measured: still there after 6 minutes)
        deleted = True
        admin = AIOKafkaAdminClient(**config.client_kwargs())
        await admin.start()
        try:
            await admin.delete_records({tp: RecordsToDelete(before_offset=3)}, timeout_ms=5000)
        except KafkaConnectionError:
            deleted = False
        finally:
            await admin.close()
        async with LagReader(config) as reader:
            marks = (await reader.watermarks([tp]))[tp]
        return marks.log_start, marks.highwater, deleted

    with EmbeddedBroker(storage="memory") as broker:
        config = replace(broker.kafka_config(), retention=TopicRetention(**dict.fromkeys(ROLES, 1)))
        assert asyncio.run(go(config)) == (0, 5, False)
