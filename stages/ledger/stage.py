"""The ledger stage: a long-lived consumer of admissions and staged events.

Per rollout it joins each admission with its staged event into a ``CallRecord`` (or a
``FailedCall``), and on the seal publishes one ``RolloutReceipt``. Events may arrive
in any order and more than once; outputs carry deterministic ids, so replays are
harmless downstream.

Offsets: per partition it commits the lowest offset any open rollout still needs, so
a restart rebuilds every open rollout from its first event. Rollouts it has receipted
are remembered by id (``answered``, recalled from the committed topic when partitions
are assigned): their events arriving again, replayed after a restart or delivered
twice, are late and change nothing; a call the receipt never saw is dead-lettered
(``ClosedRollouts``). Closed rollouts therefore never hold the commit point back,
however much rollouts overlap under sustained load.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from stages.ledger.closed import DEFAULT_BUDGET_BYTES, ClosedRollouts
from stages.ledger.rollout import Admitted, OpenRollout
from stages.ledger.timers import TaskTimers
from stages.ports import Consumed, EventSink, StageGauges, TopicPartition
from stages.recent import DEFAULT_REMEMBER, RecentIds
from topics.codec import HEADER_TYPE, dead_letter
from topics.failures import LedgerFailure
from topics.records import (
    CallRecord,
    CaptureAdmission,
    DeadLetter,
    FailedCall,
    Record,
    RolloutSeal,
    StagedEvent,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class LedgerConfig:
    seal_grace_s: float = 10.0
    """How long a sealed rollout waits for staged events still in flight, in log time: a
    replay of the log, or a ledger catching up after an outage, decides as live did."""
    max_open_s: float = 3600.0
    """A rollout with admissions but no seal after this long is closed as never sealed."""


@dataclass(slots=True)
class LedgerStats:
    receipts: int = 0
    poisoned: Counter[str] = field(default_factory=Counter)
    calls_committed: int = 0
    calls_failed: int = 0
    duplicates: int = 0
    late: int = 0
    dead_letters: int = 0


@dataclass(slots=True)
class _Tracked:
    """Where a rollout's events start: its first offset per topic-partition."""

    first: dict[TopicPartition, int] = field(default_factory=dict)

    def add(self, tp: TopicPartition, offset: int) -> None:
        self.first[tp] = min(self.first.get(tp, offset), offset)


