"""Follow ``tokentrail.finalized`` for the outcome of a known set of rollouts.

A run waits for its own rollouts only: the topic also carries the outcomes of earlier
runs on the same log (and, delivery being at-least-once, repeats of them), so events
are filtered by rollout id and the first outcome of each rollout counts. Reading
starts at the high watermarks taken before the run admitted anything, so nothing of
this run is missed and older history is not re-read. No consumer group: nothing is
committed, and the stages' lag is not disturbed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable, Mapping

from aiokafka import TopicPartition

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.reader import assigned_reader
from topics.codec import DecodeError, decode
from topics.records import FinalizedEvent

log = logging.getLogger(__name__)

POLL_MS = 200


class FinalizedWatcher:
    """Collects one ``FinalizedEvent`` per wanted rollout; ``stream()`` hands each on once."""

    def __init__(
        self,
        config: KafkaConfig,
        rollout_ids: Iterable[str],
        *,
        on_event: Callable[[FinalizedEvent], None] | None = None,
    ) -> None:
        self.config = config
        self.wanted = frozenset(rollout_ids)
        self.events: dict[str, FinalizedEvent] = {}
        self.repeats = 0
        self.undecodable = 0
        self.complete = asyncio.Event()
        self._on_event = on_event
        self._queue: asyncio.Queue[FinalizedEvent | None] = asyncio.Queue()
        if not self.wanted:
            self.complete.set()

    @property
    def accepted(self) -> list[FinalizedEvent]:
        return [event for event in self.events.values() if event.status == "accepted"]

    @property
    def rejected(self) -> Counter[str]:
        return Counter(
            str(event.rejection_reason) for event in self.events.values() if event.status == "rejected"
        )

    @property
    def missing(self) -> list[str]:
        return sorted(self.wanted - self.events.keys())

    async def follow(self, start: Mapping[TopicPartition, int]) -> None:
        """Read from ``start`` until every wanted rollout has its event (or until cancelled)."""
        try:
            async with assigned_reader(self.config, start, fetch_max_wait_ms=100) as consumer:
                while not self.complete.is_set():
                    batch = await consumer.getmany(timeout_ms=POLL_MS)
                    for records in batch.values():
                        for record in records:
                            self.offer(record.key, record.value, record.headers)
        finally:
            self.end()

    def offer(self, key: bytes | None, value: bytes | None, headers: Iterable[tuple[str, bytes]]) -> None:
        """One record of the finalized topic: kept if it is the first outcome of a wanted rollout."""
        try:
            event = decode(key, value, list(headers)).payload
        except DecodeError:
            self.undecodable += 1
            return
        if not isinstance(event, FinalizedEvent) or event.rollout_id not in self.wanted:
            return
        if event.rollout_id in self.events:
            self.repeats += 1
            return
        self.events[event.rollout_id] = event
        if self._on_event is not None:
            self._on_event(event)
        self._queue.put_nowait(event)
        if len(self.events) == len(self.wanted):
            self.complete.set()

    def end(self) -> None:
        """No more events: every ``stream()`` ends once it has handed on what is queued."""
        self._queue.put_nowait(None)

    async def stream(self) -> AsyncIterator[FinalizedEvent]:
        """The wanted events in arrival order; ends when following ends. Resumable: a new
        ``stream()`` continues where an abandoned one stopped."""
        while True:
            event = await self._queue.get()
            if event is None:
                self._queue.put_nowait(None)  # later streams end too
                return
            yield event
