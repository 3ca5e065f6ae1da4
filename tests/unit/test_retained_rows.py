"""A worker's held rows: bounded, released when finalized, late rows handed back to delete;
with its cached links, nothing of a finalized rollout stays."""

from __future__ import annotations

import asyncio

import numpy as np

from stages.capture.cache import ChainCache
from stages.capture.core import AckPolicy, CaptureCore, CapturedRow, PreparedCall, capture_row
from stages.capture.resolve import PrefixResolver
from stages.capture.retain import RetainedRows, row_bytes
from stages.capture.writer import PendingCall, StagingWriter
from stages.client import RolloutClient
from stages.memory import MemoryDataPlane, RecordingSink
from topics.records import CaptureAdmission, StagedCall


def captured(rollout: str, call: str, tokens: int = 4) -> CapturedRow:
    admission = CaptureAdmission(rollout_id=rollout, call_id=call, mode="text", prev_len=0, admitted_at=1.0)
    prepared = PreparedCall(admission, np.zeros(0, dtype=np.int64), None)
    return capture_row(prepared, [1, 2], list(range(3, 3 + tokens)), [-0.5] * tokens, weight_version=0)


def row(rollout: str, call: str, tokens: int = 4) -> StagedCall:
    return captured(rollout, call, tokens).row


def test_rows_are_held_until_their_rollout_is_finalized_then_handed_back() -> None:
    held = RetainedRows()
    assert held.add([row("r", "c0"), row("r", "c1"), row("q", "c0")]) == []
    assert len(held) == 3
    assert held.release("r") == ["r/c0", "r/c1"]  # to delete: a later copy may outlive the finalizer's
    assert [r.staging_key for r in held.held()] == ["q/c0"]
    assert held.add([row("r", "c2")]) == ["r/c2"]  # written after its rollout's outcome: late
    assert held.stats.late == 1 and len(held) == 1


def test_over_the_budget_the_oldest_rows_go_and_are_counted() -> None:
    first = row("r", "c0")
    held = RetainedRows(budget_bytes=2 * row_bytes(first))
    held.add([first, row("r", "c1"), row("q", "c0")])
    assert [r.staging_key for r in held.held()] == ["r/c1", "q/c0"]
    assert held.stats.over_budget == 1 and held.stats.held_bytes <= held.budget_bytes


def test_a_row_written_again_is_held_in_its_latest_version() -> None:
    held = RetainedRows()
    original = row("r", "c0")
    held.add([original])
    rewritten = row("r", "c0", tokens=6)
    held.add([rewritten])
    assert held.held() == [rewritten] and held.stats.held_bytes == row_bytes(rewritten)


def test_the_writer_holds_what_it_staged_deletes_late_rows_and_stages_again() -> None:
    async def go() -> tuple[MemoryDataPlane, MemoryDataPlane, StagingWriter]:
        plane, restarted = MemoryDataPlane(), MemoryDataPlane()
        writer = StagingWriter(plane, RecordingSink(), worker_id="w", retained=RetainedRows())
        assert writer.retained is not None
        writer.retained.release("done")  # finalized before its last row is written
        writer.start()
        for late_or_not in (captured("r", "c0"), captured("done", "c9")):
            assert writer.submit(PendingCall(late_or_not.coords(), late_or_not.row))
        await writer.stop()
        assert await writer.restage(restarted) == 1
        return plane, restarted, writer

    plane, restarted, writer = asyncio.run(go())
    assert set(plane.calls) == {"r/c0"}  # the late row was deleted again at once
    assert set(restarted.calls) == {"r/c0"} and writer.retained is not None
    assert writer.retained.stats.restaged == 1 and writer.retained.stats.late == 1


def test_a_worker_holds_nothing_of_its_rollouts_once_they_are_finalized() -> None:
    """Rows and chain links are kept for the rollouts in flight only: kept per rollout
    served, they grew with every rollout of a long run (about 2 KB each)."""
    rollouts, turns = 40, 3

    async def go() -> tuple[int, int, list[list[str]], CaptureCore]:
        plane, sink = MemoryDataPlane(), RecordingSink()
        cache = ChainCache()
        writer = StagingWriter(
            plane, sink, worker_id="w", batch_delay_s=0.001, retained=RetainedRows(remember=5)
        )
        core = CaptureCore(PrefixResolver(plane, cache), writer, cache, ack_policy=AckPolicy.ENQUEUED)
        client = RolloutClient(sink)
        writer.start()
        for number in range(rollouts):
            coords, seen = None, []
            for turn in range(turns):
                prepared = await core.prepare(client.admit(f"r{number}", coords, call_id=f"c{turn}"))
                prompt = [*seen, 7, 8]
                coords = core.complete(
                    prepared, prompt, [9, 10 + turn], [-0.5, -0.5], weight_version=0
                ).coords
                assert coords.disposition == "staged"
                seen = [*prompt, 9, 10 + turn]
        await writer.stop()
        assert writer.retained is not None
        held, linked = len(writer.retained), len(cache)
        released = [core.finalized(f"r{number}") for number in range(rollouts)]
        return held, linked, released, core

    held, linked, released, core = asyncio.run(go())
    assert held == linked == rollouts * turns  # in flight: every row and link is kept
    assert released[3] == ["r3/c0", "r3/c1", "r3/c2"]  # handed back, to delete
    retained = core.writer.retained
    assert retained is not None and len(retained) == 0 and retained.stats.held_bytes == 0
    assert len(core.cache) == 0 and core.cache.nbytes == 0
