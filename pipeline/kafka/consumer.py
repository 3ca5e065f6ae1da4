"""The consumer-group loop that drives a ``StageHandler`` (DESIGN §7).

Per batch: fetch, decode, dead-letter what does not decode, hand the rest to the
handler (which publishes and awaits its outputs), then commit what the handler says
is safe. That order makes delivery at-least-once; deterministic event ids make the
replays harmless. Auto-commit is off because only the handler knows which offsets
no open rollout still needs.

Handling and committing a batch hold a lock the rebalance callbacks take too: the
in-flight batch is handled and committed before partitions are given up, the
handler drops the state of revoked partitions, and every assigned partition is
sought to its committed offset (or the beginning), so a stateful stage replays
exactly what it needs to rebuild its state. A batch returned under an older
assignment than the current one is dropped unhandled (its records are fetched again
from the sought positions), so no record is handled twice by one member.

No position is ever reset silently (aiokafka's ``auto_offset_reset`` is ``none``): a
position below the log start, a commit the log deleted by retention, is a lost range,
logged as an error naming group, partition and offsets and counted (``LoopStats.lost``)
before the loop goes on from the log start (DESIGN §7.6). A broker that answers such a
fetch with the records after the gap (``BrokerProfile.fetch_out_of_range`` false) has
the gap counted the same way, from where the loop asked to where the records start.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.errors import (
    CommitFailedError,
    IllegalStateError,
    NoOffsetForPartitionError,
    OffsetOutOfRangeError,
)
from aiokafka.structs import ConsumerRecord

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.kind import broker_of
from pipeline.kafka.lag import LostRange, lost_range
from pipeline.kafka.logtime import LogTimeMerge
from pipeline.kafka.profile import BrokerProfile
from stages.ports import Consumed, EventSink, StageHandler
from stages.ports import TopicPartition as PortPartition
from topics.codec import DecodeError, RawRecord, dead_letter, decode, record_type
from topics.events import EventType
from topics.records import DeadLetter

log = logging.getLogger(__name__)

Record: TypeAlias = ConsumerRecord[bytes, bytes]


def _raw(record: Record) -> RawRecord:
    """The record's own bytes, not copied: a stage's hot loop builds one per record."""
    return RawRecord(record.topic, record.partition, record.offset, record.key, record.value, record.headers)


@dataclass(slots=True)
class LoopStats:
    """Counters a runner can export as metrics."""

    batches: int = 0
    consumed: int = 0
    dead_lettered: int = 0
    commits: int = 0
    rebalances: int = 0
    held: int = 0
    """Records fetched but waiting for the log-time merge (ordered loops)."""
    enforced: int = 0
    """Releases that went on without a partition that kept the others waiting too long."""
    passed: int = 0
    """Records of a type the stage does not read, passed by without decoding (``reads``)."""
    lost: dict[tuple[str, int], int] = field(default_factory=dict)
    """Records per (topic, partition) the log deleted before this member read them."""


@dataclass(frozen=True, slots=True)
class _Fetched:
    """A fetched record in the merge: where it lies, its log time, and the event
    (``None`` for a record already dead-lettered or passed by, which still holds its place)."""

    tp: TopicPartition
    offset: int
    timestamp: float
    item: Consumed | None


@dataclass(frozen=True, slots=True)
class ConsumerTuning:
    """Group timings and batch size. Takeover after a member dies takes about the session
    timeout plus a rejoin; tests and single-process runs use short ones so joins are quick
    (tansu holds a join for half the session timeout)."""

    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    max_records: int = 500
    fetch_wait_ms: int | None = None
    """How long the broker may hold a fetch that has nothing new; ``None``: the broker
    profile's (``BrokerProfile.fetch_wait_ms``). On the embedded broker every hop of an
    event through the stages can wait this long (it answers a fetch only once its wait is
    over), so it is latency there and idle polling elsewhere."""
    idle_poll_ms: int = 25
    ripe_poll_ms: int = 5
    """Log-time order: how often a loop holding a record whose margin has passed polls.
    A fetch response with no records moves a partition's bound (``idle_margin_ms``) but
    does not end a poll (aiokafka wakes it for records only), so at ``idle_poll_ms`` a
    held record could wait a whole poll more after the response that frees it."""
    idle_margin_ms: int = 500
    """Log-time order (``ordered`` loops): a caught-up partition counts as read up to
    its last fetch response minus this much, the longest a record may take from its
    producer's clock to the log without breaking the order (DESIGN §7.2)."""
    max_idle_ms: int = 5_000
    """Log-time order: a partition behind its end that returns nothing for this long (a
    broker recovering) stops holding the others back, as Kafka Streams'
    ``max.task.idle.ms``; the order may then differ from a replay's (counted: ``enforced``)."""


