"""Reading the log outside any consumer group: the one way tools and stages re-read it.

Replay, the recall of answered rollouts, and a run following its outcomes each read
chosen partitions from chosen offsets; none of them commits, so no group's lag moves.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.kafka.config import KafkaConfig


@contextlib.asynccontextmanager
async def assigned_reader(
    config: KafkaConfig, start: Mapping[TopicPartition, int | None], **settings: Any
) -> AsyncIterator[AIOKafkaConsumer]:
    """A group-less consumer assigned ``start``'s partitions, each at its offset (``None``:
    the beginning of the log); ``settings`` go to aiokafka (``fetch_max_wait_ms``, ...)."""
    consumer = AIOKafkaConsumer(**config.client_kwargs(), **settings, enable_auto_commit=False, group_id=None)
    await consumer.start()
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
