"""Finalizer: every rejection code from exactly one corruption, linearization, idempotence."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from stages.capture.cache import ChainCache
from stages.capture.core import CaptureCore
from stages.capture.resolve import PrefixResolver
from stages.capture.writer import StagingWriter
from stages.client import RolloutClient
from stages.finalize.reader import FinalizedRollout, GroupCollector
from stages.finalize.retain import OwnerProgress, RetainedSamples
from stages.finalize.stage import FinalizerStage
from stages.finalize.verify import MixedVersionPolicy
from stages.ledger.stage import LedgerConfig, LedgerStage
from stages.memory import MemoryDataPlane, RecordingSink
from stages.ports import Consumed
from topics import digest
from topics.events import envelope
from topics.records import (
    EXTRAS_WEIGHT_SPANS,
    CaptureAdmission,
    FinalizedEvent,
    Record,
    RolloutReceipt,
    RolloutSeal,
    StagedCall,
    StagedCallBody,
    staging_key,
)
from topics.sampling import EXTRAS_SAMPLING


async def captured_rollout(
    data_plane: MemoryDataPlane,
    *,
    versions: tuple[int, int, int] = (0, 0, 0),
    dead_branch: bool = True,
    rollout_id: str = "r1",
    extras: dict[str, Any] | None = None,
) -> tuple[list[Record], list[int], list[float]]:
    """A real 3-turn capture (plus an abandoned retry) through the capture core; returns driver+worker events."""
    sink = RecordingSink()
    cache = ChainCache()
    writer = StagingWriter(data_plane, sink, worker_id="w", batch_delay_s=0.0)
    core = CaptureCore(PrefixResolver(data_plane, cache), writer, cache)
    client = RolloutClient(sink)
    writer.start()
    seen: list[int] = []
    lps: list[float] = []
    coords = None
    for turn in range(3):
        admission = client.admit(rollout_id, coords, group_id="g")
        await client.publish_admission(admission)
        prepared = await core.prepare(admission)
        prompt = [*seen, 100 + turn, 101]
        if dead_branch and turn == 1:  # an attempt the driver abandons
            retry = client.admit(rollout_id, coords, group_id="g")
            await client.publish_admission(retry)
            await core.complete(
                await core.prepare(retry), prompt, [55], [-3.0], weight_version=versions[turn]
            ).final_coords()
        gen = [10 * turn + 1, 10 * turn + 2]
        lp = [-0.5, -0.125]
        completion = core.complete(
            prepared, prompt, gen, lp, weight_version=versions[turn], extras=extras if turn == 2 else None
        )
        coords = await completion.final_coords()
        seen = prompt + gen
        lps += [0.0, 0.0, *lp]
    await client.seal(rollout_id, group_id="g", reward=1.0)
    await writer.stop()
    return [e.payload for e in sink.events], seen, lps


def run_stages(
    events: list[Record],
    data_plane: MemoryDataPlane,
    *,
    policy: MixedVersionPolicy = MixedVersionPolicy.ALLOW,
    tamper: Any = None,
    all_or_nothing: bool = False,
    retained: RetainedSamples | None = None,
    final_out: RecordingSink | None = None,
) -> tuple[FinalizedEvent, RecordingSink, FinalizerStage]:
    async def go() -> tuple[FinalizedEvent, RecordingSink, FinalizerStage]:
        ledger_out = RecordingSink()
        ledger = LedgerStage(ledger_out, LedgerConfig(seal_grace_s=0))
        await ledger.handle([Consumed("in", 0, i, envelope(e)) for i, e in enumerate(events)])
        receipt = ledger_out.payloads(RolloutReceipt)[0]
        if tamper is not None:
            receipt = tamper(receipt) or receipt
        out = final_out or RecordingSink()
        finalizer = FinalizerStage(
            data_plane, out, policy=policy, all_or_nothing=all_or_nothing, retained=retained
        )
        await finalizer.handle([Consumed("c", 0, 0, envelope(receipt))])
        return out.payloads(FinalizedEvent)[0], out, finalizer  # type: ignore[return-value]

    return asyncio.run(go())


def test_linearization_of_three_turns_with_dead_branch() -> None:
    data_plane = MemoryDataPlane()
    events, seen, lps = asyncio.run(captured_rollout(data_plane))
    event, _, _ = run_stages(events, data_plane)
    assert event.status == "accepted" and event.call_count == 3
    sample = data_plane.samples["r1"]
    assert sample.token_ids == seen == [100, 101, 1, 2, 101, 101, 11, 12, 102, 101, 21, 22]
    assert sample.token_mask == [0.0, 0.0, 1.0, 1.0] * 3
    assert sample.logprobs == lps
    assert [(s.start, s.carry_len, s.gen_len) for s in sample.spans] == [(0, 2, 2), (4, 2, 2), (8, 2, 2)]
    assert (event.prompt_len, event.total_len, event.generated_tokens) == (2, 12, 6)
    assert data_plane.calls == {}  # staging rows gone, the dead branch's too


def tamper_row(data_plane: MemoryDataPlane, key: str, redigest: bool = False, **changes: Any) -> None:
    row = data_plane.calls[key]
    fields = {**row.model_dump(), **changes}
    if redigest:
        body = StagedCallBody.model_construct(**{k: v for k, v in fields.items() if k != "digest"})
        fields["digest"] = digest.digest_of_body(body)
    data_plane.calls[key] = StagedCall.model_construct(**fields)


def middle_key(events: list[Record]) -> str:
    admissions = [e for e in events if isinstance(e, CaptureAdmission)]
    return admissions[1].staging_key  # the call of turn 2 on the terminal chain


CORRUPTIONS = {
    "missing_row": lambda dp, k: dp.calls.pop(k),
    "digest_mismatch": lambda dp, k: tamper_row(
        dp, k, token_ids_delta=[*dp.calls[k].token_ids_delta[:-1], 999]
    ),
    "digest_mismatch_logprob": lambda dp, k: tamper_row(
        dp, k, logprobs_delta=[*dp.calls[k].logprobs_delta[:-1], -0.25]
    ),
    "length_mismatch": lambda dp, k: tamper_row(dp, k, prev_len=dp.calls[k].prev_len + 1),
    "invalid_mask": lambda dp, k: tamper_row(dp, k, token_mask_delta=[0.0, 1.0, 0.0, 1.0]),
    "row_identity_mismatch": lambda dp, k: tamper_row(dp, k, rollout_id="r2"),
    "empty_generation": lambda dp, k: tamper_row(dp, k, token_mask_delta=[0.0] * 4, logprobs_delta=[0.0] * 4),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_each_corruption_has_its_code(corruption: str) -> None:
    data_plane = MemoryDataPlane()
    events, _, _ = asyncio.run(captured_rollout(data_plane))
    CORRUPTIONS[corruption](data_plane, middle_key(events))
    event, _, _ = run_stages(events, data_plane)
    assert event.status == "rejected"
    assert event.rejection_reason == corruption.removesuffix("_logprob")
    assert "r1" not in data_plane.samples


@pytest.mark.parametrize("earlier", sorted(CORRUPTIONS))
@pytest.mark.parametrize("later", sorted(set(CORRUPTIONS) - {"missing_row"}))
def test_the_earliest_corrupted_row_of_a_chain_names_the_code(earlier: str, later: str) -> None:
    """Rows are checked as one array per field, yet the code is the first row's, as if
    each row were checked alone in chain order, whatever the later row's corruption.
    (A missing row anywhere is looked for first, among the stored samples.)"""
    data_plane = MemoryDataPlane()
    events, _, _ = asyncio.run(captured_rollout(data_plane, dead_branch=False))
    _, second, third = (e.staging_key for e in events if isinstance(e, CaptureAdmission))
    CORRUPTIONS[later](data_plane, third)
    CORRUPTIONS[earlier](data_plane, second)
    event, _, _ = run_stages(events, data_plane)
    assert event.rejection_reason == earlier.removesuffix("_logprob")


@pytest.mark.parametrize("field", ["chain_hash", "cumulative_hash"])
def test_hash_written_wrong_at_the_source(field: str) -> None:
    """The worker computed a wrong hash and digested it: only the recomputation catches it."""
    data_plane = MemoryDataPlane()
    events, _, _ = asyncio.run(captured_rollout(data_plane, dead_branch=False))
    last = [e for e in events if isinstance(e, CaptureAdmission)][-1].staging_key
    tamper_row(data_plane, last, redigest=True, **{field: "1" * 64})

    def same_in_receipt(receipt: RolloutReceipt) -> RolloutReceipt:
        """The ledger took the wrong hash from the worker's coords, as it would (the
        terminal's cumulative hash travels on the receipt itself)."""
        wrong = {"digest": data_plane.calls[last].digest}
        if field == "chain_hash":
            wrong["chain_hash"] = "1" * 64
        manifest = [
            e.model_copy(update=wrong) if staging_key(receipt.rollout_id, e.call_id) == last else e
            for e in receipt.manifest
        ]
        update: dict[str, object] = {"manifest": manifest}
        if field == "cumulative_hash":
            update["terminal_cumulative_hash"] = "1" * 64
        return receipt.model_copy(update=update)

    event, _, _ = run_stages(events, data_plane, tamper=same_in_receipt)
    assert event.rejection_reason == f"{field}_mismatch"


