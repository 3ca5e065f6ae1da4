"""Sessions rebuilt from the log: a restarted (or second) gateway serves the same rollouts.

Everything lineage needs is already on the topics. A gateway admission's
``logical_call_id`` carries the digest of the call's normalized request history
(``lineage.logical_call_id``), its parent link and chain; the worker's staged event
carries its commit coordinates; a seal ends the session. What is not on the log is the
digest of the reply the gateway returned, so a recovered call is matched as a parent by
its request digest followed by an assistant turn (the reply, as the agent sends it back)
rather than by the reply's exact digest (``lineage.resolve``).

A restart reads from the gateway's bookmark (``bookmark``), not from the beginning, and
drops unsealed rollouts older than ``max_open`` (the ledger has closed them). A replica
takes one rollout over (``take_over``) by reading its one partition number of both topics
from the lowest bookmark any gateway committed there.
"""

from __future__ import annotations

import logging
import math
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

from aiokafka import TopicPartition

from pipeline.gateway.bookmark import Bookmark
from pipeline.gateway.lineage import GatewayCall, parse_logical_call_id
from pipeline.gateway.sessions import Session, Sessions
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.keys import partition_of
from pipeline.replay.rebuild import WHOLE_LOG, Shard, read_log
from topics.records import CallCoords, CaptureAdmission, CommitCoords, RolloutSeal, StagedEvent

log = logging.getLogger(__name__)


@dataclass
class _Log:
    """What the topics say about the gateway's rollouts (of one rollout, when ``only``)."""

    only: str | None = None
    admissions: dict[str, list[CaptureAdmission]] = field(default_factory=lambda: defaultdict(list))
    coords: dict[str, CallCoords] = field(default_factory=dict)
    seals: dict[str, RolloutSeal] = field(default_factory=dict)

    def take(self, payload: object) -> None:
        rollout_id = getattr(payload, "rollout_id", None)
        if isinstance(payload, StagedEvent):
            rollout_id = payload.coords.rollout_id
        if self.only is not None and rollout_id != self.only:
            return
        if isinstance(payload, CaptureAdmission):
            if payload.logical_call_id is not None and parse_logical_call_id(payload.logical_call_id):
                self.admissions[payload.rollout_id].append(payload)
        elif isinstance(payload, RolloutSeal):
            self.seals[payload.rollout_id] = payload
        elif isinstance(payload, StagedEvent):
            self.coords[payload.coords.staging_key] = payload.coords


async def _read(
    kafka: KafkaConfig, start: Mapping[TopicPartition, int] | None, shard: Shard, only: str | None = None
) -> _Log:
    found = _Log(only)
    async for events, _, _ in read_log(
        kafka, [kafka.names.admission, kafka.names.staged], start=start, shard=shard
    ):
        for consumed in events:
            found.take(consumed.event.payload)
    return found


async def recover(
    kafka: KafkaConfig,
    sessions: Sessions,
    *,
    start: Mapping[TopicPartition, int] | None = None,
    max_open_s: float = math.inf,
) -> int:
    """Reopen every unsealed rollout the gateway admitted calls of, reading from ``start``
    (None: the beginning), but none older than ``max_open_s``; returns how many."""
    found = await _read(kafka, start, WHOLE_LOG)
    reopened = dropped = 0
    for rollout_id, admissions in found.admissions.items():
        if rollout_id in found.seals:
            continue
        if time.time() - admissions[0].admitted_at >= max_open_s:
            dropped += 1
            continue
        _reopen(sessions, admissions, found.coords, start or {})
        reopened += 1
    log.info("reopened %d gateway sessions from the log (%d past max_open left closed)", reopened, dropped)
    return reopened


async def take_over(kafka: KafkaConfig, sessions: Sessions, bookmark: Bookmark, rollout_id: str) -> None:
    """Rebuild ``rollout_id``'s session from the log if another gateway held it (open, or
    sealed); nothing if the log has no call of it. The bookmark is committed at once so
    that it covers the session from now on."""
    partition = partition_of(rollout_id, kafka.names.partitions)
    start = await bookmark.for_rollout(partition)
    found = await _read(kafka, start, Shard(partition, kafka.names.partitions), only=rollout_id)
    seal = found.seals.get(rollout_id)
    if seal is not None:
        sessions.sealed_elsewhere(seal)
        return
    admissions = found.admissions.get(rollout_id)
    if not admissions:
        return
    _reopen(sessions, admissions, found.coords, start)
    sessions.taken_over += 1
    log.info("took rollout %s over from the log (%d calls)", rollout_id, len(admissions))
    await bookmark.advance()


async def still_ours(kafka: KafkaConfig, bookmark: Bookmark, session: Session) -> bool:
    """Whether the log shows nothing of ``session`` that this gateway did not do: no call it
    does not hold, no seal. Read before an idle session is sealed ``abandoned``, so a
    replica never abandons a rollout another replica took over and serves."""
    partition = partition_of(session.rollout_id, kafka.names.partitions)
    start = {tp: offset for tp, offset in session.floor.items() if tp.partition == partition}
    if len(start) < 2:  # no floor of its own there: as far back as any gateway may need
        start = await bookmark.for_rollout(partition)
    found = await _read(kafka, start, Shard(partition, kafka.names.partitions), only=session.rollout_id)
    calls = found.admissions.get(session.rollout_id, [])
    return session.rollout_id not in found.seals and all(a.call_id in session.by_id for a in calls)


def _reopen(
    sessions: Sessions,
    admissions: list[CaptureAdmission],
    coords: Mapping[str, CallCoords],
    floor: Mapping[TopicPartition, int],
) -> None:
    first = admissions[0]
    session = sessions.open(first.rollout_id, first.group_id, first.history)
    session.floor = floor
    session.opened_at = sessions.clock() - max(0.0, time.time() - first.admitted_at)
    known = {call.call_id for call in session.calls}
    for admission in admissions:
        if admission.call_id not in known:
            session.add(_recovered(admission, coords.get(admission.staging_key)))


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


__all__ = ["recover", "still_ours", "take_over"]
