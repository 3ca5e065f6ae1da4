"""Capture core logic on in-memory ports (the same flows run against the real broker and
TransferQueue in tests/integration/test_capture_real.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from stages.capture.cache import ChainCache, ChainLink
from stages.capture.core import AckPolicy, CaptureCore, PreparedCall, capture_row
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.memory import MemoryDataPlane, RecordingSink
from topics import digest
from topics.records import CommitCoords, StagedCall, StagedEvent
from topics.wire import strip_token_fields


class Worker:
    def __init__(
        self,
        data_plane: MemoryDataPlane,
        sink: RecordingSink,
        *,
        wait_s: float = 0.3,
        policy: AckPolicy = AckPolicy.STAGED,
        max_queue: int = 64,
    ) -> None:
        self.cache = ChainCache()
        self.writer = StagingWriter(data_plane, sink, worker_id="w", max_queue=max_queue, batch_delay_s=0.001)
        self.core = CaptureCore(
            PrefixResolver(data_plane, self.cache, wait_s=wait_s, poll_s=0.01),
            self.writer,
            self.cache,
            ack_policy=policy,
        )


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def three_turns(worker: Worker, client: RolloutClient) -> tuple[list[int], list[Any]]:
    """Three calls; each prompt extends the previous conversation by 3 template tokens."""
    worker.writer.start()
    seen: list[int] = []
    coords = None
    out = []
    for turn in range(3):
        admission = client.admit("r1", coords)
        prepared = await worker.core.prepare(admission)
        prompt = [*seen, 100 + turn, 101, 102]
        generated = [10 * turn + 1, 10 * turn + 2]
        completion = worker.core.complete(prepared, prompt, generated, [-0.5, -0.25], weight_version=turn)
        coords = await completion.final_coords()
        out.append(coords)
        seen = prompt + generated
    await worker.writer.stop()
    return seen, out


def test_three_turn_rows_concatenate_to_engine_ids() -> None:
    data_plane, sink = MemoryDataPlane(), RecordingSink()
    seen, coords = run(three_turns(Worker(data_plane, sink), RolloutClient(sink)))
    rows = [data_plane.calls[c.staging_key] for c in coords]
    assert [t for r in rows for t in r.token_ids_delta] == seen
    assert [r.prev_len for r in rows] == [0, 5, 10]
    assert rows[1].token_mask_delta == [0.0, 0.0, 0.0, 1.0, 1.0]
    assert rows[2].cumulative_hash == digest.cumulative_hash(seen)
    assert rows[2].chain_hash == digest.chain_hash(
        digest.chain_hash(digest.chain_hash(None, rows[0].token_ids_delta), rows[1].token_ids_delta),
        rows[2].token_ids_delta,
    )
    assert all(c.disposition == "staged" for c in coords)
    assert all(
        CommitCoords.model_validate(c.model_dump()) == c for c in coords
    )  # built unvalidated, yet valid
    assert len(sink.payloads(StagedEvent)) == 3


def test_child_resolves_from_cache_while_parent_is_queued() -> None:
    async def go() -> None:
        data_plane, sink = MemoryDataPlane(), RecordingSink()
        worker = Worker(data_plane, sink, policy=AckPolicy.ENQUEUED)  # writer not started: rows stay queued
        client = RolloutClient(sink)
        parent = worker.core.complete(
            await worker.core.prepare(client.admit("r1")), [1, 2], [3], [-1.0], weight_version=0
        ).coords
        assert data_plane.calls == {}
        prepared = await worker.core.prepare(client.admit("r1", parent))
        assert prepared.failure is None and prepared.prefix_ids.tolist() == [1, 2, 3]

    run(go())


def test_child_on_other_worker_waits_for_row_then_resolves() -> None:
    async def go() -> None:
        data_plane, sink = MemoryDataPlane(), RecordingSink()
        first, second = (
            Worker(data_plane, sink, policy=AckPolicy.ENQUEUED),
            Worker(data_plane, sink, wait_s=2.0),
        )
        client = RolloutClient(sink)
        parent = first.core.complete(
            await first.core.prepare(client.admit("r1")), [1, 2], [3], [-1.0], weight_version=0
        ).coords
        pending = asyncio.create_task(second.core.prepare(client.admit("r1", parent)))
        await asyncio.sleep(0.1)
        assert not pending.done()
        first.writer.start()
        prepared = await pending
        await first.writer.stop()
        assert prepared.failure is None and prepared.prefix_ids.tolist() == [1, 2, 3]

    run(go())


def test_missing_parent_past_bound_is_prefix_unavailable() -> None:
    async def go() -> None:
        data_plane, sink = MemoryDataPlane(), RecordingSink()
        first, second = (
            Worker(data_plane, sink, policy=AckPolicy.ENQUEUED),
            Worker(data_plane, sink, wait_s=0.1),
        )
        client = RolloutClient(sink)
        parent = first.core.complete(
            await first.core.prepare(client.admit("r1")), [1, 2], [3], [-1.0], weight_version=0
        ).coords
        prepared = await second.core.prepare(client.admit("r1", parent))
        assert prepared.failure is not None and prepared.failure.code == "prefix_unavailable"
        second.writer.start()
        completion = second.core.complete(prepared, [1, 2, 3, 4], [5], [-1.0], weight_version=0)
        coords = await completion.final_coords()
        await second.writer.stop()
        assert coords.disposition == "capture_failed" and coords.failure_reason == "prefix_unavailable"
        assert sink.payloads(StagedEvent)[-1].coords == coords.call_coords()  # type: ignore[attr-defined]

    run(go())


def test_tampered_parent_row_is_prefix_hash_mismatch() -> None:
    async def go() -> None:
        data_plane, sink = MemoryDataPlane(), RecordingSink()
        first, second = Worker(data_plane, sink), Worker(data_plane, sink)
        client = RolloutClient(sink)
        first.writer.start()
        done = first.core.complete(
            await first.core.prepare(client.admit("r1")), [1, 2], [3], [-1.0], weight_version=0
        )
        parent = await done.final_coords()
        row = data_plane.calls[parent.staging_key]
        data_plane.calls[parent.staging_key] = row.model_copy(update={"token_ids_delta": [1, 9, 3]})
        prepared = await second.core.prepare(client.admit("r1", parent))
        await first.writer.stop()
        assert prepared.failure is not None and prepared.failure.code == "prefix_hash_mismatch"

    run(go())


def test_wrong_parent_hash_in_admission_is_mismatch() -> None:
    async def go() -> None:
        data_plane, sink = MemoryDataPlane(), RecordingSink()
        worker = Worker(data_plane, sink, policy=AckPolicy.ENQUEUED)
        client = RolloutClient(sink)
        parent = worker.core.complete(
            await worker.core.prepare(client.admit("r1")), [1, 2], [3], [-1.0], weight_version=0
        ).coords
        forged = parent.model_copy(update={"chain_hash": "0" * 64})
        prepared = await worker.core.prepare(client.admit("r1", forged))
        assert prepared.failure is not None and prepared.failure.code == "prefix_hash_mismatch"

    run(go())


def test_dead_data_plane_gives_failed_events_and_hook_returns_at_once() -> None:
    async def go() -> None:
        data_plane, sink = MemoryDataPlane(), RecordingSink()
        data_plane.broken = True
        worker = Worker(data_plane, sink)
        worker.writer.start()
        completion = worker.core.complete(
            await worker.core.prepare(RolloutClient(sink).admit("r1")), [1, 2], [3], [-1.0], weight_version=0
        )
        assert completion.coords.disposition == "staged"  # returned before any I/O
        final = await completion.final_coords()
        await worker.writer.stop()
        assert final.failure_reason == "staging_write_failed"
        assert worker.writer.stats.failed["staging_write_failed"] == 1
        assert worker.cache.get(final.staging_key) is None

    run(go())


def test_full_queue_fails_call_without_blocking() -> None:
    async def go() -> None:
        data_plane, sink = MemoryDataPlane(), RecordingSink()
        worker = Worker(data_plane, sink, policy=AckPolicy.ENQUEUED, max_queue=1)
        client = RolloutClient(sink)
        results = [
            worker.core.complete(
                await worker.core.prepare(client.admit(f"r{i}")), [1], [2], [-1.0], weight_version=0
            ).coords
            for i in range(3)
        ]
        assert [c.disposition for c in results] == ["staged", "capture_failed", "capture_failed"]
        assert worker.writer.stats.queue_full == 2
        worker.writer.start()
        await worker.writer.stop()
        assert len(sink.payloads(StagedEvent)) == 3  # nothing dropped silently

    run(go())


@pytest.mark.parametrize(
    "generated, logprobs", [([], []), ([3], [float("nan")]), ([-3], [-1.0]), ([3], [-1e39])]
)
def test_invalid_delta_is_capture_failed(generated: list[int], logprobs: list[float]) -> None:
    async def go() -> None:
        data_plane, sink = MemoryDataPlane(), RecordingSink()
        worker = Worker(data_plane, sink, policy=AckPolicy.ENQUEUED)
        prepared = await worker.core.prepare(RolloutClient(sink).admit("r1"))
        coords = worker.core.complete(prepared, [1, 2], generated, logprobs, weight_version=0).coords
        assert coords.failure_reason == "invalid_delta"

    run(go())


@pytest.mark.parametrize("extras", [None, {"weight_version_spans": [[0, 1], [1, 2]]}])
def test_captured_coords_document_is_what_pydantic_would_dump(extras: dict[str, Any] | None) -> None:
    """The hook writes the reply's coords without pydantic; they must be the record's dump."""
    admission = RolloutClient(RecordingSink()).admit("r1")
    root = capture_row(
        PreparedCall(admission, np.zeros(0, dtype=np.int64), None),
        [1, 2],
        [3, 4],
        [-0.5, -0.25],
        weight_version=1,
    )
    prepared = PreparedCall(
        RolloutClient(RecordingSink()).admit("r1", root.coords()), root.row.token_ids, root.row.chain_hash
    )
    child = capture_row(
        prepared,
        np.array([1, 2, 3, 4, 9]),
        np.array([7, 8]),
        np.array([-1.5, -2.0]),
        weight_version=2,
        extras=extras,
    )
    for captured in (root, child):
        document = captured.coords_document()
        validated = CommitCoords.model_validate(document, strict=False)
        assert validated.model_dump(mode="json") == document
        assert captured.coords() == validated
        row = captured.row.record()
        assert StagedCall.model_validate(row.model_dump()) == row  # the arrays make a valid row
        assert digest.call_digest(row.model_dump(exclude={"digest"})) == row.digest
    assert child.coords().staging_chain == ["r1/" + root.row.call_id, "r1/" + child.row.call_id]


def test_prompt_not_starting_with_prefix_is_splice_failure() -> None:
    async def go() -> None:
        data_plane, sink = MemoryDataPlane(), RecordingSink()
        worker = Worker(data_plane, sink, policy=AckPolicy.ENQUEUED)
        client = RolloutClient(sink)
        parent = worker.core.complete(
            await worker.core.prepare(client.admit("r1")), [1, 2], [3], [-1.0], weight_version=0
        ).coords
        prepared = await worker.core.prepare(client.admit("r1", parent))
        coords = worker.core.complete(prepared, [1, 2, 4, 5], [6], [-1.0], weight_version=0).coords
        assert coords.failure_reason == "prefix_splice_failed"

    run(go())


def test_under_render_a_prompt_not_extending_the_parent_stages_a_new_root() -> None:
    """``history: render``: the row is a root of the rollout (its own prompt, no parent),
    while a prompt that does extend the parent stays its child."""

    async def go() -> None:
        data_plane, sink = MemoryDataPlane(), RecordingSink()
        worker = Worker(data_plane, sink, policy=AckPolicy.ENQUEUED)
        client = RolloutClient(sink)
        parent = worker.core.complete(
            await worker.core.prepare(client.admit("r1", history="render")),
            [1, 2],
            [3],
            [-1.0],
            weight_version=0,
        ).coords
        rewritten = await worker.core.prepare(client.admit("r1", parent, history="render"))
        root = worker.core.complete(rewritten, [1, 2, 4, 5], [6], [-1.0], weight_version=0).coords
        assert (root.disposition, root.parent_call_id, root.mode, root.prev_len) == (
            "staged",
            None,
            "text",
            0,
        )
        assert root.staging_chain == [root.staging_key] and root.cum_len == 5
        assert root.chain_hash == digest.chain_hash(None, [1, 2, 4, 5, 6])
        extended = await worker.core.prepare(client.admit("r1", root, history="render"))
        child = worker.core.complete(extended, [1, 2, 4, 5, 6, 7], [8], [-1.0], weight_version=0).coords
        assert (child.parent_call_id, child.prev_len) == (root.call_id, 5)

    run(go())


def test_cache_is_bounded_by_bytes() -> None:
    cache = ChainCache(max_bytes=3 * (8 * 100 + 160))
    for i in range(10):
        cache.put(ChainLink(f"r/c{i}", np.zeros(100, dtype=np.int64), "0" * 64, 100))
    assert len(cache) == 3 and cache.nbytes <= cache.max_bytes
    assert [link.key for link in cache.cached_prefix(["r/c7", "r/c8", "r/c9"])] == ["r/c7", "r/c8", "r/c9"]
    assert cache.cached_prefix(["r/c0", "r/c9"]) == []


def test_a_finalized_rollouts_links_are_forgotten_and_only_its() -> None:
    cache = ChainCache(max_bytes=4 * (8 * 10 + 160))
    for key in ("r/c0", "q/c0", "r/c1", "q/c1"):
        cache.put(ChainLink(key, np.zeros(10, dtype=np.int64), "0" * 64, 10))
    cache.forget_rollout("r")
    assert [link.key for link in cache.cached_prefix(["q/c0", "q/c1"])] == ["q/c0", "q/c1"]
    assert len(cache) == 2 and cache.nbytes == 2 * (8 * 10 + 160)
    cache.put(ChainLink("p/c0", np.zeros(30, dtype=np.int64), "0" * 64, 30))  # evicts q's links
    cache.forget_rollout("q")  # evicted already: nothing left to drop, nothing broken
    cache.forget_rollout("p")
    assert len(cache) == 0 and cache.nbytes == 0


def test_client_admission_and_stripping() -> None:
    sink = RecordingSink()
    client = RolloutClient(sink)
    root = client.admit("r1", group_id="g")
    assert root.mode == "text" and root.staging_chain is None
    assert client.new_call_id() != client.new_call_id()
    reply = {
        "choices": [{"message": {"content": "hi"}, "logprobs": [1], "token_ids": [1]}],
        "prompt_token_ids": [1],
    }
    assert strip_token_fields(reply) == {"choices": [{"message": {"content": "hi"}}]}
