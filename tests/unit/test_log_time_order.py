"""The ledger is a pure function of the log: live fetch schedules never change its output.

The live loop merges partitions in log-time order (``LogTimeMerge``), holding each
record until the other partitions have caught up with it, and counts a caught-up
partition as read up to its last poll less a margin. Replay merges the finished log the
same way. Here a simulated broker appends records some time after their producers
stamped them (less than the margin), a simulated live loop fetches them on random
schedules in random amounts and hands them to the real ``LedgerStage`` in random
batches with idle ticks; its output must equal a replay's, whatever the schedule.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.events import rollout_events
from pipeline.kafka.consumer import ConsumerLoop, ConsumerTuning
from pipeline.kafka.logtime import LogTimeMerge
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.memory import RecordingSink
from stages.ports import Consumed, TopicPartition
from topics.events import envelope
from topics.records import CaptureAdmission, Record, RolloutReceipt, RolloutSeal, StagedEvent

ADMISSION, STAGED = "admission", "staged"
TIES = [STAGED, ADMISSION]  # the ledger's rule (stages.specs.LEDGER)
GRACE_S = 0.5
MARGIN_S = 0.2


@dataclass(frozen=True, slots=True)
class Logged:
    """One record as the broker holds it: stamped by its producer, appended a bit later."""

    stamp: float
    appended: float
    event: Record


Log = dict[TopicPartition, list[Logged]]


def consumed(tp: TopicPartition, offset: int, record: Logged) -> Consumed:
    return Consumed(tp[0], tp[1], offset, envelope(record.event), record.stamp)


def outputs(sink: RecordingSink) -> dict[str, dict[str, object]]:
    return {event.event_id: event.payload.model_dump() for event in sink.events}


def replay(log: Log) -> RecordingSink:
    """The finished log, merged in one go, applied, then the end of time."""
    merge: LogTimeMerge[Consumed] = LogTimeMerge(TIES)
    for tp, records in log.items():
        merge.add(tp, [(r.stamp, consumed(tp, offset, r)) for offset, r in enumerate(records)])
    sink = RecordingSink()
    stage = LedgerStage(sink, LedgerConfig(seal_grace_s=GRACE_S))

    async def go() -> None:
        released = merge.release(log, lambda tp: math.inf)
        await stage.handle(released.items)
        await stage.tick(math.inf)

    asyncio.run(go())
    return sink


@dataclass(frozen=True, slots=True)
class Step:
    """The live loop wakes at ``wall``, fetches up to ``fetch[tp]`` records per partition,
    hands what the merge releases over in batches of ``batch``, and ticks."""

    wall: float
    fetch: dict[TopicPartition, int]
    batch: int


def live(log: Log, steps: Sequence[Step]) -> RecordingSink:
    merge: LogTimeMerge[Consumed] = LogTimeMerge(TIES)
    fetched = dict.fromkeys(log, 0)
    polled: dict[TopicPartition, tuple[float, int]] = {}  # when, and the end it saw
    sink = RecordingSink()
    stage = LedgerStage(sink, LedgerConfig(seal_grace_s=GRACE_S))

    def bound(tp: TopicPartition) -> float:
        if tp not in polled or fetched[tp] < polled[tp][1]:
            return -math.inf
        return polled[tp][0] - MARGIN_S

    async def go() -> None:
        frontier = -math.inf
        for step in steps:
            for tp, count in step.fetch.items():
                end = sum(1 for r in log[tp] if r.appended <= step.wall)
                take = range(fetched[tp], min(end, fetched[tp] + count))
                merge.add(tp, [(log[tp][i].stamp, consumed(tp, i, log[tp][i])) for i in take])
                fetched[tp] += len(take)
                polled[tp] = (step.wall, end)
            released = merge.release(log, bound)
            for start in range(0, len(released.items), step.batch):
                await stage.handle(released.items[start : start + step.batch])
            frontier = max(frontier, released.frontier)
            if frontier > -math.inf:
                await stage.tick(frontier)

    asyncio.run(go())
    return sink


def random_log(rng: random.Random) -> Log:
    """Rollouts on two tasks whose staged events often land near their seal's grace end."""
    log: Log = {(topic, p): [] for topic in (ADMISSION, STAGED) for p in (0, 1)}
    for number in range(rng.randint(1, 8)):
        rollout = f"r{number}"
        task = rng.randrange(2)
        start = rng.uniform(0.0, 3.0)
        events = rollout_events(rollout, rng.randint(1, 3))
        admitted = [e for e in events if isinstance(e, CaptureAdmission)]
        seal_at = start + 0.1 * len(admitted) + 0.05
        for i, event in enumerate(events):
            if isinstance(event, CaptureAdmission):
                stamp, topic = start + 0.1 * admitted.index(event), ADMISSION
            elif isinstance(event, StagedEvent):
                if rng.random() < 0.1:
                    continue  # a call that never stages
                stamp, topic = seal_at + rng.uniform(-0.3, GRACE_S + 0.3), STAGED
            else:
                assert isinstance(event, RolloutSeal)
                stamp, topic = seal_at, ADMISSION
            delay = rng.uniform(0.0, MARGIN_S * 0.9)
            log[(topic, task)].append(Logged(stamp, stamp + delay + i * 1e-6, event))
    for records in log.values():
        records.sort(key=lambda r: r.appended)  # a partition holds records in append order
    return log


