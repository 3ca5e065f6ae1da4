"""Ledger logic: joins, terminal selection table, poisoning, offsets, memory."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import pytest

from stages.ledger.closed import ROLLOUT_OVERHEAD_BYTES, ClosedRollouts
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.ledger.timers import COMPACT_AT_LEAST as TIMERS_COMPACT_AT_LEAST
from stages.ledger.timers import TaskTimers
from stages.memory import RecordingSink
from stages.ports import Consumed
from topics.codec import RawRecord, encode
from topics.events import envelope
from topics.records import (
    CallRecord,
    CaptureAdmission,
    CommitCoords,
    DeadLetter,
    FailedCall,
    Record,
    RolloutReceipt,
    RolloutSeal,
    StagedEvent,
)

H = [f"{i:064x}" for i in range(1, 50)]


class Rollout:
    """Builds the events of one rollout: calls are (call_id, parent, logical id)."""

    def __init__(self, rollout_id: str = "r") -> None:
        self.rollout_id = rollout_id
        self.coords: dict[str, CommitCoords] = {}
        self.events: list[Record] = []
        self.clock = 1.0

    def call(
        self,
        call_id: str,
        parent: str | None = None,
        *,
        logical: str | None = None,
        failed: str | None = None,
        staged: bool = True,
        response_id: str | None = None,
        tamper: dict[str, Any] | None = None,
        history: str = "exact",
        segment: bool = False,
    ) -> None:
        """``segment``: the worker stages the call as a root (its render did not extend
        the parent's tokens), whatever its admission says."""
        p = self.coords.get(parent) if parent else None
        prev_len = p.cum_len if p else 0
        chain = [*(p.staging_chain if p else []), f"{self.rollout_id}/{call_id}"]
        self.clock += 1
        admission = CaptureAdmission(
            rollout_id=self.rollout_id,
            call_id=call_id,
            parent_call_id=parent,
            prev_len=prev_len,
            mode="token_in" if parent else "text",
            staging_chain=p.staging_chain if p else None,
            parent_chain_hash=p.chain_hash if p else None,
            logical_call_id=logical,
            admitted_at=self.clock,
            history=history,
        )
        if segment:
            parent, prev_len, chain = None, 0, chain[-1:]
        coords = CommitCoords(
            rollout_id=self.rollout_id,
            call_id=call_id,
            parent_call_id=parent,
            mode="token_in" if parent else "text",
            prev_len=prev_len,
            delta_len=5,
            cum_len=prev_len + 5,
            weight_version=0,
            staging_key=chain[-1],
            staging_chain=chain,
            chain_hash=H[len(self.coords)],
            cumulative_hash=H[0],
            digest=H[0],
            extras_digest=H[0],
            disposition="staged",
        )
        if failed:
            coords = coords.model_copy(
                update={"disposition": "capture_failed", "failure_reason": failed, "chain_hash": None}
            )
        self.coords[call_id] = coords
        self.events.append(admission)
        if staged:
            staged_coords = coords.call_coords().model_copy(update=tamper or {})
            self.events.append(
                StagedEvent(
                    coords=staged_coords, worker_id="w", staged_at=self.clock, response_id=response_id
                )
            )

    def seal(self, **kwargs: Any) -> None:
        self.events.append(
            RolloutSeal(rollout_id=self.rollout_id, status="completed", sealed_at=99.0, **kwargs)
        )


def consumed(events: list[Record], start: int = 0) -> list[Consumed]:
    return [Consumed("in", 0, start + i, envelope(e)) for i, e in enumerate(events)]


def run_ledger(events: list[Record], *, grace: float = 0.0) -> tuple[LedgerStage, RecordingSink]:
    sink = RecordingSink()
    stage = LedgerStage(sink, LedgerConfig(seal_grace_s=grace))

    async def go() -> None:
        await stage.handle(consumed(events))  # all written at log time 0
        await stage.tick(grace + 1)

    asyncio.run(go())
    return stage, sink


def receipt_of(sink: RecordingSink) -> RolloutReceipt:
    receipts = sink.payloads(RolloutReceipt)
    assert len(receipts) == 1
    return receipts[0]  # type: ignore[return-value]


def build(case: str) -> Rollout:
    r = Rollout()
    if case == "single_chain":
        r.call("a")
        r.call("b", "a")
        r.call("c", "b")
        r.seal()
    elif case == "abandoned_retry":  # b1 was retried as b2, which was extended
        r.call("a")
        r.call("b1", "a")
        r.call("b2", "a")
        r.call("c", "b2")
        r.seal()
    elif case == "retried_final_same_logical":
        r.call("a")
        r.call("b1", "a", logical="L")
        r.call("b2", "a", logical="L")
        r.seal()
    elif case == "two_extended_branches":
        r.call("a")
        r.call("b1", "a")
        r.call("c1", "b1")
        r.call("b2", "a")
        r.call("c2", "b2")
        r.seal()
    elif case == "two_leaves_no_logical":
        r.call("a")
        r.call("b1", "a")
        r.call("b2", "a")
        r.seal()
    elif case == "declared_present":
        r.call("a")
        r.call("b1", "a")
        r.call("b2", "a")
        r.seal(terminal_call_id="b1")
    elif case == "declared_missing":
        r.call("a")
        r.call("b", "a")
        r.seal(terminal_call_id="zz")
    elif case == "declared_by_response":
        r.call("a")
        r.call("b1", "a", response_id="resp-1")
        r.call("b2", "a")
        r.seal(terminal_response_id="resp-1")
    elif case == "failed_off_chain":
        r.call("a")
        r.call("x", "a", failed="staging_write_failed")
        r.call("b", "a")
        r.call("c", "b")
        r.seal()
    elif case == "failed_on_chain":
        r.call("a")
        r.call("b", "a", failed="prefix_hash_mismatch")
        r.seal(terminal_call_id="a")
        r.events.append(r.events.pop())  # seal stays last
    elif case == "failed_last_call":
        r.call("a")
        r.call("b", "a", failed="prefix_hash_mismatch")
        r.seal()
    elif case == "failed_attempt_then_retry":
        r.call("a")
        r.call("b1", "a", failed="invalid_delta")
        r.call("b2", "a")
        r.seal()
    elif case == "every_attempt_of_last_turn_failed":
        r.call("a")
        r.call("b1", "a", failed="invalid_delta")
        r.call("b2", "a", failed="invalid_delta")
        r.seal()
    elif case == "every_attempt_of_first_turn_failed":
        r.call("a1", failed="staging_timeout")
        r.call("a2", failed="staging_timeout")
        r.seal()
    elif case == "failed_parent_of_terminal":
        r.call("a")
        r.call("b", "a", failed="staging_timeout")
        r.coords["b"] = r.coords["b"].model_copy(
            update={"disposition": "staged", "failure_reason": None, "chain_hash": H[9]}
        )
        r.call("c", "b")
        r.seal()
    elif case == "orphan_parent":
        r.call("a")
        r.call("b", "a", staged=False)
        r.call("c", "b")
        r.seal()
        r.events = [e for e in r.events if not (isinstance(e, CaptureAdmission) and e.call_id == "b")]
    elif case == "cyclic_parents":
        r.call("a")
        r.call("b", "a")
        r.seal()
        r.events[1] = StagedEvent(
            coords=r.coords["a"].model_copy(
                update={"parent_call_id": "b", "mode": "token_in", "prev_len": 5, "cum_len": 10}
            ),
            worker_id="w",
            staged_at=1.0,
        )
    elif case == "no_calls":
        r.seal()
    elif case == "never_staged_on_chain":
        r.call("a")
        r.call("b", "a", staged=False)
        r.seal(terminal_call_id="b")
    elif case == "coords_mismatch":
        r.call("a")
        r.call("b", "a", tamper={"prev_len": 4, "cum_len": 9})
        r.seal()
    return r


TABLE = [
    ("single_chain", "c", "unique_leaf", None),
    ("abandoned_retry", "c", "unique_leaf", None),
    ("retried_final_same_logical", "b2", "unique_leaf", None),
    ("two_extended_branches", None, None, "ambiguous_terminal"),
    ("two_leaves_no_logical", None, None, "ambiguous_terminal"),
    ("declared_present", "b1", "declared", None),
    ("declared_missing", None, None, "declared_terminal_missing"),
    ("declared_by_response", "b1", "declared", None),
    ("failed_off_chain", "c", "unique_leaf", None),
    ("failed_on_chain", "a", "declared", None),
    ("failed_last_call", None, None, "prefix_hash_mismatch"),
    ("failed_attempt_then_retry", "b2", "unique_leaf", None),
    ("every_attempt_of_last_turn_failed", None, None, "invalid_delta"),
    ("every_attempt_of_first_turn_failed", None, None, "staging_timeout"),
    ("failed_parent_of_terminal", None, None, "staging_timeout"),
    ("orphan_parent", None, None, "unknown_admission"),
    ("cyclic_parents", None, None, "coords_mismatch"),
    ("no_calls", None, None, "no_calls"),
    ("never_staged_on_chain", None, None, "declared_terminal_missing"),
    ("coords_mismatch", None, None, "coords_mismatch"),
]


@pytest.mark.parametrize(("case", "terminal", "selection", "reason"), TABLE, ids=[t[0] for t in TABLE])
def test_terminal_selection(
    case: str, terminal: str | None, selection: str | None, reason: str | None
) -> None:
    _, sink = run_ledger(build(case).events)
    receipt = receipt_of(sink)
    assert receipt.terminal_call_id == terminal
    assert receipt.terminal_selection == selection
    assert (receipt.failure_reason.value if receipt.failure_reason else None) == reason
    assert receipt.capture_poisoned == (reason is not None)


def test_failed_off_chain_is_listed_not_poisoning() -> None:
    _, sink = run_ledger(build("failed_off_chain").events)
    receipt = receipt_of(sink)
    assert [f.call_id for f in receipt.failed_calls] == ["x"]
    assert {r.call_id for r in receipt.manifest} == {"a", "b", "c"}


def test_order_independent_and_duplicates_ignored() -> None:
    events = build("single_chain").events
    shuffled = [*reversed(events[:-1]), *events[:3], events[-1]]  # staged before admission, duplicates
    _, a = run_ledger(events)
    _, b = run_ledger(shuffled)
    assert receipt_of(a).model_dump(exclude={"manifest"}) == receipt_of(b).model_dump(exclude={"manifest"})
    assert [r.call_id for r in receipt_of(a).manifest] == [r.call_id for r in receipt_of(b).manifest]


def test_seal_waits_for_inflight_calls_then_never_staged() -> None:
    r = build("never_staged_on_chain")
    sink = RecordingSink()
    stage = LedgerStage(sink, LedgerConfig(seal_grace_s=5.0))

    async def go() -> None:
        await stage.handle(consumed(r.events))
        await stage.tick(4.0)
        assert sink.payloads(RolloutReceipt) == []  # still within grace (in log time)
        await stage.tick(6.0)

    asyncio.run(go())
    failed = [f for f in sink.payloads(FailedCall) if f.reason == "never_staged"]  # type: ignore[attr-defined]
    assert [f.call_id for f in failed] == ["b"]  # type: ignore[attr-defined]


def test_grace_runs_in_log_time_so_a_ledger_that_lags_decides_as_a_live_one() -> None:
    r = build("single_chain")
    seal, last_staged = r.events[-1], r.events[-2]
    early = [e for e in r.events if e is not last_staged and e is not seal]
    sink = RecordingSink()
    stage = LedgerStage(sink, LedgerConfig(seal_grace_s=5.0))

    async def go() -> None:
        # Written at log time 10 (the seal) and 12 (the last staged event), but read much
        # later, together, by a ledger back from an outage: the staged event was in time.
        await stage.handle([*consumed(early), Consumed("in", 0, 10, envelope(seal), 10.0)])
        await stage.tick(10.0)  # how far it has read: nothing expires
        await stage.handle([Consumed("in", 0, 11, envelope(last_staged), 12.0)])
        await stage.tick(1_000.0)

    asyncio.run(go())
    assert receipt_of(sink).capture_poisoned is False
    assert sink.payloads(FailedCall) == []


def test_call_records_published_as_they_join() -> None:
    _, sink = run_ledger(build("single_chain").events)
    assert [e.event_id for e in sink.events if isinstance(e.payload, CallRecord)] == [
        "com/r/a",
        "com/r/b",
        "com/r/c",
    ]
    assert sink.events[-1].event_id == "rcp/r"


def test_commit_point_keeps_open_rollouts_and_a_restart_replays_none_of_the_closed() -> None:
    sink = RecordingSink()
    stage = LedgerStage(sink, LedgerConfig(seal_grace_s=100))
    open_one, closed_one = build("single_chain"), Rollout("s")
    closed_one.call("a")
    open_events = open_one.events[:-1]  # no seal: stays open
    # interleave: s's admission, r's events, s's staged + seal
    events = [
        closed_one.events[0],
        *open_events,
        closed_one.events[1],
        RolloutSeal(rollout_id="s", status="completed", sealed_at=1.0),
    ]

    async def go() -> dict[Any, int]:
        await stage.handle(consumed(events))
        return dict(stage.committable({("in", 0): len(events)}))

    commit = asyncio.run(go())
    assert commit == {("in", 0): 1}  # r is open from offset 1; closed s does not hold it back
    assert len(sink.payloads(RolloutReceipt)) == 1

    # A restart replays from offset 1 and recalls s as receipted: r is rebuilt whole, s
    # (its later events replayed) changes nothing.
    restarted_sink = RecordingSink()
    restarted = LedgerStage(restarted_sink, LedgerConfig(seal_grace_s=0))
    restarted.answered.update(["s"])
    asyncio.run(restarted.handle(consumed([*events[1:], open_one.events[-1]], 1)))
    assert [r.rollout_id for r in restarted_sink.payloads(RolloutReceipt)] == ["r"]  # type: ignore[attr-defined]
    assert restarted.stats.late == 2


def test_overlapping_rollouts_under_sustained_load_let_the_commit_point_advance() -> None:
    sink = RecordingSink()
    stage = LedgerStage(sink, LedgerConfig(seal_grace_s=0))
    lanes = [Rollout(f"r{i}") for i in range(200)]
    for r in lanes:
        r.call("a")
        r.call("b", "a")
        r.seal()
    # Each rollout starts before the previous one ends: they all overlap in the log.
    events: list[Record] = []
    for i in range(len(lanes) + 1):
        if i < len(lanes):
            events += lanes[i].events[:3]
        if i:
            events += lanes[i - 1].events[3:]
    commits = []

    async def go() -> None:
        for start in range(0, len(events), 50):
            await stage.handle(consumed(events[start : start + 50], start))
            commits.append(stage.committable({("in", 0): start + 50})[("in", 0)])

    asyncio.run(go())
    assert commits == sorted(commits) and commits[-1] >= len(events) - 10
    assert len(stage.open) <= 1 and len(sink.payloads(RolloutReceipt)) >= 199


def test_finished_rollouts_leave_no_state() -> None:
    sink = RecordingSink()
    stage = LedgerStage(sink)

    async def go() -> None:
        offset = 0
        for i in range(2000):
            r = Rollout(f"r{i}")
            r.call("a")
            r.call("b", "a")
            r.seal()
            await stage.handle(consumed(r.events, offset))
            offset += len(r.events)
            stage.committable({("in", 0): offset})

    asyncio.run(go())
    assert stage.open == {} and stage._open_spans == {}
    assert stage.stats.receipts == 2000


def test_a_duplicate_after_the_commit_point_passed_is_late_not_a_new_rollout() -> None:
    r = build("single_chain")
    sink = RecordingSink()
    stage = LedgerStage(sink, LedgerConfig(seal_grace_s=0), remember=10)

    async def go() -> None:
        await stage.handle(consumed(r.events))
        stage.committable({("in", 0): len(r.events)})  # r is forgotten by offsets
        replayed = [*reversed(r.events[2:])]  # a partial segment, reordered
        await stage.handle(consumed(replayed, len(r.events)))
        await stage.tick(0)

    asyncio.run(go())
    assert len(sink.payloads(RolloutReceipt)) == 1
    assert stage.open == {} and stage.stats.late == len(r.events) - 2


def test_recalled_rollouts_are_late_after_a_restart() -> None:
    r = build("single_chain")
    sink = RecordingSink()
    stage = LedgerStage(sink, LedgerConfig(seal_grace_s=0))
    stage.answered.update(["r"])  # as read back from the committed topic on start
    asyncio.run(stage.handle(consumed(r.events[3:])))
    assert sink.payloads(RolloutReceipt) == [] and stage.open == {}


def test_wrong_event_type_is_dead_lettered() -> None:
    r = build("single_chain")
    receipt_events = run_ledger(r.events)[1].payloads(RolloutReceipt)
    stage, sink = run_ledger([*Rollout("q").events, receipt_events[0]])
    assert len(sink.payloads(DeadLetter)) == 1
    assert stage.stats.dead_letters == 1


@pytest.mark.slow
def test_hundred_thousand_finished_rollouts_leave_no_state() -> None:
    """Memory is per open rollout only: 100,000 finished rollouts leave nothing behind."""
    from bench.events import rollout_events

    sink = RecordingSink()
    stage = LedgerStage(sink)

    async def go() -> None:
        offset = 0
        for start in range(0, 100_000, 1_000):
            events = [e for r in range(start, start + 1_000) for e in rollout_events(f"r{r}", 1)]
            await stage.handle(consumed(events, offset))
            offset += len(events)
            stage.committable({("in", 0): offset})
            sink.events.clear()

    asyncio.run(go())
    assert stage.stats.receipts == 100_000
    assert stage.open == {} and stage._open_spans == {}
    assert len(stage.answered) == stage.answered.capacity  # bounded: ids only, oldest forgotten


def test_a_refused_event_is_dead_lettered_with_its_bytes_and_every_header_as_read() -> None:
    first = CaptureAdmission(rollout_id="r", call_id="c1", mode="text", prev_len=0, admitted_at=1.0)
    differing = first.model_copy(update={"group_id": "g"})
    value = b'{"as":"read from the log"}'
    headers = (("tt-type", b"admission"), ("tt-schema", b"3"), ("tt-event-id", b"adm/r/c1"), ("x", b"\xff"))
    read = Consumed("in", 2, 7, envelope(differing), raw=RawRecord("in", 2, 7, b"r", value, headers))
    sink = RecordingSink()
    stage = LedgerStage(sink)
    asyncio.run(stage.handle([*consumed([first]), read]))
    (letter,) = sink.payloads(DeadLetter)
    assert letter.field == "group_id" and letter.stage == "ledger" and letter.key == "r"
    assert (letter.source_topic, letter.source_partition, letter.source_offset) == ("in", 2, 7)
    assert base64.b64decode(letter.value_b64) == value  # the raw value, not a re-encoding
    assert letter.headers == {
        "tt-type": "admission",
        "tt-schema": "3",
        "tt-event-id": "adm/r/c1",
        "x": "\\xff",
    }


def test_a_refused_event_never_read_from_a_log_keeps_its_wire_form() -> None:
    first = CaptureAdmission(rollout_id="r", call_id="c1", mode="text", prev_len=0, admitted_at=1.0)
    differing = first.model_copy(update={"prev_len": 0, "group_id": "g"})
    sink = RecordingSink()
    asyncio.run(LedgerStage(sink).handle(consumed([first, differing])))
    (letter,) = sink.payloads(DeadLetter)
    key, value, headers = encode(envelope(differing))
    assert base64.b64decode(letter.value_b64) == value and letter.key == key.decode()
    assert letter.headers == {name: raw.decode() for name, raw in headers}
    assert "tt-schema" in letter.headers


@pytest.mark.parametrize(
    ("reason", "code", "staged"),
    [
        ("interrupted", "interrupted", True),
        ("interrupted", "interrupted", False),  # a call cut off mid-flight: still the run's stop
        ("driver gave up", "rollout_failed", True),
    ],
)
def test_a_rollout_sealed_failed_is_rejected_with_why(reason: str, code: str, staged: bool) -> None:
    r = Rollout()
    r.call("a", staged=staged)
    r.events.append(RolloutSeal(rollout_id="r", status="failed", failure_reason=reason, sealed_at=99.0))
    _, sink = run_ledger(r.events)
    (receipt,) = sink.payloads(RolloutReceipt)
    assert receipt.capture_poisoned and receipt.failure_reason == code


def test_an_admission_chain_that_does_not_continue_its_parents_is_demoted() -> None:
    """The ledger keeps no chain, only fingerprints, and still catches a forged one."""
    r = build("single_chain")
    index, forged = next(
        (i, e)
        for i, e in enumerate(r.events)
        if isinstance(e, CaptureAdmission) and e.staging_chain is not None and len(e.staging_chain) == 2
    )
    assert forged.staging_chain is not None
    r.events[index] = forged.model_copy(update={"staging_chain": ["r/elsewhere", forged.staging_chain[-1]]})
    _, sink = run_ledger(r.events)
    failed = [f for f in sink.payloads(FailedCall) if f.call_id == forged.call_id]  # type: ignore[attr-defined]
    assert [(f.reason, f.detail) for f in failed] == [("coords_mismatch", "does not continue parent")]  # type: ignore[attr-defined]


def test_a_late_call_is_dead_lettered_a_late_copy_counted() -> None:
    r = build("single_chain")
    stage, sink = run_ledger(r.events)
    assert len(sink.payloads(RolloutReceipt)) == 1
    late = Rollout("r")
    late.call("a")
    late.call("z", "a")  # a call the receipt never saw
    copy = next(e for e in r.events if isinstance(e, StagedEvent))  # one it accounts for
    asyncio.run(stage.handle(consumed([copy, *late.events[2:]], start=100)))
    letters = sink.payloads(DeadLetter)
    assert [(d.field, d.reason.split(":")[0]) for d in letters] == [  # type: ignore[attr-defined]
        ("call_id", "late"),
        ("coords.call_id", "late"),
    ]
    assert stage.stats.late == 1


def test_late_events_of_a_rollout_closed_before_a_restart_are_counted() -> None:
    r = build("single_chain")
    sink = RecordingSink()
    restarted = LedgerStage(sink, LedgerConfig(seal_grace_s=0))
    restarted.answered.add("r")  # recalled from the output topic: content unknown
    asyncio.run(restarted.handle(consumed(r.events)))
    assert sink.payloads(DeadLetter) == [] and restarted.stats.late == len(r.events)


def test_closed_rollouts_answer_for_their_calls_within_a_byte_budget() -> None:
    closed = ClosedRollouts(budget_bytes=2 * (ROLLOUT_OVERHEAD_BYTES + 8 * 3))
    for number in range(3):
        closed.add(f"r{number}", ["a", "b", "c"])
    assert len(closed) == 2 and closed.covers("r0", "a") is None  # the oldest went
    assert closed.covers("r2", "b") is True and closed.covers("r2", "z") is False


def build_tree(case: str) -> Rollout:
    """Rollouts for the multi-sample policies (DESIGN §4.4); the seal is added by the test."""
    r = Rollout()
    if case == "tree":  # a -> b1 -> c, a -> b2: b2 is a branch, or (terminal) an abandoned retry
        r.call("a")
        r.call("b1", "a")
        r.call("b2", "a")
        r.call("c", "b1")
    elif case == "rewritten":  # a -> b, then a new root x -> y
        r.call("a")
        r.call("b", "a")
        r.call("x")
        r.call("y", "x")
    elif case == "one_call_segment":  # a -> b, then a new root x nobody extended
        r.call("a")
        r.call("b", "a")
        r.call("x")
    elif case == "retried_by_logical_id":
        r.call("a")
        r.call("b1", "a", logical="L")
        r.call("b2", "a", logical="L")
    elif case == "failed_attempt_retried":
        r.call("a")
        r.call("b1", "a", failed="staging_timeout")
        r.call("b2", "a")
    elif case == "failed_root_continued":  # a failed call's continuation starts a new root
        r.call("a", failed="staging_timeout")
        r.call("x")
        r.call("y", "x")
    elif case == "failed_branch_end":  # the last call of one branch failed, the other is fine
        r.call("a")
        r.call("b1", "a")
        r.call("c1", "b1", failed="staging_timeout")
        r.call("b2", "a")
        r.call("c2", "b2")
    elif case == "every_chain_failed":
        r.call("a", failed="invalid_delta")
    return r


MULTI = [
    ("tree", "leaves", {"b2": "ok", "c": "ok"}, None),
    ("tree", "chains", {"c": "ok"}, None),
    ("rewritten", "leaves", {"b": "ok", "y": "ok"}, None),
    ("rewritten", "chains", {"b": "ok", "y": "ok"}, None),
    ("one_call_segment", "chains", {"b": "ok", "x": "ok"}, None),
    ("retried_by_logical_id", "leaves", {"b2": "ok"}, None),
    ("failed_attempt_retried", "leaves", {"b2": "ok"}, None),
    ("failed_root_continued", "chains", {"y": "ok"}, None),
    ("failed_branch_end", "leaves", {"c1": "staging_timeout", "c2": "ok"}, None),
    ("every_chain_failed", "leaves", {"a": "invalid_delta"}, "invalid_delta"),
]


@pytest.mark.parametrize(("case", "policy", "chains", "reason"), MULTI, ids=[f"{m[0]}-{m[1]}" for m in MULTI])
def test_multi_sample_chains(case: str, policy: str, chains: dict[str, str], reason: str | None) -> None:
    rollout = build_tree(case)
    rollout.seal(sample_policy=policy)
    receipt = receipt_of(run_ledger(rollout.events)[1])
    got = {c.leaf_call_id: (c.failure_reason.value if c.failure_reason else "ok") for c in receipt.chains}
    assert got == chains
    assert receipt.terminal_call_id is None and receipt.sample_policy == policy
    assert (receipt.failure_reason.value if receipt.failure_reason else None) == reason
    assert receipt.capture_poisoned == (reason is not None)
    for chain in receipt.chains:  # each sample must hash to its own leaf's cumulative hash
        if chain.cumulative_hash is not None:
            assert chain.cumulative_hash == rollout.coords[chain.leaf_call_id].cumulative_hash


@pytest.mark.parametrize("history", ["render", "exact"])
def test_a_render_policy_child_staged_as_a_root_starts_a_segment(history: str) -> None:
    """Under ``render`` a child whose render did not extend its parent is staged as a root:
    the ledger takes it as one, and its own child continues it. Under ``exact`` the same
    staged event contradicts its admission."""
    rollout = Rollout()
    rollout.call("a", history=history)
    rollout.call("b", "a", history=history)
    rollout.call("c", "b", history=history, segment=True)
    rollout.call("d", "c", history=history)
    rollout.seal(sample_policy="chains")
    receipt = receipt_of(run_ledger(rollout.events)[1])
    chains = {c.leaf_call_id: (c.failure_reason.value if c.failure_reason else "ok") for c in receipt.chains}
    if history == "render":
        assert chains == {"b": "ok", "d": "ok"}
        parents = {entry.call_id: entry.parent_call_id for entry in receipt.manifest}
        assert parents == {"a": None, "b": "a", "c": None, "d": "c"}
    else:
        assert [(f.call_id, f.reason.value) for f in receipt.failed_calls] == [("c", "coords_mismatch")]
        assert chains == {"d": "coords_mismatch"}  # c's failure poisons the only chain


def test_a_child_of_a_new_segment_must_continue_the_segment_not_the_old_chain() -> None:
    rollout = Rollout()
    rollout.call("a", history="render")
    rollout.call("b", "a", history="render", segment=True)
    stale = rollout.coords["b"].model_copy(update={"staging_chain": ["r/a", "r/b"]})
    rollout.coords["b"] = stale  # the child is admitted under the chain the admission named
    rollout.call("c", "b", history="render")
    rollout.seal(sample_policy="chains")
    receipt = receipt_of(run_ledger(rollout.events)[1])
    assert [(f.call_id, f.reason.value) for f in receipt.failed_calls] == [("c", "coords_mismatch")]


def test_chains_are_listed_in_the_order_their_leaves_were_admitted() -> None:
    rollout = Rollout()
    rollout.call("z")
    rollout.call("a")
    rollout.seal(sample_policy="leaves")
    assert [c.leaf_call_id for c in receipt_of(run_ledger(rollout.events)[1]).chains] == ["z", "a"]


def test_the_same_tree_is_ambiguous_under_terminal() -> None:
    rollout = build_tree("rewritten")
    rollout.seal()
    receipt = receipt_of(run_ledger(rollout.events)[1])
    assert receipt.failure_reason == "ambiguous_terminal" and receipt.chains == []


def test_a_failed_seal_gives_no_chain_under_any_policy() -> None:
    rollout = build_tree("tree")
    rollout.events.append(
        RolloutSeal(
            rollout_id="r", status="failed", failure_reason="env", sealed_at=99.0, sample_policy="leaves"
        )
    )
    receipt = receipt_of(run_ledger(rollout.events)[1])
    assert (receipt.failure_reason, receipt.chains, receipt.capture_poisoned) == ("rollout_failed", [], True)


def test_closed_rollouts_leave_no_deadlines_behind() -> None:
    """A closed rollout's deadlines (its ``max_open_s`` one lives an hour by default) are
    dropped from the timers, so they hold a multiple of the open rollouts, not an hour of
    finished ones."""
    sink = RecordingSink()
    stage = LedgerStage(sink, LedgerConfig(seal_grace_s=0.5, max_open_s=3600), remember=100)

    async def go() -> None:
        offset = 0
        for i in range(3000):
            r = Rollout(f"r{i}")
            r.call("a")
            r.seal()
            await stage.handle([c._replace(timestamp=float(i)) for c in consumed(r.events, offset)])
            offset += len(r.events)
            sink.events.clear()

    asyncio.run(go())
    assert stage.stats.receipts == 3000 and stage.open == {}
    assert stage._timers.entries() <= 4 * TIMERS_COMPACT_AT_LEAST


def test_timers_drop_cancelled_entries_and_keep_live_ones() -> None:
    timers = TaskTimers()
    for i in range(400):
        timers.schedule(0, 1000.0 + i, f"r{i}")
    for i in range(0, 400, 2):
        timers.cancel(0, f"r{i}")
    assert timers.entries() <= 200 + 200 // 4  # the cancelled beyond the last rebuild
    timers.schedule(0, 5.0, "r0")  # opened again: live once more
    due = timers.advance(0, 2000.0)
    assert due[0] == "r0" and {f"r{i}" for i in range(1, 400, 2)} <= set(due)
