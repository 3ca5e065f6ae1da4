"""Committing offsets for a group that consumes nothing: a bookmark kept on the broker.

A process that publishes but reads the log only when it restarts (the gateway) still
needs to remember where its restart may begin. A group-less commit (generation -1, no
member) stores that as the group's committed offsets, where ``tokentrail lag`` and
``LagReader.committed`` read them like any stage's, and a restart on another machine
finds them without a file of its own.
"""

from __future__ import annotations

from collections.abc import Mapping

from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.kafka.config import KafkaConfig


async def commit_offsets(config: KafkaConfig, group: str, offsets: Mapping[TopicPartition, int]) -> None:
    """Store ``offsets`` as ``group``'s committed offsets (lower ones too: a bookmark may move back)."""
    if not offsets:
        return
    consumer = AIOKafkaConsumer(**config.client_kwargs(), group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign(list(offsets))
        await consumer.commit(dict(offsets))
    finally:
        await consumer.stop()


__all__ = ["commit_offsets"]