def random_schedule(rng: random.Random, log: Log) -> Iterator[Step]:
    last = max((r.appended for records in log.values() for r in records), default=0.0)
    wall = 0.0
    while wall < last + GRACE_S + MARGIN_S + 1.0:
        wall += rng.choice([0.0, 0.01, 0.05, 0.2, 0.7])
        chosen = rng.sample(sorted(log), rng.randint(0, len(log)))
        yield Step(wall, {tp: rng.randint(0, 4) for tp in chosen}, rng.randint(1, 5))
    for _ in range(40):  # then fetch everything, so every partition catches up
        wall += 0.1
        yield Step(wall, dict.fromkeys(log, 100), rng.randint(1, 5))


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(min_value=0, max_value=2**32 - 1))
def test_live_ledger_equals_replay_under_any_fetch_schedule(seed: int) -> None:
    rng = random.Random(seed)
    log = random_log(rng)
    expected = outputs(replay(log))
    assert outputs(live(log, list(random_schedule(rng, log)))) == expected


def test_staged_event_just_inside_grace_joins_though_fetched_after_a_later_event() -> None:
    """Regression: the seal at 10.0 (grace to 10.5), the call's staged event stamped 10.45
    and appended at 10.55, and another rollout's admission at 10.6 on the seal's partition.
    Live fetches the admission partition first; it must not expire the grace before the
    staged partition has been read past 10.5."""
    r, other = rollout_events("r", 1), rollout_events("s", 1)
    admission, staged, seal = r
    log: Log = {
        (ADMISSION, 0): [
            Logged(9.9, 9.91, admission),
            Logged(10.0, 10.01, seal),
            Logged(10.6, 10.61, other[0]),
            Logged(10.9, 10.91, other[2]),
        ],
        (STAGED, 0): [Logged(10.45, 10.55, staged), Logged(10.7, 10.75, other[1])],
    }
    steps = [
        Step(10.5, {(STAGED, 0): 10}, 10),  # nothing staged yet: caught up at 10.5
        Step(10.7, {(ADMISSION, 0): 10}, 10),  # the seal and the later admission
        Step(10.8, {}, 10),
        Step(11.0, {(STAGED, 0): 10}, 10),  # the staged event, appended at 10.55
        Step(12.0, dict.fromkeys(log, 10), 10),
    ]
    sink = live(log, steps)
    receipt = next(p for p in sink.payloads(RolloutReceipt) if p.rollout_id == "r")  # type: ignore[attr-defined]
    assert receipt.capture_poisoned is False  # type: ignore[attr-defined]
    assert outputs(sink) == outputs(replay(log))


def test_merge_orders_heads_by_time_then_tie_rule_and_keeps_partition_order() -> None:
    merge: LogTimeMerge[str] = LogTimeMerge(ties=["b"])
    merge.add(("a", 0), [(1.0, "a1"), (3.0, "a3"), (2.0, "a2-late")])
    merge.add(("b", 0), [(1.0, "b1"), (2.5, "b2")])
    merge.add(("a", 1), [(1.0, "a1'")])
    released = merge.release([("a", 0), ("a", 1), ("b", 0)], lambda tp: math.inf)
    assert released.items == ["b1", "a1", "a1'", "b2", "a3", "a2-late"]
    assert released.frontier == math.inf


def test_a_staged_event_in_the_seals_millisecond_counts_though_it_has_no_admission() -> None:
    """Ties go to the staged topic: the worker answered before the driver sealed."""
    r = rollout_events("r", 2)
    adm0, staged0, _, staged1, seal = r  # call 1's admission was lost
    log: Log = {
        (ADMISSION, 0): [Logged(1.0, 1.0, adm0), Logged(2.0, 2.0, seal)],
        (STAGED, 0): [Logged(1.5, 1.5, staged0), Logged(2.0, 2.0, staged1)],
    }
    receipt = replay(log).payloads(RolloutReceipt)[0]
    assert [f.reason for f in receipt.failed_calls] == ["unknown_admission"]  # type: ignore[attr-defined]


def test_merge_holds_records_until_an_empty_partition_is_known_past_them() -> None:
    merge: LogTimeMerge[str] = LogTimeMerge()
    merge.add(("a", 0), [(1.0, "a1"), (5.0, "a5")])
    blocked = merge.release([("a", 0), ("b", 0)], lambda tp: -math.inf)
    assert blocked.items == [] and blocked.frontier == -math.inf and merge.held() == 2
    partial = merge.release([("a", 0), ("b", 0)], lambda tp: 3.0)
    assert partial.items == ["a1"] and partial.frontier == 3.0
    assert merge.earliest() == 5.0
    merge.drop([("a", 0)])
    assert merge.held() == 0 and merge.release([("a", 0)], lambda tp: 7.0).frontier == 7.0
    assert merge.earliest() is None


def test_a_loop_polls_often_only_while_a_held_record_is_past_its_margin(
    unconnected_loop: Callable[..., ConsumerLoop],
) -> None:
    """An empty fetch response frees a held record but does not end a poll: once the
    earliest held record's margin has passed the loop polls every ``ripe_poll_ms``;
    before, it waits until then at most; holding nothing, ``idle_poll_ms``."""
    tuning = ConsumerTuning(idle_poll_ms=1000, ripe_poll_ms=5, idle_margin_ms=100)
    ordered, unordered = unconnected_loop(tuning, []), unconnected_loop(tuning)
    assert ordered._poll_ms() == unordered._poll_ms() == 1000
    now = time.time()
    ordered._held.add(("t", 0), [(now - 0.05, None)])  # type: ignore[list-item]
    assert 5 < ordered._poll_ms() <= 50  # until its margin has passed
    ordered._held.add(("t", 1), [(now - 0.5, None)])  # type: ignore[list-item]
    assert ordered._poll_ms() == 5
    unordered._held.add(("t", 1), [(now - 0.5, None)])  # type: ignore[list-item]
    assert unordered._poll_ms() == 1000  # no order, nothing waits for a margin
