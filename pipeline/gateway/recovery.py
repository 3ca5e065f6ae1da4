"""Sessions rebuilt from the log: a restarted (or second) gateway serves the same rollouts.

Everything lineage needs is already on the topics. A gateway admission's
``logical_call_id`` carries the digest of the call's normalized request history
(``lineage.logical_call_id``), its parent link and chain; the worker's staged event
carries its commit coordinates; a seal ends the session. What is not on the log is the
digest of the reply the gateway returned, so a recovered call is matched as a parent by
its request digest followed by an assistant turn (the reply, as the agent sends it back)
rather than by the reply's exact digest (``lineage.resolve``).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field

from pipeline.gateway.lineage import GatewayCall, parse_logical_call_id
from pipeline.gateway.sessions import Sessions
from pipeline.kafka.config import KafkaConfig
from pipeline.replay.rebuild import read_log
from topics.records import CallCoords, CaptureAdmission, CommitCoords, RolloutSeal, StagedEvent

log = logging.getLogger(__name__)


@dataclass
class _Log:
    """What the topics say about the gateway's rollouts."""

    admissions: dict[str, list[CaptureAdmission]] = field(default_factory=lambda: defaultdict(list))
    coords: dict[str, CallCoords] = field(default_factory=dict)
    sealed: set[str] = field(default_factory=set)

    def take(self, payload: object) -> None:
        if isinstance(payload, CaptureAdmission):
            if payload.logical_call_id is not None and parse_logical_call_id(payload.logical_call_id):
                self.admissions[payload.rollout_id].append(payload)
        elif isinstance(payload, RolloutSeal):
            self.sealed.add(payload.rollout_id)
        elif isinstance(payload, StagedEvent):
            self.coords[payload.coords.staging_key] = payload.coords


async def recover(kafka: KafkaConfig, sessions: Sessions) -> int:
    """Reopen every unsealed rollout the gateway admitted calls of; returns how many."""
    found = _Log()
    async for events, _, _ in read_log(kafka, [kafka.names.admission, kafka.names.staged]):
        for consumed in events:
            found.take(consumed.event.payload)
    reopened = 0
    for rollout_id, admissions in found.admissions.items():
        if rollout_id in found.sealed:
            continue
        session = sessions.open(rollout_id, admissions[0].group_id, admissions[0].history)
        known = {call.call_id for call in session.calls}
        for admission in admissions:
            if admission.call_id not in known:
                session.add(_recovered(admission, found.coords.get(admission.staging_key)))
        reopened += 1
    log.info("reopened %d gateway sessions from the log", reopened)
    return reopened


def _recovered(admission: CaptureAdmission, coords: CallCoords | None) -> GatewayCall:
    parsed = parse_logical_call_id(admission.logical_call_id or "")
    assert parsed is not None  # only such admissions are kept
    kind, length, digest = parsed
    call = GatewayCall(
        call_id=admission.call_id,
        logical_call_id=admission.logical_call_id or "",
        parent_call_id=admission.parent_call_id,
        kind=kind,
        request_length=length,
        request_digest=digest,
        recovered=True,
    )
    if coords is not None:  # a call staged as a new segment's root has no ancestors
        ancestors = admission.staging_chain if coords.parent_call_id is not None else None
        chain = [*(ancestors or []), admission.staging_key]
        call.coords = CommitCoords.model_validate({**coords.model_dump(), "staging_chain": chain})
    return call


__all__ = ["recover"]
