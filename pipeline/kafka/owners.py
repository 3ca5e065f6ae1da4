"""The groups that own the finalizer's samples, read from the broker (``SampleOwners``).

A sample is its owner's once the owning group has committed past the sample's
``FinalizedEvent`` (DESIGN §7.4): the trainer feed commits only after ``ack``. The
finalized topic's ends are high watermarks (exact on every broker kind, see ``pipeline.kafka.lag``)
and a rollout's partition is the producer's own default partitioner over its key.
"""

from __future__ import annotations

from collections.abc import Sequence

from aiokafka import ConsumerRecord, TopicPartition

from pipeline.kafka.keys import partition_of
from pipeline.kafka.lag import LagReader
from pipeline.kafka.reader import assigned_reader
from stages.finalize.retain import OwnerProgress
from topics import codec
from topics.records import FinalizedEvent

FETCH_TIMEOUT_MS = 1000


class KafkaSampleOwners:
    """``SampleOwners`` on a ``LagReader``: the finalized topic's ends and the owners' commits."""

    def __init__(self, reader: LagReader, groups: Sequence[str]) -> None:
        if not groups:
            raise ValueError("groups: at least one owning consumer group is required")
        self.reader = reader
        self.groups = list(groups)
        names = reader.config.names
        self._partitions = list(range(names.partitions))
        self._topic = names.finalized

    def partition_of(self, rollout_id: str) -> int:
        return partition_of(rollout_id, len(self._partitions))

    async def progress(self) -> OwnerProgress:
        wanted = self._wanted()
        marks = await self.reader.watermarks(wanted)
        ends = {tp.partition: mark.highwater for tp, mark in marks.items()}
        return OwnerProgress(ends=ends, acknowledged=await self._acknowledged(wanted))

    async def unacknowledged(self) -> list[str]:
        """The sample keys of every accepted outcome some owner has not committed past, read
        from the finalized topic: what a finalizer starting afresh must keep copies of."""
        wanted = self._wanted()
        marks = await self.reader.watermarks(wanted)
        acknowledged = await self._acknowledged(wanted)
        starts = {tp: max(marks[tp].log_start, acknowledged.get(tp.partition, 0)) for tp in wanted}
        pending = {tp for tp in wanted if marks[tp].highwater > starts[tp]}
        keys: list[str] = []
        if not pending:
            return keys
        async with assigned_reader(
            self.reader.config, {tp: starts[tp] for tp in sorted(pending)}
        ) as consumer:
            while pending:
                fetched = await consumer.getmany(*pending, timeout_ms=FETCH_TIMEOUT_MS)
                for tp, records in fetched.items():
                    keys += _accepted_sample_keys(records)
                    if records and records[-1].offset + 1 >= marks[tp].highwater:
                        pending.discard(tp)
        return keys

    def _wanted(self) -> list[TopicPartition]:
        return [TopicPartition(self._topic, p) for p in self._partitions]

    async def _acknowledged(self, wanted: Sequence[TopicPartition]) -> dict[int, int]:
        """Per partition, the lowest offset every owner committed (absent: one never did)."""
        acknowledged: dict[int, int] = {}
        for index, group in enumerate(self.groups):
            committed = await self.reader.committed(group, wanted)
            for tp in wanted:
                offset = committed.get(tp)
                if offset is None:  # never committed: this owner has nothing yet
                    acknowledged.pop(tp.partition, None)
                elif index == 0:
                    acknowledged[tp.partition] = offset
                elif tp.partition in acknowledged:
                    acknowledged[tp.partition] = min(acknowledged[tp.partition], offset)
        return acknowledged


def _accepted_sample_keys(records: Sequence[ConsumerRecord[bytes, bytes]]) -> list[str]:
    keys: list[str] = []
    for record in records:
        try:
            payload = codec.decode(record.key, record.value, record.headers).payload
        except codec.DecodeError:
            continue  # not the finalizer's: nothing of it to keep
        if isinstance(payload, FinalizedEvent):
            keys += payload.sample_keys
    return keys
