"""Rollout sessions: opened by the environment (``POST /rollouts``), sealed once.

A session is one rollout. It keeps its calls for lineage (``pipeline.gateway.lineage``),
the worker that served its last call (routing prefers it), and its seal. The gateway
publishes the seal, so every session ends with exactly one: the environment's (reward,
or failed with a reason), or ``abandoned`` when it stays idle past the session TTL. Each
seal names who sealed it (``sealed_by``: a principal's name, never a secret).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pipeline.api.errors import InvalidRequest
from pipeline.gateway.lineage import GatewayCall, episode_end
from pipeline.gateway.previous import ResponseLog
from pipeline.gateway.quotas import Usage
from stages.client import RolloutClient
from topics.records import IDENT_PATTERN, HistoryPolicy, RolloutSeal, SamplePolicy

log = logging.getLogger(__name__)

ABANDONED = "abandoned"
SWEEPER = "gateway:ttl"
"""Who seals a session idle past the TTL."""
_ROLLOUT_ID = re.compile(IDENT_PATTERN)


class SessionError(Exception):
    """A session operation the agent cannot do; ``status`` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True)
class Session:
    rollout_id: str
    group_id: str | None
    last_seen: float
    calls: list[GatewayCall] = field(default_factory=list)
    by_id: dict[str, GatewayCall] = field(default_factory=dict)
    seal: RolloutSeal | None = None
    in_flight: int = 0
    worker: str | None = None
    responses: ResponseLog = field(default_factory=ResponseLog)
    usage: Usage = field(default_factory=Usage)
    history: HistoryPolicy = "exact"
    """What continuations' prompts hold of earlier turns (DESIGN §5.1), chosen at open."""

    def add(self, call: GatewayCall) -> None:
        self.calls.append(call)
        self.by_id[call.call_id] = call

    def describe(self) -> dict[str, object]:
        """What ``GET /rollouts/{id}`` shows: the calls and their parent links."""
        return {
            "rollout_id": self.rollout_id,
            "group_id": self.group_id,
            "history": self.history,
            "sealed": None if self.seal is None else self.seal.model_dump(mode="json"),
            "calls": [
                {
                    "call_id": c.call_id,
                    "parent_call_id": c.parent_call_id,
                    "logical_call_id": c.logical_call_id,
                    "disposition": None if c.coords is None else c.coords.disposition,
                    "worker": c.worker,
                }
                for c in self.calls
            ],
        }


