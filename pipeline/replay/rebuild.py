"""Replay: rebuild the token-free ledger from the log, and compare it with the live one.

``rebuild`` runs the ledger stage's own logic over ``admission`` + ``staged`` from the
beginning (or given offsets) into a ``LedgerStore``, with the records' log timestamps
as its clock, so seal grace periods expire as they did live. ``materialize`` copies
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
from pipeline.kafka.reader import assigned_reader
from pipeline.replay.store import LedgerStore
from stages.ledger.stage import LedgerConfig
from stages.ports import Consumed
from stages.specs import LEDGER, StageSettings
from topics.codec import DecodeError, decode

Progress = Callable[[int, int], None]
TIME_SLICE_MS = 100


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
) -> AsyncIterator[tuple[list[Consumed], list[int], int]]:
    """Batches of decoded events (with their timestamps in ms) up to today's high watermarks.

    Yields ``(events, timestamps_ms, undecodable_count)``. Partitions not in ``start``
    are read from their beginning.

    Batches follow log time across all partitions: an event is yielded only once every
    unfinished partition has been read up to its timestamp, and each fetch reads only the
    partitions not ahead of the slowest by more than ``TIME_SLICE_MS`` (so at most about
    one fetch per partition waits here). Left to itself the consumer drains one partition's
    buffer before the next, so a rebuild would read every admission and seal before any
    staged event; since ``rebuild`` keeps log time, seal grace periods would then expire
    for staged events that are in the log, in time, but not read yet.
    """
    async with LagReader(config) as reader:
        partitions = await reader.partitions(topics)
        ends = {tp: marks.highwater for tp, marks in (await reader.watermarks(partitions)).items()}
    positions = {tp: (start or {}).get(tp) for tp in partitions}
    async with assigned_reader(config, positions) as consumer:
        begin = {tp: await consumer.position(tp) for tp in partitions}
        remaining = {tp for tp in partitions if ends[tp] > begin[tp]}
        total = sum(ends[tp] - begin[tp] for tp in remaining)
        done = 0
        latest: dict[TopicPartition, int] = {}  # log time of the last record read, per partition
        held: list[tuple[int, Consumed]] = []  # read, but later than some partition's progress
        while remaining:
            floor = min(latest.get(tp, -1) for tp in remaining)
            due = [tp for tp in remaining if latest.get(tp, -1) <= floor + TIME_SLICE_MS]
            fetched = await consumer.getmany(*due, timeout_ms=500, max_records=batch)
            bad = 0
            for tp, records in fetched.items():
                for record in records:
                    if record.offset >= ends[tp]:
                        continue
                    try:
                        event = decode(record.key, record.value, record.headers)
                    except DecodeError:
                        bad += 1
                        continue
                    held.append(
                        (
                            record.timestamp,
                            Consumed(tp.topic, tp.partition, record.offset, event, record.timestamp / 1000),
                        )
                    )
                if records:
                    latest[tp] = max(latest.get(tp, -1), records[-1].timestamp)
                done += len(records)
            for tp in list(remaining):
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
            watermark = min((latest.get(tp, -1) for tp in remaining), default=math.inf)
            ready = [pair for pair in held if pair[0] <= watermark]
            held = [pair for pair in held if pair[0] > watermark]
            if progress is not None:
                progress(done, total)
            yield [item for _, item in ready], [stamp for stamp, _ in ready], bad


async def rebuild(
    config: KafkaConfig,
    store: LedgerStore,
    *,
    ledger: LedgerConfig | None = None,
    start: Mapping[TopicPartition, int] | None = None,
    progress: Progress | None = None,
) -> ReplayResult:
    """Re-run the ledger over its input topics into ``store``."""
    now = [0.0]
    stage = LEDGER.build(store, settings=StageSettings(ledger=ledger or LedgerConfig()))
    names = config.names
    count = bad_total = 0
    async for events, stamps, bad in read_log(
        config, [names.admission, names.staged], start=start, progress=progress
    ):
        bad_total += bad
        count += len(events)
        # Apply in log-time order, in slices of at most TIME_SLICE_S of log time, each
        # with its own clock, so seal grace periods expire as they did live.
        ordered = sorted(zip(events, stamps, strict=True), key=lambda pair: pair[1])
        begin = 0
        while begin < len(ordered):
            first = ordered[begin][1]
            end = begin
            while end < len(ordered) and ordered[end][1] - first <= TIME_SLICE_MS:
                end += 1
            now[0] = max(now[0], first / 1000)
            await stage.tick(now[0])  # time passed before these events arrived: graces expire first
            await stage.handle([item for item, _ in ordered[begin:end]])
            await stage.tick(now[0])
            begin = end
    now[0] = math.inf  # the log is over: every sealed rollout's grace has passed
    await stage.tick(now[0])
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
