"""Replay: rebuild the token-free ledger from the log, and compare it with the live one.

``rebuild`` runs the ledger stage's own logic over ``admission`` + ``staged`` from the
beginning (or given offsets) into a ``LedgerStore``, merged in the same log-time order
as the live loop and with the records' log timestamps as its clock, so seal grace
periods expire as they did live. ``materialize`` copies
the live ledger (``committed`` topic) into a store. Equal snapshots mean the ledger
is a pure function of the log.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass

from aiokafka import TopicPartition

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.lag import LagReader
from pipeline.kafka.logtime import LogTimeMerge
from pipeline.kafka.reader import assigned_reader
from pipeline.replay.store import LedgerStore
from stages.ledger.stage import LedgerConfig
from stages.ports import Consumed
from stages.specs import LEDGER, StageSettings
from topics.codec import DecodeError, decode

Progress = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class Shard:
    """Shard ``index`` of ``count``: partition *p* of every topic where ``p % count == index``.

    A rollout's events all lie in one partition number of every input topic, so a
    shard holds whole rollouts (``pipeline.replay.parallel``)."""

    index: int = 0
    count: int = 1

    def __post_init__(self) -> None:
        if self.count < 1 or not 0 <= self.index < self.count:
            raise ValueError(f"shard: index {self.index} of {self.count} is not a shard")

    def holds(self, tp: TopicPartition) -> bool:
        return int(tp.partition) % self.count == self.index


WHOLE_LOG = Shard()


@dataclass(frozen=True, slots=True)
class ReplayResult:
    events: int
    undecodable: int
    stored: dict[str, int]
    open_rollouts: int


async def read_log(
    config: KafkaConfig,
    topics: Sequence[str],
    *,
    start: Mapping[TopicPartition, int] | None = None,
    batch: int = 2000,
    progress: Progress | None = None,
    ties: Sequence[str] = (),
    shard: Shard = WHOLE_LOG,
) -> AsyncIterator[tuple[list[Consumed], float, int]]:
    """Batches of decoded events up to today's high watermarks, in log-time merge order.

    Yields ``(events, frontier, undecodable_count)``: ``frontier`` is the log time below
    which every event has been yielded. Partitions not in ``start`` are read from their
    beginning. The order is the live ledger's (``LogTimeMerge``, equal timestamps going
    to ``ties`` in that order, DESIGN §7.2): a partition
    is fetched only when nothing of it is held, so each holds at most one fetch. Only
    the ``shard``'s partitions are read.
    """
    async with LagReader(config) as reader:
        partitions = [tp for tp in await reader.partitions(topics) if shard.holds(tp)]
        ends = {tp: marks.highwater for tp, marks in (await reader.watermarks(partitions)).items()}
    positions = {tp: (start or {}).get(tp) for tp in partitions}
    async with assigned_reader(config, positions) as consumer:
        read_to = {tp: await consumer.position(tp) for tp in partitions}
        total = sum(max(0, ends[tp] - read_to[tp]) for tp in partitions)
        done = 0
        merge: LogTimeMerge[Consumed] = LogTimeMerge(ties)

        def finished(key: tuple[str, int]) -> float:
            return math.inf if read_to[TopicPartition(*key)] >= ends[TopicPartition(*key)] else -math.inf

        while True:
            due = [tp for tp in partitions if read_to[tp] < ends[tp] and merge.empty(tp)]
            if not due and not merge.held():
                return
            bad = 0
            if due:
                fetched = await consumer.getmany(*due, timeout_ms=500, max_records=batch)
                for tp, records in fetched.items():
                    entries: list[tuple[float, Consumed]] = []
                    for record in records:
                        if record.offset >= ends[tp]:
                            continue
                        try:
                            event = decode(record.key, record.value, record.headers)
                        except DecodeError:
                            bad += 1
                            continue
                        stamp = record.timestamp / 1000
                        entries.append((stamp, Consumed(tp.topic, tp.partition, record.offset, event, stamp)))
                    merge.add(tp, entries)
                    done += len(records)
                for tp in due:
                    read_to[tp] = await consumer.position(tp)
            released = merge.release(partitions, finished)
            if progress is not None:
                progress(min(done, total), total)
            yield released.items, released.frontier, bad


async def rebuild(
    config: KafkaConfig,
    store: LedgerStore,
    *,
    ledger: LedgerConfig | None = None,
    start: Mapping[TopicPartition, int] | None = None,
    progress: Progress | None = None,
    shard: Shard = WHOLE_LOG,
) -> ReplayResult:
    """Re-run the ledger over its input topics (the ``shard``'s partitions) into
    ``store``, in the live loop's order, with log time as its clock, so seal grace
    periods expire as they did live."""
    stage = LEDGER.build(store, settings=StageSettings(ledger=ledger or LedgerConfig()))
    names = config.names
    count = bad_total = 0
    assert LEDGER.log_time_order is not None
    async for events, frontier, bad in read_log(
        config,
        LEDGER.inputs(names),
        start=start,
        progress=progress,
        ties=LEDGER.log_time_order(names),
        shard=shard,
    ):
        bad_total += bad
        count += len(events)
        await stage.handle(events)
        if frontier > -math.inf:
            await stage.tick(frontier)
    await stage.tick(math.inf)  # the log is over: every sealed rollout's grace has passed
    return ReplayResult(count, bad_total, store.counts(), stage.gauges().open_rollouts or 0)


async def materialize(
    config: KafkaConfig, store: LedgerStore, *, progress: Progress | None = None
) -> ReplayResult:
    """Copy the live ledger (the ``committed`` topic) into ``store``."""
    count = bad_total = 0
    async for events, _, bad in read_log(config, [config.names.committed], progress=progress):
        store.add([item.event.payload for item in events])
        count += len(events)
        bad_total += bad
    return ReplayResult(count, bad_total, store.counts(), 0)


def compare(rebuilt: LedgerStore, live: LedgerStore) -> list[str]:
    """Differences between two ledgers, as readable lines (empty when equal)."""
    a, b = rebuilt.snapshot(), live.snapshot()
    problems = [f"only in rebuilt: {event_id}" for event_id in sorted(a.keys() - b.keys())]
    problems += [f"only in live: {event_id}" for event_id in sorted(b.keys() - a.keys())]
    problems += [
        f"differs: {event_id}" for event_id in sorted(a.keys() & b.keys()) if a[event_id] != b[event_id]
    ]
    return problems
