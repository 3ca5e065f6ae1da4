"""The finalizer stage: one ``FinalizedEvent`` per receipt, and the samples behind it.

Per consumer batch it fetches the rows of every chain of every receipt in one batched
read, verifies and linearizes each chain, writes the accepted samples in one put,
publishes the events and, only once the broker has acknowledged them, deletes the
rollouts' staging rows in one call. Batching is what makes the data plane's per-call
cost (milliseconds) affordable at thousands of calls per second.

A rollout gives one sample (policy ``terminal``) or one per chain (``leaves``,
``chains``). A chain that fails verification rejects its own sample only, unless the
rollout is all-or-nothing (the seal says so, or else the stage's default): then every
other chain is rejected ``branch_rejected`` and the rollout with the failing chain's code.

Replays are idempotent: a sample's key is derived from the rollout id (and the chain's
leaf), the event id is ``fin/{rollout_id}``, and a receipt replayed after its rows
were deleted finds its samples and republishes the same accepted outcome instead of
rejecting the rollout for missing rows.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypedDict

from stages.finalize.janitor import JanitorConfig, StagingJanitor
from stages.finalize.retain import RetainedSamples
from stages.finalize.verify import Linearized, MixedVersionPolicy, Rejected, chain_records, linearize
from stages.ports import Consumed, DataPlane, EventSink, MissingRows, StageGauges, TopicPartition, read_calls
from stages.recent import DEFAULT_REMEMBER, RecentIds
from topics.failures import FinalizerFailure
from topics.records import (
    FinalizedEvent,
    RolloutReceipt,
    SampleChain,
    SampleOutcome,
    StagedCall,
    TrainingSample,
    sample_key,
    staging_key,
)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FinalizerStats:
    accepted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0
    samples: int = 0
    """Accepted samples written (a multi-sample rollout counts each)."""


@dataclass(slots=True)
class _ChainVerdict:
    """One chain on its way to a sample: its rows' keys, then a sample or a rejection."""

    target: SampleChain
    keys: list[str] = field(default_factory=list)
    result: Linearized | None = None
    stored: bool = False
    """The sample was already in the data plane (a replayed receipt): not written again."""
    rejection: str | None = None

    def reject(self, code: str) -> None:
        self.result, self.rejection = None, code


