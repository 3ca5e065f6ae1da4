"""Reading the log outside any consumer group: the one way tools and stages re-read it.

Replay, the recall of answered rollouts, and a run following its outcomes each read
chosen partitions from chosen offsets; none of them commits, so no group's lag moves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.lag import LagReader


@contextlib.asynccontextmanager
async def assigned_reader(
    config: KafkaConfig,
    start: Mapping[TopicPartition, int] | Mapping[TopicPartition, int | None],
    **settings: Any,
) -> AsyncIterator[AIOKafkaConsumer]:
    """A group-less consumer assigned ``start``'s partitions, each at its offset (``None``:
    the beginning of the log); ``settings`` go to aiokafka (``fetch_max_wait_ms``, ...)."""
    consumer = AIOKafkaConsumer(**config.client_kwargs(), **settings, enable_auto_commit=False, group_id=None)
    await consumer.start()
    # aiokafka's group-less coordinator cancels and awaits a task of its own at stop: one
    # that never ran raises CancelledError out of stop(), as when every partition is
    # seeked to its end and nothing is read. Let it run once.
    await asyncio.sleep(0)
    try:
        consumer.assign(list(start))
        for tp, offset in start.items():
            if offset is None:
                await consumer.seek_to_beginning(tp)
            else:
                consumer.seek(tp, offset)
        yield consumer
    finally:
        await consumer.stop()


async def topic_ends(config: KafkaConfig, topic: str) -> dict[TopicPartition, int]:
    """The high watermark of every partition of ``topic`` (exact on every broker kind): where to
    start reading to see only what is written from now on."""
    async with LagReader(config) as reader:
        partitions = await reader.partitions([topic])
        return {tp: marks.highwater for tp, marks in (await reader.watermarks(partitions)).items()}
