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
from pipeline.replay.checkpoint import Cut
from pipeline.replay.store import LedgerStore
from stages.ledger.stage import LedgerConfig
from stages.ports import Consumed, Resumable
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


class LogGone(RuntimeError):
    """Retention deleted events a rebuild needs: going on would skip them silently."""


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
    complete: bool = False,
) -> AsyncIterator[tuple[list[Consumed], float, int]]:
    """Batches of decoded events up to today's high watermarks, in log-time merge order.

    Yields ``(events, frontier, undecodable_count)``: ``frontier`` is the log time below
    which every event has been yielded. Partitions not in ``start`` are read from their
    beginning. The order is the live ledger's (``LogTimeMerge``, equal timestamps going
    to ``ties`` in that order, DESIGN §7.2): a partition
    is fetched only when nothing of it is held, so each holds at most one fetch. Only
    the ``shard``'s partitions are read. ``complete``: raise ``LogGone`` rather than read
    a partition whose log now starts past where the reading is to begin.
    """
    async with LagReader(config) as reader:
        partitions = [tp for tp in await reader.partitions(topics) if shard.holds(tp)]
        marks = await reader.watermarks(partitions)
    ends = {tp: mark.highwater for tp, mark in marks.items()}
    positions = {tp: (start or {}).get(tp) for tp in partitions}
    if complete:
        require_retained(positions, {tp: mark.log_start for tp, mark in marks.items()})
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


def require_retained(
    positions: Mapping[TopicPartition, int | None], log_starts: Mapping[TopicPartition, int]
) -> None:
    """Raise ``LogGone`` naming every partition whose log now starts past where reading is
    to begin (``None``: the beginning, offset 0): retention deleted what lies between."""
    gone = [
        f"{tp.topic}:{tp.partition} offsets {position or 0}..{log_starts[tp] - 1}"
        for tp, position in positions.items()
        if (position or 0) < log_starts[tp]
    ]
    if gone:
        raise LogGone(
            "retention deleted events this rebuild needs ("
            + "; ".join(gone)
            + "): continue from a checkpoint that covers them (--checkpoints)"
        )


async def rebuild(
    config: KafkaConfig,
    store: LedgerStore,
    *,
    ledger: LedgerConfig | None = None,
    start: Mapping[TopicPartition, int] | None = None,
    progress: Progress | None = None,
    shard: Shard = WHOLE_LOG,
    resume: Cut | None = None,
    cut_at: float | None = None,
    on_cut: Callable[[Cut], None] | None = None,
) -> ReplayResult:
    """Re-run the ledger over its input topics (the ``shard``'s partitions) into
    ``store``, in the live loop's order, with log time as its clock, so seal grace
    periods expire as they did live.

    ``resume``: continue from a checkpoint's cut (``store`` is the ledger it was cut
    from) and read only the tail after its offsets. ``cut_at``: the log is still being
    written, and events appended from now on are stamped at or after that log time; so
    time stops there (what the rebuild closes is final, and the store can be extended by
    the next one), and ``on_cut`` gets the state just before the first event at or after
    it, or at the log's end (§7.7). Without it the log is taken as finished."""
    stage = LEDGER.build(store, settings=StageSettings(ledger=ledger or LedgerConfig()))
    if not isinstance(stage, Resumable):
        raise TypeError(f"stage {stage.name}: a rebuild continues only a resumable stage")
    names = config.names
    opened = _OpenEvents(resume.events if resume else ())
    if resume is not None:
        await stage.resume(resume.clocks, resume.answered, resume.events)
        start = resume.offsets
    covered = dict(start or {})
    count = bad_total = 0
    before = resume.events_covered if resume else 0
    pending = cut_at is not None and on_cut is not None

    async def apply(items: Sequence[Consumed]) -> None:
        await stage.handle(items)
        for item in items:
            covered[(item.topic, item.partition)] = item.offset + 1
        if pending:
            opened.keep(items, stage.open)

    def cut() -> None:
        assert on_cut is not None
        events = opened.still_open(stage.open)
        on_cut(Cut(dict(covered), stage.clocks(), list(stage.answered), events, before + count, store.rows()))

    assert LEDGER.log_time_order is not None
    async for events, frontier, bad in read_log(
        config,
        LEDGER.inputs(names),
        start=start,
        progress=progress,
        ties=LEDGER.log_time_order(names),
        shard=shard,
        complete=True,
    ):
        bad_total += bad
        if pending:
            assert cut_at is not None
            at = next((i for i, item in enumerate(events) if item.timestamp >= cut_at), len(events))
            await apply(events[:at])
            count += at
            if at < len(events):
                cut()
                pending = False
                await apply(events[at:])
                count += len(events) - at
        else:
            await apply(events)
            count += len(events)
        if frontier > -math.inf:  # at the log's end the frontier is infinite
            await stage.tick(frontier if cut_at is None else min(frontier, cut_at))
    if pending:
        cut()
    if cut_at is None:
        await stage.tick(math.inf)  # a finished log: every sealed rollout's grace has passed
    return ReplayResult(count, bad_total, store.counts(), stage.gauges().open_rollouts or 0)


class _OpenEvents:
    """The events of the rollouts still open, in the order they were applied: with the
    clocks, all a checkpoint needs to rebuild them (the ledger's ``resume``)."""

    SWEEP_EVERY = 256
    """Batches between sweeps of the rollouts that closed (on a tick, not on an event)."""

    def __init__(self, events: Sequence[Consumed]) -> None:
        self._seq = 0
        self._by_rollout: dict[str, list[tuple[int, Consumed]]] = {}
        self._batches = 0
        for item in events:
            self._add(item)

    def _add(self, item: Consumed) -> None:
        self._by_rollout.setdefault(item.event.key, []).append((self._seq, item))
        self._seq += 1

    def keep(self, items: Sequence[Consumed], still_open: Mapping[str, object]) -> None:
        for item in items:
            if item.event.key in still_open:
                self._add(item)
            else:
                self._by_rollout.pop(item.event.key, None)
        self._batches += 1
        if self._batches % self.SWEEP_EVERY == 0:
            self._sweep(still_open)

    def _sweep(self, still_open: Mapping[str, object]) -> None:
        for rollout_id in [r for r in self._by_rollout if r not in still_open]:
            del self._by_rollout[rollout_id]

    def still_open(self, still_open: Mapping[str, object]) -> list[Consumed]:
        self._sweep(still_open)
        kept = sorted(entry for entries in self._by_rollout.values() for entry in entries)
        return [item for _, item in kept]


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