DEFAULT_TUNING = ConsumerTuning()
FAST_GROUPS = ConsumerTuning(session_timeout_ms=1_000, heartbeat_interval_ms=300)
"""Tests and short-lived tools."""


class ConsumerLoop:
    """Consume ``topics`` as member of ``group_id`` and feed ``handler`` until stopped.

    ``dead_letters`` receives a ``DeadLetter`` for every record that does not decode;
    it is usually the same ``KafkaEventSink`` the stage publishes its outputs with.
    ``request_stop()`` (safe from a signal handler) lets the in-flight batch finish
    and be committed before the consumer leaves the group. ``instance_id``, a name this
    member keeps across restarts, makes it a static member where the broker supports it
    (``BrokerProfile.static_membership``); a static member does not leave on stop, so
    its partitions wait for it (or for the session timeout) rather than rebalancing.
    """

    def __init__(
        self,
        config: KafkaConfig,
        *,
        group_id: str,
        topics: Sequence[str],
        handler: StageHandler,
        dead_letters: EventSink,
        stage: str,
        tuning: ConsumerTuning = DEFAULT_TUNING,
        log_time_order: Sequence[str] | None = None,
        max_poll_interval_ms: int = 300_000,
        on_assigned: Callable[[frozenset[PortPartition]], Awaitable[None]] | None = None,
        reads: Collection[EventType] | None = None,
        instance_id: str | None = None,
    ) -> None:
        if not topics:
            raise ValueError("topics: a consumer loop needs at least one topic")
        if not stage:
            raise ValueError("stage: a name is required (it is recorded in dead letters)")
        self.config = config
        self.group_id = group_id
        self.topics = tuple(topics)
        self.handler = handler
        self.dead_letters = dead_letters
        self.stage = stage
        self.max_records = tuning.max_records
        self.idle_poll_ms = tuning.idle_poll_ms
        self.ripe_poll_ms = tuning.ripe_poll_ms
        self._consumer_settings: dict[str, object] = {
            "group_id": group_id,
            "enable_auto_commit": False,
            # Never reset a position behind our back: ``_reposition`` decides, and says so.
            "auto_offset_reset": "none",
            "session_timeout_ms": tuning.session_timeout_ms,
            "heartbeat_interval_ms": tuning.heartbeat_interval_ms,
            "max_poll_interval_ms": max_poll_interval_ms,
            "isolation_level": "read_uncommitted",
            # Range assignment gives one member partition p of every topic it reads:
            # all topics share the key partitioner, so a rollout's events stay together.
            "partition_assignment_strategy": (RangePartitionAssignor,),
        }
        self._fetch_wait_ms = tuning.fetch_wait_ms
        self._instance_id = instance_id
        self.ordered = log_time_order is not None
        """Hand records over in log-time order across partitions (equal timestamps going
        to the topics of ``log_time_order`` in that order), holding each until every
        other partition has caught up with it."""
        self._idle_margin_s = tuning.idle_margin_ms / 1000
        self._passed_types = frozenset(
            kind.value.encode() for kind in EventType if reads is not None and kind not in reads
        )
        """Type headers of records the handler would ignore: such a record keeps its place
        but is never decoded (a stage validates what it reads; the type header of every
        other record is still checked, so an unknown or missing one is dead-lettered)."""
        self._on_assigned_hook = on_assigned
        """Runs once new partitions are assigned, before any of their records is handled."""
        self._consumer: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._assigned = asyncio.Event()
        self._positions: dict[TopicPartition, int] = {}
        self._read_up_to: dict[TopicPartition, float] = {}  # log time of the last record handled
        self._position: dict[TopicPartition, int] = {}  # the consumer's, of partitions with nothing held
        self._held: LogTimeMerge[_Fetched] = LogTimeMerge(log_time_order or ())
        self._frontier = -math.inf  # log time the ordered merge has provably reached
        self._max_idle_s = tuning.max_idle_ms / 1000
        # Since when each partition has had nothing held, yet records still to fetch.
        self._behind: dict[TopicPartition, float] = {}
        self._enforced: set[TopicPartition] = set()  # partitions the last release stopped waiting for
        self._committed: dict[TopicPartition, int] = {}
        self._fetch_from: dict[TopicPartition, int] = {}  # where the next fetched record should be
        self._gap_is_loss = False  # the broker answers a fetch below its log start with later records
        self._epoch = 0  # bumped by every revocation and assignment
        self.stats = LoopStats()

    # -- control ---------------------------------------------------------------

    def request_stop(self) -> None:
        """Ask the loop to finish its in-flight batch, commit, and leave the group."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def assignment(self) -> frozenset[TopicPartition]:
        consumer = self._consumer
        return frozenset(consumer.assignment()) if consumer is not None else frozenset()

    @property
    def committed(self) -> Mapping[TopicPartition, int]:
        """Offsets this member committed, per partition it owns."""
        return dict(self._committed)

    async def wait_assigned(self) -> None:
        """Wait until the group gave this member its first assignment (it may be empty)."""
        await self._assigned.wait()

    # -- the loop --------------------------------------------------------------

    async def run(self) -> None:
        """Consume until ``request_stop()``; a handler error propagates (nothing is committed)."""
        broker = await broker_of(self.config)
        self._gap_is_loss = not broker.fetch_out_of_range
        consumer = AIOKafkaConsumer(
            **self.config.client_kwargs(), **self._consumer_settings, **self._broker_settings(broker)
        )
        await consumer.start()
        self._consumer = consumer
        try:
            consumer.subscribe(list(self.topics), listener=_Rebalance(self))
            stop_wait = asyncio.ensure_future(self._stop.wait())
            try:
                while not self._stop.is_set():
                    fetch = asyncio.ensure_future(self._fetch(consumer))
                    await asyncio.wait({fetch, stop_wait}, return_when=asyncio.FIRST_COMPLETED)
                    if not fetch.done():
                        fetch.cancel()
                        with contextlib.suppress(asyncio.CancelledError):
                            await fetch
                        break
                    batch, epoch = fetch.result()
                    async with self._lock:
                        if epoch != self._epoch:
                            # The assignment changed after this batch was fetched: its
                            # partitions were revoked or sought back; drop it unhandled.
                            batch = {}
                        if batch:
                            await self._hold(batch)
                        await self._release(consumer)
                        await self._commit(consumer)
            finally:
                stop_wait.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stop_wait
        finally:
            self._consumer = None
            await consumer.stop()

    def _broker_settings(self, broker: BrokerProfile) -> dict[str, object]:
        """The consumer settings that depend on what the broker serves."""
        settings: dict[str, object] = {
            "fetch_max_wait_ms": self._fetch_wait_ms
            if self._fetch_wait_ms is not None
            else broker.fetch_wait_ms
        }
        if self._instance_id is not None and broker.static_membership:
            # A restart within the session timeout takes its partitions back, no rebalance.
            settings["group_instance_id"] = self._instance_id
        return settings

    def _log_time(self, consumer: AIOKafkaConsumer) -> float:
        """How far this member has read, in log time: the earliest, over its partitions, of
        the last record handled, where a partition still has unread records; the clock
        where every partition is read to its end (or its end is not known yet)."""
        behind = [
            self._read_up_to.get(tp, 0.0)
            for tp in consumer.assignment()
            if (end := consumer.highwater(tp)) is not None and self._positions.get(tp, 0) < end
        ]
        return min([time.time(), *behind])

    def _caught_up_to(self, consumer: AIOKafkaConsumer) -> Callable[[PortPartition], float]:
        """The log-time bound of a partition with nothing held: read to its end at the last
        fetch response, less the margin for records still on their way; ``-inf`` while it
        has records not fetched yet (or its end is unknown), unless it has kept the others
        waiting for ``max_idle_ms``: then ``+inf`` (see ``_behind``)."""
        now = time.monotonic()

        def bound(key: PortPartition) -> float:
            tp = TopicPartition(*key)
            end = consumer.highwater(tp)
            polled: int | None = consumer.last_poll_timestamp(tp)
            if end is not None and polled is not None and self._position.get(tp, -1) >= end:
                self._behind.pop(tp, None)
                return polled / 1000 - self._idle_margin_s
            since = self._behind.setdefault(tp, now)
            if now - since < self._max_idle_s:
                return -math.inf
            self._enforced.add(tp)
            return math.inf

        return bound

    async def _fetch(self, consumer: AIOKafkaConsumer) -> tuple[dict[TopicPartition, list[Record]], int]:
        """A batch, tagged with the assignment epoch current when it was returned."""
        try:
            batch = await consumer.getmany(timeout_ms=self._poll_ms(), max_records=self.max_records)
        except (OffsetOutOfRangeError, NoOffsetForPartitionError) as exc:
            async with self._lock:
                await self._reposition(consumer, exc)
            return {}, self._epoch
        return batch, self._epoch

    async def _reposition(
        self, consumer: AIOKafkaConsumer, error: OffsetOutOfRangeError | NoOffsetForPartitionError
    ) -> None:
        """Where aiokafka would have reset positions silently, start from the log start and
        say what that skips: a partition without a position (aiokafka's fetcher reached it
        before the assignment callback sought it) skips nothing; a position below the log
        start skips records the log deleted before this member read them, a lost range,
        logged as an error and counted; a position past the end (a log truncated under
        it) reads the partition again from its start, as Kafka's ``earliest`` reset does."""
        if isinstance(error, OffsetOutOfRangeError):
            offsets: dict[TopicPartition, int | None] = dict(error.args[0])
        else:
            offsets = dict.fromkeys(error.args)
        assigned = consumer.assignment()
        offsets = {tp: offset for tp, offset in offsets.items() if tp in assigned}
        if not offsets:
            return
        starts = await consumer.beginning_offsets(list(offsets))
        for tp, offset in offsets.items():
            start = starts[tp]
            consumer.seek(tp, start)
            self._fetch_from[tp] = start
            if offset is None:
                continue
            lost = lost_range(self.group_id, tp.topic, tp.partition, offset, start)
            if lost is None:
                log.warning(
                    "%s: offset %d of %s[%d] is past its end; group %s reads it again from the log start %d",
                    self.stage,
                    offset,
                    tp.topic,
                    tp.partition,
                    self.group_id,
                    start,
                )
                continue
            self._count_lost(tp, lost, start)
            if self._held.empty((tp.topic, tp.partition)):
                self._positions[tp] = start  # nothing before the gap waits: commits may pass it

    def _count_lost(self, tp: TopicPartition, lost: LostRange, start: int) -> None:
        log.error("%s: %s; going on from offset %d", self.stage, lost, start)
        key = (tp.topic, tp.partition)
        self.stats.lost[key] = self.stats.lost.get(key, 0) + lost.records

    def _check_gap(self, tp: TopicPartition, records: Sequence[Record]) -> None:
        """Where the broker answers a fetch below its log start with the records after it,
        a partition whose records start past where this member asked lost what lies between."""
        expected = self._fetch_from.get(tp)
        self._fetch_from[tp] = records[-1].offset + 1
        if not self._gap_is_loss or expected is None:
            return
        lost = lost_range(self.group_id, tp.topic, tp.partition, expected, records[0].offset)
        if lost is not None:
            self._count_lost(tp, lost, records[0].offset)

    def _poll_ms(self) -> float:
        """How long the next poll may wait for records: ``idle_poll_ms``, but in log-time
        order only until the earliest held record's margin has passed, and then
        ``ripe_poll_ms``, so it leaves soon after the fetch response that frees it."""
        earliest = self._held.earliest() if self.ordered else None
        if earliest is None:
            return self.idle_poll_ms
        ripe_in_ms = (earliest + self._idle_margin_s - time.time()) * 1000
        return min(self.idle_poll_ms, max(self.ripe_poll_ms, ripe_in_ms))

    async def _hold(self, batch: Mapping[TopicPartition, list[Record]]) -> None:
        """Decode a fetched batch into the held records; dead-letter what does not decode.

        A record that does not decode, or that is passed by undecoded, keeps its place
        (as ``None``), so positions, and therefore commits, only pass it in order."""
        dead: list[DeadLetter] = []
        for tp, records in batch.items():
            if records:
                self._check_gap(tp, records)
            entries: list[tuple[float, _Fetched]] = []
            for record in records:
                stamp = record.timestamp / 1000
                if self._passed_types and record_type(record.headers) in self._passed_types:
                    entries.append((stamp, _Fetched(tp, record.offset, stamp, None)))
                    self.stats.passed += 1
                    continue
                raw = _raw(record)
                try:
                    event = decode(record.key, record.value, record.headers)
                except DecodeError as exc:
                    dead.append(dead_letter(raw, exc.reason, exc.field, self.stage))
                    entries.append((stamp, _Fetched(tp, record.offset, stamp, None)))
                else:
                    item = Consumed(record.topic, record.partition, record.offset, event, stamp, raw)
                    entries.append((stamp, _Fetched(tp, record.offset, stamp, item)))
            if records:
                self._held.add(tp, entries)
        if dead:
            for letter in dead:
                log.warning(
                    "dead-lettering %s[%d]@%d: %s: %s",
                    letter.source_topic,
                    letter.source_partition,
                    letter.source_offset,
                    letter.field,
                    letter.reason,
                )
            await self.dead_letters.publish(dead)
            self.stats.dead_lettered += len(dead)

    async def _release(self, consumer: AIOKafkaConsumer) -> None:
        """Hand the handler what may be handled now, then tell it how far log time got."""
        if self.ordered:
            # The consumer's own position, not the last record seen: the broker may skip
            # offsets (compaction, a restart's lost tail), and a partition past its last
            # record is caught up all the same.
            # Only a partition with nothing held needs a bound, so only its position is read.
            self._position = {}
            for tp in consumer.assignment():
                if self._held.empty((tp.topic, tp.partition)):
                    self._position[tp] = await consumer.position(tp)
                else:
                    self._behind.pop(tp, None)  # it delivered: its wait starts afresh
            waited_for = set(self._enforced)
            self._enforced.clear()
            released = self._held.release(consumer.assignment(), self._caught_up_to(consumer))
            entries = released.items
            # A partition no longer waited for still bounds log time: at the last record
            # handled from it, so no grace expires on time that partition has not shown.
            stalled = [self._read_up_to.get(tp, -math.inf) for tp in self._enforced]
            self._frontier = max(self._frontier, min([released.frontier, *stalled]))
            if self._enforced and entries:
                self.stats.enforced += 1
                if self._enforced != waited_for:
                    log.warning(
                        "log-time order not kept: %s returned nothing for %.0f s though behind its end"
                        " (on the embedded broker's memory storage, a partition too long to read within the"
                        " fetch wait: raise --fetch-wait-ms, DESIGN §3)",
                        ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(self._enforced)),
                        self._max_idle_s,
                    )
        else:
            entries = self._held.release_all()
        consumed = [entry.item for entry in entries if entry.item is not None]
        if consumed:
            await self.handler.handle(consumed)
        # Only a handled record moves the positions that commits are computed from.
        for entry in entries:
            self._positions[entry.tp] = entry.offset + 1
            self._read_up_to[entry.tp] = entry.timestamp
        if entries:
            self.stats.batches += 1
            self.stats.consumed += len(consumed)
        self.stats.held = self._held.held()
        now = self._frontier if self.ordered else self._log_time(consumer)
        if now > -math.inf:
            await self.handler.tick(now)

    async def _commit(self, consumer: AIOKafkaConsumer, only: Iterable[TopicPartition] | None = None) -> None:
        """Commit what the handler allows, for partitions still owned, where it moved."""
        positions: dict[PortPartition, int] = dict(self._positions)
        allowed = self.handler.committable(positions)
        owned = set(only) if only is not None else set(consumer.assignment())
        offsets: dict[TopicPartition, int] = {}
        for key, offset in allowed.items():
            tp = TopicPartition(*key)
            if tp in owned and self._committed.get(tp) != offset:
                offsets[tp] = offset
        if not offsets:
            return
        try:
            await consumer.commit(offsets)
        except (CommitFailedError, IllegalStateError) as exc:
            # The group moved on; whoever owns these partitions now replays from the
            # last good commit, and idempotent handlers absorb the duplicates.
            log.warning("offset commit for group %s skipped: %s", self.group_id, exc)
            return
        self._committed.update(offsets)
        self.stats.commits += 1

    # -- rebalance -------------------------------------------------------------

    async def _on_revoked(self, revoked: set[TopicPartition]) -> None:
        consumer = self._consumer
        async with self._lock:  # the in-flight batch finishes (and commits) first
            self._epoch += 1
            if consumer is not None and revoked:
                await self._commit(consumer, only=revoked)
            self.handler.on_revoked([(tp.topic, tp.partition) for tp in revoked])
            self._held.drop(revoked)
            self._frontier = -math.inf  # recomputed from the partitions owned from now on
            for tp in revoked:
                self._behind.pop(tp, None)
                self._positions.pop(tp, None)
                self._fetch_from.pop(tp, None)
                self._read_up_to.pop(tp, None)
                self._committed.pop(tp, None)
        if revoked:  # a member's first join revokes nothing: no rebalance has happened yet
            self.stats.rebalances += 1
            log.info("%s: group %s revoked %s", self.stage, self.group_id, _named(revoked))

    async def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        consumer = self._consumer
        async with self._lock:
            if consumer is not None and assigned:
                committed = {tp: await consumer.committed(tp) for tp in assigned}
                fresh = [tp for tp, offset in committed.items() if offset is None]
                starts = await consumer.beginning_offsets(fresh) if fresh else {}
                # No await from here on: batches returned before this point carry the
                # old epoch and are dropped; those after it come from these positions.
                self._epoch += 1
                self._held.drop(assigned)
                # A partition taken over replays from its commit point, behind the others:
                # log time is what all owned partitions have shown, never what was reached before.
                self._frontier = -math.inf
                for tp in assigned:
                    offset = committed[tp]
                    if offset is None:
                        consumer.seek(tp, starts[tp])
                        self._fetch_from.pop(tp, None)  # from the log start, wherever it is: nothing lost
                        self._positions.pop(tp, None)
                        self._committed.pop(tp, None)
                    else:
                        consumer.seek(tp, offset)
                        self._fetch_from[tp] = offset
                        self._positions[tp] = offset
                        self._committed[tp] = offset
                if self._on_assigned_hook is not None:
                    await self._on_assigned_hook(frozenset((tp.topic, tp.partition) for tp in assigned))
                log.info("%s: group %s assigned %s", self.stage, self.group_id, _named(assigned))
            else:
                self._epoch += 1
        self._assigned.set()


