"""Abstract ports the stages use; ``pipeline`` implements them on Kafka and TransferQueue."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from topics.events import Envelope
from topics.records import Record, StagedCall, TrainingSample

STAGING_PARTITION = "staging"
SAMPLES_PARTITION = "samples"


class DataPlaneError(RuntimeError):
    """The data plane failed or did not answer in time."""


class DataPlaneTimeout(DataPlaneError):
    """A data-plane call did not finish within its timeout."""


class MissingRows(DataPlaneError):
    """Some requested keys have no readable row; ``keys`` names exactly those."""

    def __init__(self, partition: str, keys: Sequence[str]) -> None:
        super().__init__(f"{partition}: no readable row for {len(keys)} key(s): {', '.join(keys[:10])}")
        self.partition = partition
        self.keys = tuple(keys)


class DataPlane(Protocol):
    """Heavy token rows and finalized samples, addressed by key.

    Rows come back as stored, built without re-running the §4.2 rules, so that a
    verifier can map each corruption to its own failure code.
    """

    async def put_calls(self, rows: Sequence[StagedCall]) -> None: ...

    async def get_calls(self, keys: Sequence[str]) -> dict[str, StagedCall]: ...

    async def delete_calls(self, keys: Sequence[str]) -> None: ...

    async def put_samples(self, samples: Sequence[TrainingSample]) -> None: ...

    async def get_samples(self, keys: Sequence[str]) -> dict[str, TrainingSample]: ...

    async def delete_samples(self, keys: Sequence[str]) -> None: ...

    async def list_keys(self, partition: str) -> list[str]: ...


class EventSink(Protocol):
    """Publishes records as events; returns once the broker acknowledged all of them."""

    async def publish(self, records: Sequence[Record]) -> None: ...


TopicPartition = tuple[str, int]


@dataclass(frozen=True, slots=True)
class Consumed:
    """One decoded event, where it came from, and when it was written (log time, seconds)."""

    topic: str
    partition: int
    offset: int
    event: Envelope[Record]
    timestamp: float = 0.0


class StageHandler(Protocol):
    """A consumer stage. The consumer loop decodes (dead-lettering what does not decode),
    calls ``handle`` with a batch, then commits what ``committable`` allows."""

    async def handle(self, batch: Sequence[Consumed]) -> None:
        """Apply a batch; every output is published and acknowledged before return."""

    async def tick(self, now: float) -> None:
        """Timer work (grace periods); called between batches and when idle.

        ``now`` is log time: how far the stage has read its partitions (the wall clock
        once it has read all of them), so a stage that lags, or a broker that was down,
        does not see time pass that its input has not seen.
        """

    def committable(self, positions: Mapping[TopicPartition, int]) -> Mapping[TopicPartition, int]:
        """Offsets safe to commit, given the next unread offset per partition.

        A stateless stage returns ``positions``; a stateful one returns, per partition,
        the lowest offset still needed by an open rollout.
        """
        ...

    def on_revoked(self, partitions: Sequence[TopicPartition]) -> None:
        """Drop state of partitions this instance no longer owns."""