class Sessions:
    """Every open session of this gateway, and the seals it publishes."""

    def __init__(
        self,
        client: RolloutClient,
        *,
        ttl_s: float,
        sample_policy: SamplePolicy = "terminal",
        remember_sealed: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")
        self.client = client
        self.ttl_s = ttl_s
        self.sample_policy = sample_policy
        """For seals that do not name a policy of their own."""
        self.clock = clock
        self._open: dict[str, Session] = {}
        self._sealed: OrderedDict[str, Session] = OrderedDict()  # the latest, for show and 409s
        self.remember_sealed = remember_sealed
        self.abandoned = 0
        self.rewritten_episodes = 0
        """``terminal`` seals that named the session's last call: the agent rewrote its history."""

    def open(
        self, rollout_id: str | None = None, group_id: str | None = None, history: HistoryPolicy = "exact"
    ) -> Session:
        """The session of ``rollout_id`` (created if new; a fresh id when None). Reopening
        one keeps its history policy: a different one is a 409."""
        rollout_id = rollout_id or f"rollout-{uuid.uuid4().hex[:16]}"
        if len(rollout_id) > 200 or not _ROLLOUT_ID.match(rollout_id):
            raise SessionError(400, f"rollout_id: {rollout_id[:80]!r} does not match {IDENT_PATTERN}")
        if rollout_id in self._sealed:
            raise SessionError(409, f"rollout {rollout_id} is already sealed")
        session = self._open.get(rollout_id)
        if session is None:
            session = Session(rollout_id, group_id, self.clock(), history=history)
            self._open[rollout_id] = session
        elif group_id is not None and session.group_id not in (None, group_id):
            raise SessionError(409, f"rollout {rollout_id} is in group {session.group_id}, not {group_id}")
        elif history != session.history:
            raise SessionError(409, f"rollout {rollout_id} keeps history {session.history}, not {history}")
        session.last_seen = self.clock()
        return session

    def get(self, rollout_id: str) -> Session:
        session = self._open.get(rollout_id)
        if session is not None:
            return session
        if rollout_id in self._sealed:
            raise SessionError(409, f"rollout {rollout_id} is sealed; no more calls")
        raise SessionError(404, f"rollout {rollout_id} is unknown")

    def describe(self, rollout_id: str) -> dict[str, object]:
        sealed = self._sealed.get(rollout_id)
        return sealed.describe() if sealed is not None else self.get(rollout_id).describe()

    @property
    def open_count(self) -> int:
        return len(self._open)

    async def seal(
        self,
        rollout_id: str,
        *,
        reward: float | None = None,
        failed: str | None = None,
        sample_policy: SamplePolicy | None = None,
        all_or_nothing: bool | None = None,
        sealed_by: str | None = None,
        call_rewards: Mapping[str, float] | None = None,
    ) -> RolloutSeal:
        """Publish the session's one seal; a second seal is a 409 naming the first, and per-call
        rewards for a call the session does not have are a 400 naming it."""
        done = self._sealed.get(rollout_id)
        if done is not None and done.seal is not None:
            first = done.seal
            shown = (
                f"reward {first.reward}" if first.status == "completed" else f"failed: {first.failure_reason}"
            )
            raise SessionError(409, f"rollout {rollout_id} was already sealed ({shown})")
        session = self._open.get(rollout_id)
        if session is None:
            raise SessionError(404, f"rollout {rollout_id} is unknown")
        for call_id in call_rewards or {}:
            if call_id not in session.by_id:
                raise InvalidRequest(
                    f"call_rewards.{call_id}",
                    f"call_rewards.{call_id}: rollout {rollout_id} has no such call",
                )
        policy = sample_policy or self._default_policy(session)
        terminal = episode_end(session.calls) if policy == "terminal" and failed is None else None
        if terminal is not None:
            self.rewritten_episodes += 1
        seal = await self.client.seal(
            rollout_id,
            group_id=session.group_id,
            reward=reward,
            terminal_call_id=terminal,
            failed=failed,
            sample_policy=policy,
            all_or_nothing=all_or_nothing,
            sealed_by=sealed_by,
            call_rewards=call_rewards,
        )
        session.seal = seal
        self._sealed[rollout_id] = self._open.pop(rollout_id)
        while len(self._sealed) > self.remember_sealed:
            self._sealed.popitem(last=False)
        return seal

    def _default_policy(self, session: Session) -> SamplePolicy:
        """The gateway's policy; ``chains`` for a ``render`` session under ``terminal``, whose
        segments are separate roots that the terminal rule would find ambiguous."""
        if session.history == "render" and self.sample_policy == "terminal":
            return "chains"
        return self.sample_policy

    async def sweep(self) -> list[str]:
        """Seal every session idle past the TTL (none of its calls in flight) as ``abandoned``."""
        now = self.clock()
        idle = [
            s.rollout_id for s in self._open.values() if s.in_flight == 0 and now - s.last_seen > self.ttl_s
        ]
        for rollout_id in idle:
            await self.seal(rollout_id, failed=ABANDONED, sealed_by=SWEEPER)
            self.abandoned += 1
            log.warning("rollout %s idle past %.0fs: sealed failed %s", rollout_id, self.ttl_s, ABANDONED)
        return idle

    async def sweep_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.sweep()
            except Exception:  # a failed publish is retried on the next sweep
                log.exception("sealing idle sessions failed")


__all__ = ["ABANDONED", "SWEEPER", "Session", "SessionError", "Sessions"]
