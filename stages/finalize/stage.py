"""The finalizer stage: one ``FinalizedEvent`` per receipt, and the sample behind it.

For each receipt it fetches the terminal chain's rows in one batched read, verifies
and linearizes them, writes the sample under the rollout id, publishes the event and,
only once the broker has acknowledged it, deletes the rollout's staging rows.

Replays are idempotent: the sample key is the rollout id (a rewrite is the same
sample), the event id is ``fin/{rollout_id}``, and a receipt replayed after its rows
were deleted finds its sample and republishes the same accepted event instead of
rejecting the rollout for missing rows.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from stages.finalize.verify import Linearized, MixedVersionPolicy, Rejected, linearize, terminal_records
from stages.ports import Consumed, DataPlane, EventSink, MissingRows, TopicPartition
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
        remember: int = 100_000,
    ) -> None:
        self.data_plane = data_plane
        self.sink = sink
        self.policy = policy
        self.stats = FinalizerStats()
        self._done: OrderedDict[str, None] = OrderedDict()
        self._remember = remember

    async def handle(self, batch: Sequence[Consumed]) -> None:
        receipts = [item.event.payload for item in batch if isinstance(item.event.payload, RolloutReceipt)]
        events: list[FinalizedEvent] = []
        cleanup: list[str] = []
        for receipt in receipts:
            if receipt.rollout_id in self._done:
                self.stats.duplicates += 1
                continue
            event = await self._finalize(receipt)
            events.append(event)
            cleanup += _staging_keys(receipt)
        if not events:
            return
        await self.sink.publish(events)
        for event in events:
            self._remember_done(event.rollout_id)
            self._count(event)
        if cleanup:  # only after the broker acknowledged every event above
            await self.data_plane.delete_calls(cleanup)

    async def _finalize(self, receipt: RolloutReceipt) -> FinalizedEvent:
        if receipt.capture_poisoned:
            assert receipt.failure_reason is not None
            return _rejected(receipt, receipt.failure_reason.value)
        try:
            chain = terminal_records(receipt)
            keys = [record.staging_key for record in chain]
            try:
                rows = await self.data_plane.get_calls(keys)
            except MissingRows as exc:
                replay = await self._already_finalized(receipt)
                if replay is not None:
                    return replay
                raise Rejected(FinalizerFailure.MISSING_ROW, str(exc)) from None
            result = linearize(receipt, rows, self.policy)
        except Rejected as exc:
            log.info("rollout %s rejected: %s", receipt.rollout_id, exc)
            return _rejected(receipt, exc.code.value)
        await self.data_plane.put_sample(result.sample)
        return _accepted(receipt, result)

    async def _already_finalized(self, receipt: RolloutReceipt) -> FinalizedEvent | None:
        """A replayed receipt whose rows are gone: its sample tells the same story again."""
        try:
            samples = await self.data_plane.get_samples([receipt.rollout_id])
        except MissingRows:
            return None
        return _accepted(receipt, _summary(samples[receipt.rollout_id]))

    def _remember_done(self, rollout_id: str) -> None:
        self._done[rollout_id] = None
        while len(self._done) > self._remember:
            self._done.popitem(last=False)

    def _count(self, event: FinalizedEvent) -> None:
        if event.status == "accepted":
            self.stats.accepted += 1
        else:
            self.stats.rejected[str(event.rejection_reason)] += 1

    async def tick(self, now: float) -> None:
        del now

    def committable(self, positions: Mapping[TopicPartition, int]) -> Mapping[TopicPartition, int]:
        return positions

    def on_revoked(self, partitions: Sequence[TopicPartition]) -> None:
        del partitions


def _staging_keys(receipt: RolloutReceipt) -> list[str]:
    """Every row the rollout may have left: committed calls, dead branches, failed calls."""
    keys = [record.staging_key for record in receipt.manifest]
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
