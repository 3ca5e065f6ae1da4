"""The trainer's side: finalized events in, samples (and complete GRPO groups) out.

The reader consumes ``FinalizedEvent``s (from any source: the Kafka consumer in
``pipeline`` or a replay), drops duplicate deliveries, fetches each accepted sample
from the data plane, and never drops a rejected rollout silently: it is yielded with
``sample=None`` so a group-based trainer can see the hole.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass, field

from stages.ports import DataPlane
from topics.records import FinalizedEvent, TrainingSample


@dataclass(frozen=True, slots=True)
class FinalizedSample:
    event: FinalizedEvent
    sample: TrainingSample | None

    @property
    def accepted(self) -> bool:
        return self.sample is not None


@dataclass(slots=True)
class Group:
    """All members of one GRPO group, accepted or rejected."""

    group_id: str
    members: list[FinalizedSample] = field(default_factory=list)

    @property
    def accepted(self) -> list[FinalizedSample]:
        return [m for m in self.members if m.accepted]

    @property
    def rejected(self) -> list[FinalizedSample]:
        return [m for m in self.members if not m.accepted]


class SampleReader:
    """Turns a stream of finalized events into samples, once each."""

    def __init__(self, data_plane: DataPlane) -> None:
        self.data_plane = data_plane
        self._seen: set[str] = set()

    async def samples(self, events: AsyncIterable[FinalizedEvent]) -> AsyncIterator[FinalizedSample]:
        async for event in events:
            if event.rollout_id in self._seen:
                continue
            self._seen.add(event.rollout_id)
            if event.status == "accepted":
                assert event.sample_key is not None
                fetched = await self.data_plane.get_samples([event.sample_key])
                yield FinalizedSample(event, fetched[event.sample_key])
            else:
                yield FinalizedSample(event, None)


class GroupCollector:
    """Collects finalized samples into complete groups of ``group_size``."""

    def __init__(self, group_size: int) -> None:
        if group_size < 1:
            raise ValueError(f"group_size: must be >= 1, got {group_size}")
        self.group_size = group_size
        self._open: dict[str, Group] = {}

    def add(self, item: FinalizedSample) -> Group | None:
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