class FinalizerStage:
    """StageHandler for receipts on ``tokentrail.committed``."""

    name = "finalizer"

    def __init__(
        self,
        data_plane: DataPlane,
        sink: EventSink,
        *,
        policy: MixedVersionPolicy = MixedVersionPolicy.ALLOW,
        all_or_nothing: bool = False,
        remember: int = DEFAULT_REMEMBER,
        janitor: JanitorConfig | None = None,
        retained: RetainedSamples | None = None,
    ) -> None:
        self.data_plane = data_plane
        self.sink = sink
        self.policy = policy
        self.all_or_nothing = all_or_nothing
        """For rollouts whose seal does not say: one rejected chain rejects every sample."""
        self.stats = FinalizerStats()
        self.answered = RecentIds(remember)
        """Rollouts already finalized: a receipt for one of them is a duplicate. Seed it
        from the tail of the finalized topic when partitions are assigned (the recall rule, DESIGN §7)."""
        self.janitor = StagingJanitor(data_plane, self.answered, janitor) if janitor is not None else None
        """Sweeps the staging partition for rows nobody else will delete (DESIGN §7.3)."""
        self.retained = retained
        """Copies of written samples until their owners have them (DESIGN §7.4)."""

    def gauges(self) -> StageGauges:
        janitor = self.janitor.stats if self.janitor is not None else None
        swept = {"finished": janitor.finished, "expired": janitor.expired} if janitor is not None else None
        retained = self.retained.stats.as_dict() if self.retained is not None else None
        return StageGauges(duplicates=self.stats.duplicates, swept=swept, retained=retained)

    async def handle(self, batch: Sequence[Consumed]) -> None:
        receipts: dict[str, RolloutReceipt] = {}
        for item in batch:
            payload = item.event.payload
            if not isinstance(payload, RolloutReceipt):
                continue  # call records share the topic; they are the ledger's, not ours
            if payload.rollout_id in self.answered or payload.rollout_id in receipts:
                self.stats.duplicates += 1
                continue
            receipts[payload.rollout_id] = payload
        if not receipts:
            return
        retained = self.retained
        restores = retained.restores if retained is not None else 0
        events, written = await self._finalize_all(list(receipts.values()))
        spool_id = retained.store(written) if retained is not None else None  # durable before published
        await self.sink.publish(events)
        for event in events:
            self.answered.add(event.rollout_id)
            self._count(event)
        if retained is not None:
            retained.hold(written, spool_id)
            if retained.restores != restores:  # restored before these were held: put them too
                await self.data_plane.put_samples(written)
        # Only after the broker acknowledged every event above.
        await self.data_plane.delete_calls([key for r in receipts.values() for key in _staging_keys(r)])

    async def _finalize_all(
        self, receipts: list[RolloutReceipt]
    ) -> tuple[list[FinalizedEvent], list[TrainingSample]]:
        """Each receipt's outcome, and the samples written for them."""
        verdicts = {receipt.rollout_id: self._plan(receipt) for receipt in receipts}
        wanted = [key for chains in verdicts.values() for chain in chains for key in chain.keys]
        rows, missing = await read_calls(self.data_plane, wanted)
        for receipt in receipts:
            for chain in verdicts[receipt.rollout_id]:
                if chain.keys:
                    await self._verify(receipt, chain, rows, missing)
            if self._all_or_nothing(receipt):
                _reject_siblings(receipt, verdicts[receipt.rollout_id])
        fresh = [c.result.sample for chains in verdicts.values() for c in chains if c.result and not c.stored]
        await self.data_plane.put_samples(fresh)
        self.stats.samples += len(fresh)
        return [_event(receipt, verdicts[receipt.rollout_id]) for receipt in receipts], fresh

    def _plan(self, receipt: RolloutReceipt) -> list[_ChainVerdict]:
        chains = [_ChainVerdict(target) for target in receipt.sample_chains()]
        for chain in chains:
            try:
                records = chain_records(receipt, chain.target.leaf_call_id)
            except Rejected as exc:
                chain.reject(exc.code.value)
                continue
            chain.keys = [staging_key(receipt.rollout_id, entry.call_id) for entry in records]
        return chains

    async def _verify(
        self, receipt: RolloutReceipt, chain: _ChainVerdict, rows: Mapping[str, StagedCall], missing: set[str]
    ) -> None:
        absent = [key for key in chain.keys if key in missing]
        if absent:
            await self._without_rows(chain, absent)
            return
        try:
            chain.result = linearize(receipt, chain.target, rows, self.policy)
        except Rejected as exc:
            log.info("rollout %s, sample %s rejected: %s", receipt.rollout_id, chain.target.key, exc)
            chain.reject(exc.code.value)

    async def _without_rows(self, chain: _ChainVerdict, absent: list[str]) -> None:
        """Rows are gone: a replay of a finalized rollout (its sample exists), or a real loss."""
        try:
            samples = await self.data_plane.get_samples([chain.target.key])
        except MissingRows:
            log.info("sample %s rejected: missing rows %s", chain.target.key, ", ".join(absent))
            chain.reject(FinalizerFailure.MISSING_ROW.value)
            return
        chain.result, chain.stored = _summary(samples[chain.target.key]), True

    def _all_or_nothing(self, receipt: RolloutReceipt) -> bool:
        return self.all_or_nothing if receipt.all_or_nothing is None else receipt.all_or_nothing

    def _count(self, event: FinalizedEvent) -> None:
        if event.status == "accepted":
            self.stats.accepted += 1
        else:
            self.stats.rejected[str(event.rejection_reason)] += 1

    async def tick(self, now: float) -> None:
        del now  # the janitor keeps wall time of its own
        if self.janitor is not None:
            await self.janitor.maybe_sweep()
        if self.retained is not None:
            await self.retained.maybe_check()

    def committable(self, positions: Mapping[TopicPartition, int]) -> Mapping[TopicPartition, int]:
        return positions

    def on_revoked(self, partitions: Sequence[TopicPartition]) -> None:
        del partitions


def _reject_siblings(receipt: RolloutReceipt, chains: list[_ChainVerdict]) -> None:
    """All-or-nothing: once one chain is rejected (here or in the ledger), all are."""
    failed_in_ledger = any(chain.failure_reason is not None for chain in receipt.chains)
    if failed_in_ledger or any(chain.rejection is not None for chain in chains):
        for chain in chains:
            if chain.rejection is None:
                chain.reject(FinalizerFailure.BRANCH_REJECTED.value)


def _staging_keys(receipt: RolloutReceipt) -> list[str]:
    """Every row the rollout may have left: committed calls, dead branches, failed calls."""
    keys = [staging_key(receipt.rollout_id, entry.call_id) for entry in receipt.manifest]
    keys += [staging_key(receipt.rollout_id, failed.call_id) for failed in receipt.failed_calls]
    return keys