def test_mixed_versions_allowed_or_rejected() -> None:
    for policy, expected in ((MixedVersionPolicy.ALLOW, "accepted"), (MixedVersionPolicy.REJECT, "rejected")):
        data_plane = MemoryDataPlane()
        events, _, _ = asyncio.run(captured_rollout(data_plane, versions=(0, 1, 1)))
        event, _, _ = run_stages(events, data_plane, policy=policy)
        assert event.status == expected
        if expected == "accepted":
            assert (event.min_weight_version, event.max_weight_version) == (0, 1)
            assert data_plane.samples["r1"].weight_versions == [0] * 4 + [1] * 8
        else:
            assert event.rejection_reason == "mixed_weight_versions"


def test_refit_spans_reach_the_sample() -> None:
    data_plane = MemoryDataPlane()
    events, _, _ = asyncio.run(
        captured_rollout(data_plane, versions=(3, 3, 3), extras={EXTRAS_WEIGHT_SPANS: [[0, 3], [1, 4]]})
    )
    event, _, _ = run_stages(events, data_plane)
    assert event.status == "accepted" and event.max_weight_version == 4
    assert data_plane.samples["r1"].weight_versions[-4:] == [3, 3, 3, 4]


def test_replayed_receipt_after_cleanup_publishes_same_event_no_second_sample() -> None:
    data_plane = MemoryDataPlane()
    events, _, _ = asyncio.run(captured_rollout(data_plane))
    first, _, _ = run_stages(events, data_plane)
    second, _, _ = run_stages(events, data_plane)  # a fresh finalizer, rows already deleted
    assert second.status == "accepted"
    assert second.model_dump(exclude={"finalized_at"}) == first.model_dump(exclude={"finalized_at"})
    assert list(data_plane.samples) == ["r1"]


