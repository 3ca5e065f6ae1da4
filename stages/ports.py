"""Abstract ports the stages use; ``pipeline`` implements them on Kafka and TransferQueue."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, TypeVar, runtime_checkable

from stages.recent import RecentIds
from topics.codec import RawRecord, raw_record
from topics.events import Envelope
from topics.records import Record, StagedCall, TrainingSample
from topics.staging import CallRow

T = TypeVar("T")

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

    async def put_calls(self, rows: Sequence[CallRow]) -> None: ...

    async def get_calls(self, keys: Sequence[str]) -> dict[str, StagedCall]: ...

    async def delete_calls(self, keys: Sequence[str]) -> None: ...

    async def put_samples(self, samples: Sequence[TrainingSample]) -> None: ...

    async def get_samples(self, keys: Sequence[str]) -> dict[str, TrainingSample]: ...

    async def delete_samples(self, keys: Sequence[str]) -> None: ...

    async def list_keys(self, partition: str) -> list[str]: ...


async def read_calls(plane: DataPlane, keys: Sequence[str]) -> tuple[dict[str, StagedCall], set[str]]:
    """Every readable row of ``keys`` in one read (two when some are missing), and the
    keys that have none. A partial answer is the normal case while rows are still being
    staged, or after a loss the caller must name exactly."""
    return await _read_available(plane.get_calls, keys)


async def read_samples(plane: DataPlane, keys: Sequence[str]) -> tuple[dict[str, TrainingSample], set[str]]:
    """Every sample of ``keys`` still stored, and the keys that have none (consumed by a
    trainer, or lost with the data plane), as ``read_calls`` reads rows."""
    return await _read_available(plane.get_samples, keys)


async def _read_available(
    get: Callable[[Sequence[str]], Awaitable[dict[str, T]]], keys: Sequence[str]
) -> tuple[dict[str, T], set[str]]:
    try:
        return await get(keys), set()
    except MissingRows as exc:
        missing = set(exc.keys)
    readable = [key for key in keys if key not in missing]
    try:
        return (await get(readable) if readable else {}), missing
    except MissingRows as exc:  # rows vanished between the two reads
        return {}, missing | set(exc.keys) | set(readable)


class EventSink(Protocol):
    """Publishes records as events; returns once the broker acknowledged all of them."""

    async def publish(self, records: Sequence[Record]) -> None: ...


TopicPartition = tuple[str, int]


class Consumed(NamedTuple):
    """One decoded event, where it came from, and when it was written (log time, seconds).

    A named tuple rather than a frozen dataclass: as immutable, and a third of the cost
    to build, once per event read."""

    topic: str
    partition: int
    offset: int
    event: Envelope[Record]
    timestamp: float = 0.0
    raw: RawRecord | None = None
    """The record's bytes as read from the log, kept so a dead letter can carry them."""

    def as_raw(self) -> RawRecord:
        """The record as it lies in the log (re-encoded for one that never did)."""
        return self.raw or raw_record(self.topic, self.partition, self.offset, self.event)


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


@dataclass(frozen=True, slots=True)
class StageGauges:
    """State only a stage knows, read when metrics are scraped; ``None`` where the stage
    keeps no such state (a stateless stage holds no open rollouts)."""

    duplicates: int
    open_rollouts: int | None = None
    late: int | None = None
    swept: Mapping[str, int] | None = None
    """Staging rows a janitor deleted, by why (``finished``, ``expired``)."""
    retained: Mapping[str, int] | None = None
    """The finalizer's copies of samples their owners have not acknowledged (``held``,
    ``held_bytes``) and what became of the others (``released``, ``over_budget``, ``restored``)."""


class StagePort(StageHandler, Protocol):
    """What the runtime needs from a consumer stage beyond handling batches, so that it
    hosts any stage without naming one."""

    @property
    def name(self) -> str: ...

    @property
    def answered(self) -> RecentIds:
        """Rollouts this stage already answered; the host seeds it, on every partition
        assignment, from the tail of the stage's output topic (the recall rule, DESIGN §7)."""
        ...

    def gauges(self) -> StageGauges: ...


@runtime_checkable
class Resumable(StagePort, Protocol):
    """A stage a rebuild can cut and continue from a checkpoint (DESIGN §7.7): its state
    is its task clocks, the rollouts it answered, and the events of those still open."""

    @property
    def open(self) -> Mapping[str, object]:
        """The rollouts still open, by id."""
        ...

    def clocks(self) -> dict[int, float]: ...

    async def resume(
        self, clocks: Mapping[int, float], answered: Iterable[str], events: Sequence[Consumed]
    ) -> None: ...
