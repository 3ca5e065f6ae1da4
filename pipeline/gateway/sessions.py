"""Rollout sessions: opened by the environment (``POST /rollouts``), sealed once.

A session is one rollout. It keeps its calls for lineage (``pipeline.gateway.lineage``),
the worker that served its last call (routing prefers it), and its seal. The gateway
publishes the seal, so every session ends with exactly one: the environment's (reward,
or failed with a reason), or ``abandoned`` when it stays idle past the session TTL. Each
seal names who sealed it (``sealed_by``: a principal's name, never a secret).

Each session also keeps its *floor*: offsets of the log at or after which all its events
lie (``bookmark``), and a gateway given a way to take sessions over (``take_over``)
rebuilds one it does not hold from the log when a call, a seal or a look names it.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field

from aiokafka import TopicPartition

from pipeline.api.errors import InvalidRequest
from pipeline.gateway.lineage import GatewayCall, episode_end
from pipeline.gateway.opening import Opening
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
    floor: Mapping[TopicPartition, int] = field(default_factory=dict)
    """Offsets at or after which all of its events lie: what a restart must still read."""
    opened_at: float = 0.0
    """When its first event was (the sessions' clock): one older than the ledger's
    ``max_open`` is closed ``never_sealed`` and holds no log back."""

    def add(self, call: GatewayCall) -> None:
        self.calls.append(call)
        self.by_id[call.call_id] = call

    def close(self, seal: RolloutSeal) -> None:
        """Sealed: it keeps what it still answers for, its seal (a later call or seal is a 409)
        and its calls (to show). The Responses conversations it remembered and its calls by id
        are for calls to come, and there are none: a gateway keeps thousands of sealed sessions."""
        self.seal = seal
        self.responses = ResponseLog()
        self.by_id = {}

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
        self.mark: Mapping[TopicPartition, int] = {}
        """The log's high watermarks read last (``bookmark``): the floor of sessions opened now."""
        self.take_over: Callable[[str], Awaitable[None]] | None = None
        """Rebuilds one rollout this gateway does not hold from the log (``takeover``)."""
        self.taken_over = 0
        self.still_ours: Callable[[Session], Awaitable[bool]] | None = None
        """Replicas: False when the log shows another gateway went on with an idle session."""
        self.handed_over = 0
        self._taking: dict[str, asyncio.Lock] = {}

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
            now = self.clock()
            session = Session(rollout_id, group_id, now, history=history, floor=self.mark, opened_at=now)
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

    async def held(self, rollout_id: str, opening: Opening | None = None) -> Session:
        """The open session of ``rollout_id``; one this gateway does not know is taken over
        from the log first when it can (one rebuild at a time per rollout), or, when the log
        has nothing of it, opened as ``opening`` says (read from a verified agent key)."""
        if rollout_id in self._open or rollout_id in self._sealed or self.take_over is None:
            return self.get(rollout_id)
        lock = self._taking.setdefault(rollout_id, asyncio.Lock())
        try:
            async with lock:
                if rollout_id not in self._open and rollout_id not in self._sealed:
                    try:
                        await self.take_over(rollout_id)
                    except Exception as exc:  # the broker away: the caller may try again
                        log.warning("taking rollout %s over from the log failed: %r", rollout_id, exc)
                        raise SessionError(
                            503,
                            f"rollout {rollout_id}: its session could not be read from the log; try again",
                        ) from exc
                    if (
                        opening is not None
                        and rollout_id not in self._open
                        and rollout_id not in self._sealed
                    ):
                        self.open(rollout_id, *opening)
                        self.taken_over += 1
        finally:
            if not lock.locked():
                self._taking.pop(rollout_id, None)
        return self.get(rollout_id)

    def sealed_elsewhere(self, seal: RolloutSeal) -> None:
        """Remember a rollout the log shows sealed (by another gateway): calls get a 409."""
        self._sealed[seal.rollout_id] = Session(seal.rollout_id, seal.group_id, self.clock(), seal=seal)
        self._trim_sealed()

    async def describe(self, rollout_id: str) -> dict[str, object]:
        sealed = self._sealed.get(rollout_id)
        return sealed.describe() if sealed is not None else (await self.held(rollout_id)).describe()

    def floors(self, max_open_s: float) -> Iterator[tuple[str, Mapping[TopicPartition, int]]]:
        """Each open session younger than ``max_open_s``, by rollout id, and its floor."""
        now = self.clock()
        return ((s.rollout_id, s.floor) for s in self._open.values() if now - s.opened_at < max_open_s)

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
        session = await self.held(rollout_id)
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
        session.close(seal)
        self._sealed[rollout_id] = self._open.pop(rollout_id)
        self._trim_sealed()
        return seal

    def _trim_sealed(self) -> None:
        while len(self._sealed) > self.remember_sealed:
            self._sealed.popitem(last=False)

    def _default_policy(self, session: Session) -> SamplePolicy:
        """The gateway's policy; ``chains`` for a ``render`` session under ``terminal``, whose
        segments are separate roots that the terminal rule would find ambiguous."""
        if session.history == "render" and self.sample_policy == "terminal":
            return "chains"
        return self.sample_policy

    async def sweep(self) -> list[str]:
        """Seal every session idle past the TTL (none of its calls in flight) as ``abandoned``;
        one another replica has taken over since (``still_ours``) is let go, not sealed."""
        now = self.clock()
        idle = [s for s in self._open.values() if s.in_flight == 0 and now - s.last_seen > self.ttl_s]
        sealed: list[str] = []
        for session in idle:
            rollout_id = session.rollout_id
            if self.still_ours is not None and not await self.still_ours(session):
                self._open.pop(rollout_id, None)
                self.handed_over += 1
                log.info("rollout %s went on on another replica: let go", rollout_id)
                continue
            await self.seal(rollout_id, failed=ABANDONED, sealed_by=SWEEPER)
            sealed.append(rollout_id)
            self.abandoned += 1
            log.warning("rollout %s idle past %.0fs: sealed failed %s", rollout_id, self.ttl_s, ABANDONED)
        return sealed

    async def sweep_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.sweep()
            except Exception:  # a failed publish is retried on the next sweep
                log.exception("sealing idle sessions failed")


__all__ = ["ABANDONED", "SWEEPER", "Session", "SessionError", "Sessions"]