class NobodyCommitted:
    def partition_of(self, rollout_id: str) -> int:
        return 0

    async def progress(self) -> OwnerProgress:
        return OwnerProgress(ends={0: 1}, acknowledged={})


class RestartDuringPublish(RecordingSink):
    """The data plane's owner restarts (empty) while the outcome is being published, and
    the finalizer's follower restores what it held by then."""

    def __init__(self, plane: MemoryDataPlane, retained: RetainedSamples) -> None:
        super().__init__()
        self.plane, self.retained = plane, retained

    async def publish(self, records: Sequence[Record]) -> None:
        self.plane.samples.clear()
        await self.retained.restore(self.plane)
        await super().publish(records)


def test_written_samples_are_held_and_survive_a_restart_in_the_middle_of_their_batch() -> None:
    data_plane = MemoryDataPlane()
    events, ids, _ = asyncio.run(captured_rollout(data_plane))
    retained = RetainedSamples(NobodyCommitted())
    sink = RestartDuringPublish(data_plane, retained)
    event, _, finalizer = run_stages(events, data_plane, retained=retained, final_out=sink)
    assert event.status == "accepted"
    assert len(retained) == 1 and finalizer.gauges().retained == {
        "held": 1,
        "held_bytes": retained.stats.held_bytes,
        "released": 0,
        "over_budget": 0,
        "restored": 0,
    }
    assert data_plane.samples["r1"].token_ids == ids  # put again: the restore came before it was held


def test_a_rejected_rollout_holds_nothing() -> None:
    data_plane = MemoryDataPlane()
    events, _, _ = asyncio.run(captured_rollout(data_plane, versions=(0, 1, 1)))
    retained = RetainedSamples(NobodyCommitted())
    event, _, _ = run_stages(events, data_plane, policy=MixedVersionPolicy.REJECT, retained=retained)
    assert event.status == "rejected" and len(retained) == 0


def test_group_collector_marks_rejected_members() -> None:
    collector = GroupCollector(2)
    base = {"prompt_len": 0, "total_len": 0, "generated_tokens": 0, "call_count": 0, "finalized_at": 1.0}
    ok = FinalizedEvent(rollout_id="a", group_id="g", status="accepted", sample_key="a", **base)
    bad = FinalizedEvent(
        rollout_id="b", group_id="g", status="rejected", rejection_reason="missing_row", **base
    )
    assert collector.add(FinalizedRollout(ok)) is None
    group = collector.add(FinalizedRollout(bad))
    assert group is not None and [m.event.rollout_id for m in group.rejected] == ["a", "b"]