class LedgerStage:
    """StageHandler for ``tokentrail.admission`` + ``tokentrail.staged``."""

    name = "ledger"

    def __init__(
        self,
        sink: EventSink,
        config: LedgerConfig | None = None,
        *,
        remember: int = DEFAULT_REMEMBER,
        closed_budget_bytes: int = DEFAULT_BUDGET_BYTES,
    ) -> None:
        self.sink = sink
        self.config = config or LedgerConfig()
        self.stats = LedgerStats()
        self.open: dict[str, OpenRollout] = {}
        self._open_spans: dict[str, _Tracked] = {}
        self._timers = TaskTimers()
        self.closed = ClosedRollouts(closed_budget_bytes)
        """The calls each recently receipted rollout covered: late events are judged by it."""
        self.answered = RecentIds(remember)
        """Rollouts whose receipt is published. Their events arriving again (a duplicate
        delivery, a replayed segment) are late, not a new rollout. Seed it from the tail
        of the committed topic when partitions are assigned (the recall rule, DESIGN §7)."""

    def gauges(self) -> StageGauges:
        return StageGauges(
            duplicates=self.stats.duplicates, open_rollouts=len(self.open), late=self.stats.late
        )

    async def handle(self, batch: Sequence[Consumed]) -> None:
        """Apply events one at a time, in the order given (the consumer's log-time merge):
        before each, its task's clock moves to the event's log time and the grace periods
        it passed expire; after each, its rollout closes if that event settled it. So the
        outcome depends on the order of events alone, never on how they were batched."""
        outputs: list[Record] = []
        for item in batch:
            outputs += self._advance(item.partition, item.timestamp)
            rollout_id = item.event.key
            if not isinstance(item.event.payload, CaptureAdmission | StagedEvent | RolloutSeal):
                outputs.append(
                    self._dead_letter(
                        item,
                        f"event type {item.event.event_type} does not belong on this topic",
                        f"header {HEADER_TYPE}",
                    )
                )
                continue
            if rollout_id in self.answered:  # the rollout's receipt is out
                outputs += self._late(item)
                continue
            state = self._track(rollout_id, item)
            outputs += self._apply(state, item)
            if state.settled():
                outputs += self._close(state)
        await self._publish(outputs)

    def _late(self, item: Consumed) -> list[Record]:
        """An event of a receipted rollout: a copy of one the receipt accounts for is
        counted; a call the receipt never saw is dead-lettered, never dropped silently."""
        payload = item.event.payload
        if isinstance(payload, CaptureAdmission):
            call_id, field_name = payload.call_id, "call_id"
        elif isinstance(payload, StagedEvent):
            call_id, field_name = payload.coords.call_id, "coords.call_id"
        else:  # a seal: the receipt answered the rollout's only one
            self.stats.late += 1
            return []
        if self.closed.covers(item.event.key, call_id) is False:
            reason = f"late: call {call_id} arrived after rollout {item.event.key} was receipted without it"
            return [self._dead_letter(item, reason, field_name)]
        self.stats.late += 1
        return []

    def _track(self, rollout_id: str, item: Consumed) -> OpenRollout:
        """The rollout's state (opened on its first event), noting where its events lie."""
        state = self.open.get(rollout_id)
        if state is None:
            state = self.open[rollout_id] = OpenRollout(rollout_id, opened_logged_at=item.timestamp)
            self._open_spans[rollout_id] = _Tracked()
            self._timers.schedule(item.partition, item.timestamp + self.config.max_open_s, rollout_id)
        elif item.timestamp < state.opened_logged_at:
            state.opened_logged_at = item.timestamp
            self._timers.schedule(item.partition, item.timestamp + self.config.max_open_s, rollout_id)
        self._open_spans[rollout_id].add((item.topic, item.partition), item.offset)
        return state

    def _apply(self, state: OpenRollout, item: Consumed) -> list[Record]:
        """Apply one event; an equal repeat is a duplicate, a different one a dead letter."""
        payload = item.event.payload
        if isinstance(payload, CaptureAdmission):
            admitted = Admitted.of(payload)
            known = state.admissions.get(payload.call_id)
            if known is not None:
                return self._repeat(item, known == admitted, lambda: known.first_difference(admitted))
            return self._count(state.admit(admitted))
        if isinstance(payload, StagedEvent):
            staged = state.staged.get(payload.coords.call_id)
            if staged is not None:
                return self._repeat(item, staged == payload, lambda: _first_difference(staged, payload))
            return self._count(state.stage(payload))
        assert isinstance(payload, RolloutSeal)
        seal = state.seal
        if seal is not None:
            return self._repeat(item, seal == payload, lambda: _first_difference(seal, payload))
        state.seal = payload
        state.sealed_logged_at = item.timestamp
        self._timers.schedule(item.partition, item.timestamp + self.config.seal_grace_s, state.rollout_id)
        return []

    def _repeat(self, item: Consumed, equal: bool, difference: Callable[[], str | None]) -> list[Record]:
        """An event seen before: a duplicate when equal, else a dead letter naming the field."""
        if equal:
            self.stats.duplicates += 1
            return []
        kind = item.event.event_type.value
        return [self._dead_letter(item, f"conflicting {kind} for the same id", difference())]

    def _count(self, joined: CallRecord | FailedCall | None) -> list[Record]:
        if joined is None:
            return []
        if isinstance(joined, CallRecord):
            self.stats.calls_committed += 1
        else:
            self.stats.calls_failed += 1
        return [joined]

    def _close(self, state: OpenRollout, forced: LedgerFailure | None = None) -> list[Record]:
        late, receipt = state.close(forced)
        self.stats.calls_failed += len(late)
        self.stats.receipts += 1
        if receipt.failure_reason is not None:
            self.stats.poisoned[str(receipt.failure_reason)] += 1
        del self.open[state.rollout_id]
        for partition in {partition for _, partition in self._open_spans.pop(state.rollout_id).first}:
            self._timers.cancel(partition, state.rollout_id)
        self.answered.add(state.rollout_id)
        self.closed.add(state.rollout_id, [*state.admissions, *state.staged])
        return [*late, receipt]

    async def tick(self, now: float) -> None:
        """Every task has been read up to ``now`` in log time: expire what that passes."""
        outputs: list[Record] = []
        for task in self._timers.tasks():
            outputs += self._advance(task, now)
        await self._publish(outputs)

    def _advance(self, task: int, now: float) -> list[Record]:
        """Move ``task``'s clock to ``now``; close the rollouts whose grace (or whose
        ``max_open_s`` without a seal) it passed."""
        outputs: list[Record] = []
        due = self._timers.advance(task, now)
        clock = self._timers.now(task)
        for rollout_id in due:
            state = self.open.get(rollout_id)
            if state is None:
                continue  # closed since this deadline was set
            if state.seal is not None:
                if clock >= state.sealed_logged_at + self.config.seal_grace_s:
                    outputs += self._close(state)
            elif clock >= state.opened_logged_at + self.config.max_open_s:
                state.seal = RolloutSeal(
                    rollout_id=state.rollout_id,
                    status="failed",
                    failure_reason=LedgerFailure.NEVER_SEALED.value,
                    sealed_at=_last_seen(state),
                )
                outputs += self._close(state, LedgerFailure.NEVER_SEALED)
        return outputs

    async def _publish(self, outputs: list[Record]) -> None:
        if outputs:
            await self.sink.publish(outputs)

    def clocks(self) -> dict[int, float]:
        """Each task's log-time clock (``resume`` takes it back)."""
        return self._timers.clocks()

    async def resume(
        self, clocks: Mapping[int, float], answered: Iterable[str], events: Sequence[Consumed]
    ) -> None:
        """Continue where a checkpoint was cut: the task clocks and answered rollouts as
        they were, then the open rollouts' own events applied again, in their order.

        An open rollout's state is a function of its events alone, and none of its
        deadlines had passed at the cut (it would be closed), so applying them again
        under the restored clocks rebuilds it; what they emit again (calls already
        joined) carries the same ids, which every sink applies once."""
        for task, now in clocks.items():
            self._timers.advance(task, now)  # nothing is scheduled yet: nothing falls due
        self.answered.update(answered)
        await self.handle(events)

    def committable(self, positions: Mapping[TopicPartition, int]) -> Mapping[TopicPartition, int]:
        commit = dict(positions)
        for tracked in self._open_spans.values():
            for tp, first in tracked.first.items():
                if tp in commit and first < commit[tp]:
                    commit[tp] = first
        return commit

    def on_revoked(self, partitions: Sequence[TopicPartition]) -> None:
        lost = set(partitions)
        for rollout_id, tracked in list(self._open_spans.items()):
            if lost & tracked.first.keys():
                del self._open_spans[rollout_id]
                self.open.pop(rollout_id, None)
        self._timers.forget({partition for _, partition in lost})

    def _dead_letter(self, item: Consumed, reason: str, field_name: str | None) -> DeadLetter:
        self.stats.dead_letters += 1
        log.warning("dead-lettering %s@%d:%d: %s", item.topic, item.partition, item.offset, reason)
        return dead_letter(item.as_raw(), reason, field_name, self.name)


def _first_difference(known: Record, other: Record) -> str | None:
    """The first field (dotted for nested ones) where two records of one type differ."""
    a, b = known.model_dump(), other.model_dump()
    for name in a:
        if a[name] != b.get(name):
            if isinstance(a[name], dict) and isinstance(b.get(name), dict):
                inner = next((k for k in a[name] if a[name][k] != b[name].get(k)), None)
                return f"{name}.{inner}" if inner else name
            return name
    return None


def _last_seen(state: OpenRollout) -> float:
    """When the rollout was last heard of, by its events' own clocks: a never-sealed
    rollout's receipt is then a function of the log alone, and a rebuild reproduces it."""
    stamps = [a.admitted_at for a in state.admissions.values()]
    stamps += [s.staged_at for s in state.staged.values()]
    return max(stamps, default=0.0)