def _summary(sample: TrainingSample) -> Linearized:
    versions = sample.weight_versions or [0]
    return Linearized(
        sample,
        sample.spans[0].carry_len if sample.spans else 0,
        int(sum(sample.token_mask)),
        len(sample.spans),
        min(versions),
        max(versions),
    )


def _event(receipt: RolloutReceipt, chains: list[_ChainVerdict]) -> FinalizedEvent:
    if receipt.sample_policy != "terminal":
        return _multi_sample_event(receipt, chains)
    if receipt.capture_poisoned:
        assert receipt.failure_reason is not None
        return _rejected(receipt, receipt.failure_reason.value)
    (chain,) = chains
    if chain.result is None:
        assert chain.rejection is not None
        return _rejected(receipt, chain.rejection)
    return _accepted(receipt, chain.result)


def _accepted(receipt: RolloutReceipt, result: Linearized) -> FinalizedEvent:
    return FinalizedEvent(
        rollout_id=receipt.rollout_id,
        group_id=receipt.group_id,
        status="accepted",
        sample_key=receipt.rollout_id,
        reward=receipt.reward,
        finalized_at=time.time(),
        **_measures(result),
    )


class _Measures(TypedDict):
    """The lengths and weight versions an outcome reports of its sample."""

    prompt_len: int
    total_len: int
    generated_tokens: int
    call_count: int
    min_weight_version: int
    max_weight_version: int


def _measures(result: Linearized) -> _Measures:
    return {
        "prompt_len": result.prompt_len,
        "total_len": len(result.sample.token_ids),
        "generated_tokens": result.generated_tokens,
        "call_count": result.call_count,
        "min_weight_version": result.min_weight_version,
        "max_weight_version": result.max_weight_version,
    }


def _rejected(receipt: RolloutReceipt, reason: str) -> FinalizedEvent:
    return FinalizedEvent.model_validate(
        {
            "rollout_id": receipt.rollout_id,
            "group_id": receipt.group_id,
            "status": "rejected",
            "rejection_reason": reason,
            "prompt_len": 0,
            "total_len": 0,
            "generated_tokens": 0,
            "call_count": len(receipt.manifest),
            "reward": receipt.reward,
            "finalized_at": time.time(),
        }
    )


def _multi_sample_event(receipt: RolloutReceipt, chains: list[_ChainVerdict]) -> FinalizedEvent:
    """Every chain's outcome (the ledger's rejections included, in chain order); the
    rollout is accepted when one sample is, and otherwise carries the first real code."""
    verified = {chain.target.leaf_call_id: chain for chain in chains}
    outcomes: list[SampleOutcome] = []
    for listed in receipt.chains:
        chain = verified.get(listed.leaf_call_id)
        key = sample_key(receipt.rollout_id, listed.leaf_call_id)
        if chain is not None and chain.result is not None:
            outcomes.append(_sample_accepted(key, listed.leaf_call_id, chain.result))
            continue
        reason = chain.rejection if chain is not None else listed.failure_reason
        outcomes.append(
            SampleOutcome.model_validate(
                {
                    "sample_key": key,
                    "leaf_call_id": listed.leaf_call_id,
                    "status": "rejected",
                    "rejection_reason": reason,
                }
            )
        )
    accepted = [o for o in outcomes if o.status == "accepted"]
    codes = [o.rejection_reason for o in outcomes if o.rejection_reason is not None]
    real = [code for code in codes if code != FinalizerFailure.BRANCH_REJECTED]
    reason = None if accepted else (receipt.failure_reason or (real or codes)[0])
    versions = [v for o in accepted for v in (o.min_weight_version, o.max_weight_version) if v is not None]
    return FinalizedEvent.model_validate(
        {
            "rollout_id": receipt.rollout_id,
            "group_id": receipt.group_id,
            "status": "accepted" if accepted else "rejected",
            "rejection_reason": None if reason is None else str(reason),
            "prompt_len": sum(o.prompt_len for o in accepted),
            "total_len": sum(o.total_len for o in accepted),
            "generated_tokens": sum(o.generated_tokens for o in accepted),
            "call_count": sum(o.call_count for o in accepted) if accepted else len(receipt.manifest),
            "min_weight_version": min(versions) if versions else None,
            "max_weight_version": max(versions) if versions else None,
            "reward": receipt.reward,
            "finalized_at": time.time(),
            "sample_policy": receipt.sample_policy,
            "samples": [o.model_dump() for o in outcomes],
        }
    )


def _sample_accepted(key: str, leaf_call_id: str, result: Linearized) -> SampleOutcome:
    return SampleOutcome(sample_key=key, leaf_call_id=leaf_call_id, status="accepted", **_measures(result))
