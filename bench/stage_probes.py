"""Probes around real stages, so that a benchmark can time them without changing them.

- ``Gated`` holds a stage's first batch until the benchmark opens the gate: every
  member joins its group and the groups settle before the clock starts, so group joins
  and rebalances are not timed as throughput. It also notes when partitions are revoked,
  which says when the groups have settled.
- ``FinalizedTap`` is the finalizer's sink: it publishes as usual and, once the broker
  acknowledged, notes each ``FinalizedEvent`` and when it was acknowledged.
- ``receipt_times`` reads when the ledger wrote each rollout's receipt, which splits
  seal-to-finalized latency into the ledger's decision and the finalizer's hop.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.reader import assigned_reader, topic_ends
from stages.ports import Consumed, EventSink, StageGauges, StagePort, TopicPartition
from stages.recent import RecentIds
from topics.codec import record_type
from topics.events import EventType
from topics.records import FinalizedEvent, Record


class Gated:
    """A ``StagePort`` that waits for ``gate`` before handling anything."""

    def __init__(self, inner: StagePort, gate: asyncio.Event, revocations: list[float]) -> None:
        self.inner = inner
        self.gate = gate
        self.revocations = revocations

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def answered(self) -> RecentIds:
        return self.inner.answered

    def gauges(self) -> StageGauges:
        return self.inner.gauges()

    async def handle(self, batch: Sequence[Consumed]) -> None:
        await self.gate.wait()
        await self.inner.handle(batch)

    async def tick(self, now: float) -> None:
        await self.inner.tick(now)

    def committable(self, positions: Mapping[TopicPartition, int]) -> Mapping[TopicPartition, int]:
        return self.inner.committable(positions)

    def on_revoked(self, partitions: Sequence[TopicPartition]) -> None:
        self.revocations.append(time.monotonic())
        self.inner.on_revoked(partitions)


@dataclass(frozen=True, slots=True)
class Finalized:
    """A finalized rollout as the tap saw it: the event and its acknowledgement time."""

    event: FinalizedEvent
    acked_at: float


class FinalizedTap:
    """An ``EventSink`` that forwards to ``inner`` and records acknowledged ``FinalizedEvent``s."""

    def __init__(self, inner: EventSink, seen: dict[str, Finalized]) -> None:
        self.inner = inner
        self.seen = seen

    async def publish(self, records: Sequence[Record]) -> None:
        await self.inner.publish(records)
        now = time.time()
        for record in records:
            if isinstance(record, FinalizedEvent):
                self.seen.setdefault(record.rollout_id, Finalized(record, now))


async def settled(started: Sequence[asyncio.Event], revocations: list[float], *, quiet_s: float) -> None:
    """Until every member has its first assignment, and then no partition moved for ``quiet_s``."""
    for event in started:
        await event.wait()
    ready = time.monotonic()
    while True:
        last = max(revocations, default=ready)
        last = max(last, ready)
        wait = last + quiet_s - time.monotonic()
        if wait <= 0:
            return
        await asyncio.sleep(wait)


async def receipt_times(kafka: KafkaConfig, timeout_s: float = 60.0) -> dict[str, float]:
    """Each rollout's first receipt on the committed topic and its log time (the ledger's
    clock when it sent it), read to the topic's current end without decoding payloads."""
    ends = await topic_ends(kafka, kafka.names.committed)
    receipt = EventType.RECEIPT.value.encode()
    written: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    async with assigned_reader(kafka, dict.fromkeys(ends), fetch_max_wait_ms=50) as consumer:
        unread = {tp for tp, end in ends.items() if end > 0}
        while unread:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{kafka.names.committed}: {len(unread)} partition(s) not read to their end"
                )
            for tp, records in (await consumer.getmany(*unread, timeout_ms=200)).items():
                for record in records:
                    if record.key is not None and record_type(record.headers) == receipt:
                        written.setdefault(record.key.decode(), record.timestamp / 1e3)
                if records and records[-1].offset + 1 >= ends[tp]:
                    unread.discard(tp)
    return written


__all__ = ["Finalized", "FinalizedTap", "Gated", "receipt_times", "settled"]