def test_one_batch_of_receipts_one_with_a_missing_row() -> None:
    """Rows of a whole batch are read together; one rollout's loss does not touch the others."""

    async def go() -> list[FinalizedEvent]:
        data_plane = MemoryDataPlane()
        receipts = []
        for rollout_id in ("ra", "rb", "rc"):
            events, _, _ = await captured_rollout(data_plane, rollout_id=rollout_id)
            out = RecordingSink()
            ledger = LedgerStage(out, LedgerConfig(seal_grace_s=0))
            await ledger.handle([Consumed("in", 0, i, envelope(e)) for i, e in enumerate(events)])
            receipts.append(out.payloads(RolloutReceipt)[0])
        victim = staging_key("rb", receipts[1].manifest[0].call_id)
        del data_plane.calls[victim]
        sink = RecordingSink()
        await FinalizerStage(data_plane, sink).handle(
            [Consumed("c", 0, i, envelope(r)) for i, r in enumerate(receipts)]
        )
        assert data_plane.calls == {}
        return sink.payloads(FinalizedEvent)  # type: ignore[return-value]

    events = asyncio.run(go())
    assert [(e.rollout_id, e.status, e.rejection_reason) for e in events] == [
        ("ra", "accepted", None),
        ("rb", "rejected", "missing_row"),
        ("rc", "accepted", None),
    ]


def sealed_with(events: list[Record], **update: Any) -> list[Record]:
    """The same rollout, its seal asking for another sample policy."""
    return [e.model_copy(update=update) if isinstance(e, RolloutSeal) else e for e in events]


def test_leaves_policy_gives_the_dead_branch_its_own_sample() -> None:
    data_plane = MemoryDataPlane()
    events, seen, _ = asyncio.run(captured_rollout(data_plane))
    event, _, finalizer = run_stages(sealed_with(events, sample_policy="leaves"), data_plane)
    keys = event.sample_keys
    assert event.status == "accepted" and len(keys) == 2 and finalizer.stats.samples == 2
    by_len = sorted((data_plane.samples[key] for key in keys), key=lambda s: len(s.token_ids))
    assert by_len[0].token_ids == [100, 101, 1, 2, 101, 101, 55]
    assert by_len[1].token_ids == seen
    assert all(s.sample_key == f"r1@{s.spans[-1].call_id}" for s in by_len)
    assert event.total_len == 7 + len(seen) and event.call_count == 2 + 3
    assert data_plane.calls == {}


def test_a_replayed_multi_sample_receipt_finds_its_samples() -> None:
    data_plane = MemoryDataPlane()
    events, _, _ = asyncio.run(captured_rollout(data_plane))
    events = sealed_with(events, sample_policy="leaves")
    first, _, _ = run_stages(events, data_plane)
    second, _, finalizer = run_stages(events, data_plane)  # rows already deleted
    assert second.model_dump(exclude={"finalized_at"}) == first.model_dump(exclude={"finalized_at"})
    assert finalizer.stats.samples == 0 and sorted(data_plane.samples) == sorted(first.sample_keys)


@pytest.mark.parametrize(
    ("stage_default", "seal_says", "outcome"),
    [
        (False, None, ["branch-ok", "digest_mismatch"]),
        (True, None, ["branch_rejected", "digest_mismatch"]),
        (True, False, ["branch-ok", "digest_mismatch"]),
        (False, True, ["branch_rejected", "digest_mismatch"]),
    ],
)
def test_all_or_nothing_from_the_seal_or_else_the_stage(
    stage_default: bool, seal_says: bool | None, outcome: list[str]
) -> None:
    data_plane = MemoryDataPlane()
    events, _, _ = asyncio.run(captured_rollout(data_plane))
    CORRUPTIONS["digest_mismatch"](data_plane, middle_key(events))  # on the long chain only
    events = sealed_with(events, sample_policy="leaves", all_or_nothing=seal_says)
    event, _, _ = run_stages(events, data_plane, all_or_nothing=stage_default)
    got = sorted(s.rejection_reason or "branch-ok" for s in event.samples)
    assert got == outcome
    assert event.status == ("accepted" if "branch-ok" in outcome else "rejected")
    if event.status == "rejected":
        assert event.rejection_reason == "digest_mismatch" and data_plane.samples == {}


def test_sampling_provenance_reaches_the_span_of_its_call() -> None:
    data_plane = MemoryDataPlane()
    options = {"temperature": 0.7, "top_p": 0.8, "top_k": 20}
    events, _, _ = asyncio.run(captured_rollout(data_plane, extras={EXTRAS_SAMPLING: options}))
    event, _, _ = run_stages(events, data_plane)
    assert event.status == "accepted"
    spans = data_plane.samples["r1"].spans
    assert [span.sampling for span in spans[:2]] == [None, None]  # neutral calls record nothing
    assert spans[2].sampling is not None and spans[2].sampling.extras() == options


def test_malformed_provenance_is_rejected_with_its_code() -> None:
    data_plane = MemoryDataPlane()
    events, _, _ = asyncio.run(captured_rollout(data_plane, extras={EXTRAS_SAMPLING: {"top_p": 0.0}}))
    event, _, _ = run_stages(events, data_plane)
    assert event.status == "rejected" and event.rejection_reason == "invalid_provenance"
