"""Synthetic but valid event streams for pipeline benchmarks.

Rollouts are chains of ``calls`` token-in calls; every call has its admission and
staged event, every rollout a seal. Hashes are well-formed but synthetic: the ledger
never recomputes them, so its cost is the same as with real ones.
"""

from __future__ import annotations

from topics.records import CaptureAdmission, CommitCoords, Record, RolloutSeal, StagedEvent

_HASH = "ab" * 32


def rollout_events(
    rollout_id: str, calls: int, *, delta: int = 64, group_id: str | None = None
) -> list[Record]:
    events: list[Record] = []
    parent: CommitCoords | None = None
    for i in range(calls):
        call_id = f"c{i}"
        key = f"{rollout_id}/{call_id}"
        prev_len = parent.cum_len if parent else 0
        events.append(
            CaptureAdmission(
                rollout_id=rollout_id,
                call_id=call_id,
                parent_call_id=parent.call_id if parent else None,
                prev_len=prev_len,
                mode="token_in" if parent else "text",
                staging_chain=list(parent.staging_chain) if parent else None,
                parent_chain_hash=parent.chain_hash if parent else None,
                group_id=group_id,
                admitted_at=1.0 + i,
            )
        )
        coords = CommitCoords(
            rollout_id=rollout_id,
            call_id=call_id,
            parent_call_id=parent.call_id if parent else None,
            mode="token_in" if parent else "text",
            prev_len=prev_len,
            delta_len=delta,
            cum_len=prev_len + delta,
            weight_version=0,
            staging_key=key,
            staging_chain=[*(parent.staging_chain if parent else []), key],
            chain_hash=_HASH,
            cumulative_hash=_HASH,
            digest=_HASH,
            extras_digest=_HASH,
            disposition="staged",
        )
        events.append(StagedEvent(coords=coords.call_coords(), worker_id="w", staged_at=1.5 + i))
        parent = coords
    events.append(
        RolloutSeal(rollout_id=rollout_id, group_id=group_id, reward=1.0, status="completed", sealed_at=99.0)
    )
    return events
