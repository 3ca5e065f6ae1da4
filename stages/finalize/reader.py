"""The trainer's side: finalized events in, samples (and complete GRPO groups) out.

The reader consumes ``FinalizedEvent``s (from any source: the Kafka consumer in
``pipeline`` or a replay), drops duplicate deliveries, fetches each rollout's accepted
samples from the data plane (one, or one per chain under a multi-sample policy), and
never drops a rejected rollout silently: it is yielded without samples so a group-based
trainer can see the hole.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field

from stages.ports import DataPlane
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
    """Turns a stream of finalized events into rollouts with their samples, once each."""

    def __init__(self, data_plane: DataPlane) -> None:
        self.data_plane = data_plane
        self._seen: set[str] = set()

    async def rollouts(self, events: AsyncIterable[FinalizedEvent]) -> AsyncIterator[FinalizedRollout]:
        async for event in events:
            if event.rollout_id in self._seen:
                continue
            self._seen.add(event.rollout_id)
            keys = event.sample_keys
            fetched = await self.data_plane.get_samples(keys) if keys else {}
            yield FinalizedRollout(event, tuple(fetched[key] for key in keys))


class GroupCollector:
    """Collects finalized rollouts into complete groups of ``group_size`` rollouts."""

    def __init__(self, group_size: int) -> None:
        if group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {group_size}")
        self.group_size = group_size
        self._open: dict[str, Group] = {}

    def add(self, item: FinalizedRollout) -> Group | None:
        """The group once its last member arrived; rollouts without a group come back alone."""
        group_id = item.event.group_id
        if group_id is None:
            return Group(item.event.rollout_id, [item])
        group = self._open.setdefault(group_id, Group(group_id))
        group.members.append(item)
        if len(group.members) < self.group_size:
            return None
        return self._open.pop(group_id)

    @property
    def pending(self) -> dict[str, Group]:
        return dict(self._open)
