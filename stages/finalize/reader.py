"""The trainer's side: finalized events in, samples (and complete GRPO groups) out.

The reader consumes ``FinalizedEvent``s (from any source: the Kafka consumer in
``pipeline`` or a replay), drops duplicate deliveries, fetches each rollout's accepted
samples from the data plane (one, or one per chain under a multi-sample policy), and
never drops a rejected rollout silently: it is yielded without samples so a group-based
trainer can see the hole.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Callable
from dataclasses import dataclass, field

from stages.ports import DataPlane
from stages.recent import DEFAULT_REMEMBER, RecentIds
from topics.records import FinalizedEvent, TrainingSample


@dataclass(frozen=True, slots=True)
class FinalizedRollout:
    """A rollout's outcome and its accepted samples, in chain order."""

    event: FinalizedEvent
    samples: tuple[TrainingSample, ...] = ()

    @property
    def accepted(self) -> bool:
        return bool(self.samples)


@dataclass(slots=True)
class Group:
    """All members (rollouts) of one GRPO group, accepted or rejected."""

    group_id: str
    members: list[FinalizedRollout] = field(default_factory=list)
    partial: bool = False
    """Released before every member arrived (the collector's timeout)."""
    late: bool = False
    """A member that arrived after its group was released partial, alone."""

    @property
    def accepted(self) -> list[FinalizedRollout]:
        return [m for m in self.members if m.accepted]

    @property
    def rejected(self) -> list[FinalizedRollout]:
        return [m for m in self.members if not m.accepted]

    @property
    def samples(self) -> list[TrainingSample]:
        """Every sample of every member, each carrying its rollout's reward."""
        return [sample for member in self.members for sample in member.samples]


class SampleReader:
    """Turns a stream of finalized events into rollouts with their samples, once each
    (duplicates recognised among the last ``remember`` rollouts)."""

    def __init__(self, data_plane: DataPlane, *, remember: int = DEFAULT_REMEMBER) -> None:
        self.data_plane = data_plane
        self._seen = RecentIds(remember)

    async def rollouts(self, events: AsyncIterable[FinalizedEvent]) -> AsyncIterator[FinalizedRollout]:
        async for event in events:
            if event.rollout_id in self._seen:
                continue
            self._seen.add(event.rollout_id)
            keys = event.sample_keys
            fetched = await self.data_plane.get_samples(keys) if keys else {}
            yield FinalizedRollout(event, tuple(fetched[key] for key in keys))


class GroupCollector:
    """Collects finalized rollouts into complete groups of ``group_size`` rollouts.

    With ``timeout_s``, a group still missing members that long after its first arrived
    is released partial by ``expired()``; a member of it arriving later comes back
    alone, marked late (released groups are remembered, boundedly)."""

    def __init__(
        self,
        group_size: int,
        *,
        timeout_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        remember: int = DEFAULT_REMEMBER,
    ) -> None:
        if group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {group_size}")
        self.group_size = group_size
        self.timeout_s = timeout_s
        self._clock = clock
        self._open: dict[str, Group] = {}
        self._opened_at: dict[str, float] = {}
        self._released_partial = RecentIds(remember)

    def add(self, item: FinalizedRollout) -> Group | None:
        """The group once its last member arrived; rollouts without a group come back alone."""
        group_id = item.event.group_id
        if group_id is None:
            return Group(item.event.rollout_id, [item])
        if group_id in self._released_partial:
            return Group(group_id, [item], partial=True, late=True)
        group = self._open.setdefault(group_id, Group(group_id))
        self._opened_at.setdefault(group_id, self._clock())
        group.members.append(item)
        if len(group.members) < self.group_size:
            return None
        self._opened_at.pop(group_id, None)
        return self._open.pop(group_id)

    def expired(self) -> list[Group]:
        """Groups open longer than ``timeout_s``, released partial."""
        if self.timeout_s is None:
            return []
        now = self._clock()
        released: list[Group] = []
        for group_id, opened in list(self._opened_at.items()):
            if now - opened >= self.timeout_s:
                del self._opened_at[group_id]
                group = self._open.pop(group_id)
                group.partial = True
                self._released_partial.add(group_id)
                released.append(group)
        return released

    def discard(self, rollout_ids: set[str]) -> None:
        """Forget members that will be delivered again (their partition moved elsewhere)."""
        for group_id, group in list(self._open.items()):
            group.members = [m for m in group.members if m.event.rollout_id not in rollout_ids]
            if not group.members:
                del self._open[group_id]
                self._opened_at.pop(group_id, None)

    @property
    def pending(self) -> dict[str, Group]:
        return dict(self._open)
