"""The finalizer stage: one ``FinalizedEvent`` per receipt, and the sample behind it.

Per consumer batch it fetches the terminal chains' rows of every receipt in one
batched read, verifies and linearizes each, writes the accepted samples in one put,
publishes the events and, only once the broker has acknowledged them, deletes the
rollouts' staging rows in one call. Batching is what makes the data plane's per-call
cost (milliseconds) affordable at thousands of calls per second.

Replays are idempotent: the sample key is the rollout id (a rewrite is the same
sample), the event id is ``fin/{rollout_id}``, and a receipt replayed after its rows
were deleted finds its sample and republishes the same accepted event instead of
rejecting the rollout for missing rows.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stages.finalize.janitor import JanitorConfig, StagingJanitor
from stages.finalize.verify import Linearized, MixedVersionPolicy, Rejected, linearize, terminal_records
from stages.ports import Consumed, DataPlane, EventSink, MissingRows, StageGauges, TopicPartition, read_calls
from stages.recent import DEFAULT_REMEMBER, RecentIds
from topics.failures import FinalizerFailure
from topics.records import FinalizedEvent, RolloutReceipt, TrainingSample, staging_key

log = logging.getLogger(__name__)


@dataclass(slots=True)
class FinalizerStats:
    accepted: int = 0
    rejected: Counter[str] = field(default_factory=Counter)
    duplicates: int = 0


class FinalizerStage:
    """StageHandler for receipts on ``tokentrail.committed``."""

    name = "finalizer"

    def __init__(
        self,
        data_plane: DataPlane,
        sink: EventSink,
        *,
        policy: MixedVersionPolicy = MixedVersionPolicy.ALLOW,
        remember: int = DEFAULT_REMEMBER,
        janitor: JanitorConfig | None = None,
    ) -> None:
        self.data_plane = data_plane
        self.sink = sink
        self.policy = policy
        self.stats = FinalizerStats()
        self.answered = RecentIds(remember)
        """Rollouts already finalized: a receipt for one of them is a duplicate. Seed it
        from the tail of the finalized topic when partitions are assigned (the recall rule, DESIGN §7)."""
        self.janitor = StagingJanitor(data_plane, self.answered, janitor) if janitor is not None else None
        """Sweeps the staging partition for rows nobody else will delete (DESIGN §7.3)."""

    def gauges(self) -> StageGauges:
        janitor = self.janitor.stats if self.janitor is not None else None
        swept = {"finished": janitor.finished, "expired": janitor.expired} if janitor is not None else None
        return StageGauges(duplicates=self.stats.duplicates, swept=swept)

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
        events = await self._finalize_all(list(receipts.values()))
        await self.sink.publish(events)
        for event in events:
            self.answered.add(event.rollout_id)
            self._count(event)
        # Only after the broker acknowledged every event above.
        await self.data_plane.delete_calls([key for r in receipts.values() for key in _staging_keys(r)])

    async def _finalize_all(self, receipts: list[RolloutReceipt]) -> list[FinalizedEvent]:
        events: dict[str, FinalizedEvent] = {}
        chains: dict[str, list[str]] = {}
        for receipt in receipts:
            if receipt.capture_poisoned:
                assert receipt.failure_reason is not None
                events[receipt.rollout_id] = _rejected(receipt, receipt.failure_reason.value)
                continue
            try:
                chains[receipt.rollout_id] = [
                    staging_key(receipt.rollout_id, entry.call_id) for entry in terminal_records(receipt)
                ]
            except Rejected as exc:
                events[receipt.rollout_id] = _rejected(receipt, exc.code.value)
        rows, missing = await read_calls(self.data_plane, [key for keys in chains.values() for key in keys])
        samples: list[TrainingSample] = []
        for receipt in receipts:
            keys = chains.get(receipt.rollout_id)
            if keys is None:
                continue
            absent = [key for key in keys if key in missing]
            if absent:
                events[receipt.rollout_id] = await self._without_rows(receipt, absent)
                continue
            try:
                result = linearize(receipt, rows, self.policy)
            except Rejected as exc:
                log.info("rollout %s rejected: %s", receipt.rollout_id, exc)
                events[receipt.rollout_id] = _rejected(receipt, exc.code.value)
                continue
            samples.append(result.sample)
            events[receipt.rollout_id] = _accepted(receipt, result)
        await self.data_plane.put_samples(samples)
        return [events[receipt.rollout_id] for receipt in receipts]

    async def _without_rows(self, receipt: RolloutReceipt, absent: list[str]) -> FinalizedEvent:
        """Rows are gone: a replay of a finalized rollout (its sample exists), or a real loss."""
        try:
            samples = await self.data_plane.get_samples([receipt.rollout_id])
        except MissingRows:
            log.info("rollout %s rejected: missing rows %s", receipt.rollout_id, ", ".join(absent))
            return _rejected(receipt, FinalizerFailure.MISSING_ROW.value)
        return _accepted(receipt, _summary(samples[receipt.rollout_id]))

    def _count(self, event: FinalizedEvent) -> None:
        if event.status == "accepted":
            self.stats.accepted += 1
        else:
            self.stats.rejected[str(event.rejection_reason)] += 1

    async def tick(self, now: float) -> None:
        del now  # the janitor keeps wall time of its own
        if self.janitor is not None:
            await self.janitor.maybe_sweep()

    def committable(self, positions: Mapping[TopicPartition, int]) -> Mapping[TopicPartition, int]:
        return positions

    def on_revoked(self, partitions: Sequence[TopicPartition]) -> None:
        del partitions


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


def _accepted(receipt: RolloutReceipt, result: Linearized) -> FinalizedEvent:
    return FinalizedEvent(
        rollout_id=receipt.rollout_id,
        group_id=receipt.group_id,
        status="accepted",
        sample_key=receipt.rollout_id,
        prompt_len=result.prompt_len,
        total_len=len(result.sample.token_ids),
        generated_tokens=result.generated_tokens,
        call_count=result.call_count,
        min_weight_version=result.min_weight_version,
        max_weight_version=result.max_weight_version,
        reward=receipt.reward,
        finalized_at=time.time(),
    )


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