def _named(partitions: set[TopicPartition]) -> str:
    return ", ".join(f"{tp.topic}[{tp.partition}]" for tp in sorted(partitions))


class _Rebalance(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, loop: ConsumerLoop) -> None:
        self._loop = loop

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._loop._on_revoked(revoked)

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._loop._on_assigned(assigned)


class CollectingHandler:
    """A stateless ``StageHandler`` that keeps what it is given (tests, tools).

    ``on_batch``, if set, is awaited for every batch before it counts as handled;
    raising from it makes the loop fail without committing that batch.
    """

    def __init__(self, on_batch: Callable[[Sequence[Consumed]], Awaitable[None]] | None = None) -> None:
        self.consumed: list[Consumed] = []
        self.revoked: list[PortPartition] = []
        self.ticks = 0
        self._on_batch = on_batch
        self._changed = asyncio.Event()

    async def handle(self, batch: Sequence[Consumed]) -> None:
        if self._on_batch is not None:
            await self._on_batch(batch)
        self.consumed.extend(batch)
        self._changed.set()

    async def tick(self, now: float) -> None:
        self.ticks += 1

    def committable(self, positions: Mapping[PortPartition, int]) -> Mapping[PortPartition, int]:
        return positions

    def on_revoked(self, partitions: Sequence[PortPartition]) -> None:
        self.revoked.extend(partitions)

    async def wait_for(self, count: int, within: float = 10.0) -> list[Consumed]:
        """Wait (at most ``within`` seconds) until ``count`` events were handled; returns them all."""

        async def _until() -> None:
            while len(self.consumed) < count:
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(_until(), within)
        return list(self.consumed)
