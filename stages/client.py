"""The rollout driver's side of capture: admissions, seals and clean replies.

A driver never handles token ids. It mints a call id, builds the admission from the
parent's ``ng_commit_coords``, publishes it, sends the same admission inside the
request as ``ng_capture``, and seals the rollout when the episode ends.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from stages.ports import EventSink
from topics.records import CaptureAdmission, CommitCoords, HistoryPolicy, RolloutSeal, SamplePolicy
from topics.wire import CAPTURE_FIELD, COORDS_FIELD


class RolloutClient:
    """Builds and publishes the driver's events for many concurrent rollouts."""

    def __init__(self, sink: EventSink, *, clock: Callable[[], float] = time.time) -> None:
        self.sink = sink
        self.clock = clock
        self._counter = itertools.count(1)
        self._nonce = uuid.uuid4().hex[:8]

    def new_call_id(self) -> str:
        """Unique per rollout and per driver process, and readable in logs."""
        return f"c{next(self._counter)}-{self._nonce}"

    def admit(
        self,
        rollout_id: str,
        parent: CommitCoords | None = None,
        *,
        group_id: str | None = None,
        logical_call_id: str | None = None,
        call_id: str | None = None,
        history: HistoryPolicy = "exact",
    ) -> CaptureAdmission:
        """A root admission, or a token-in child of ``parent``.

        A parent whose capture failed cannot anchor exact tokens, so its child starts a
        new root: the failed call then lies off the terminal chain. ``history`` is the
        rollout's history policy (DESIGN §5.1), carried by every admission.
        """
        call_id = call_id or self.new_call_id()
        if parent is None or parent.disposition != "staged":
            return CaptureAdmission(
                rollout_id=rollout_id,
                call_id=call_id,
                mode="text",
                prev_len=0,
                logical_call_id=logical_call_id,
                group_id=group_id,
                admitted_at=self.clock(),
                history=history,
            )
        if parent.rollout_id != rollout_id:
            raise ValueError(f"parent: call {parent.call_id} belongs to rollout {parent.rollout_id}")
        return CaptureAdmission(
            rollout_id=rollout_id,
            call_id=call_id,
            parent_call_id=parent.call_id,
            mode="token_in",
            prev_len=parent.cum_len,
            staging_chain=list(parent.staging_chain),
            parent_chain_hash=parent.chain_hash,
            logical_call_id=logical_call_id,
            group_id=group_id,
            admitted_at=self.clock(),
            history=history,
        )

    async def publish_admission(self, admission: CaptureAdmission) -> None:
        await self.sink.publish([admission])

    async def seal(
        self,
        rollout_id: str,
        *,
        group_id: str | None = None,
        reward: float | None = None,
        terminal_call_id: str | None = None,
        failed: str | None = None,
        sample_policy: SamplePolicy = "terminal",
        all_or_nothing: bool | None = None,
        sealed_by: str | None = None,
        call_rewards: Mapping[str, float] | None = None,
    ) -> RolloutSeal:
        """Close a rollout; ``failed`` (a reason) marks an episode that broke;
        ``sample_policy`` says which chains become samples (DESIGN §4.4); ``sealed_by``
        names the principal whose reward this is (DESIGN §15); ``call_rewards`` are
        per-call rewards by call id, which the samples carry on their spans."""
        seal = RolloutSeal(
            rollout_id=rollout_id,
            group_id=group_id,
            reward=reward,
            terminal_call_id=terminal_call_id,
            status="failed" if failed else "completed",
            failure_reason=failed,
            sealed_at=self.clock(),
            sample_policy=sample_policy,
            all_or_nothing=all_or_nothing,
            sealed_by=sealed_by,
            call_rewards=dict(call_rewards or {}),
        )
        await self.sink.publish([seal])
        return seal

    @staticmethod
    def request_body(body: Mapping[str, Any], admission: CaptureAdmission) -> dict[str, Any]:
        """A chat request with the admission riding along as ``ng_capture``."""
        return {**body, CAPTURE_FIELD: admission.model_dump(mode="json")}

    @staticmethod
    def coords_from_reply(reply: Mapping[str, Any]) -> CommitCoords | None:
        raw = reply.get(COORDS_FIELD)
        return None if raw is None else CommitCoords.model_validate(raw)
