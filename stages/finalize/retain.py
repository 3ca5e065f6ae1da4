"""Samples the finalizer keeps until their owner has them, so a data plane that restarts
empty loses none that nobody has read (DESIGN §7.4).

The data plane keeps samples in its owner's memory. A trainer reads a sample some time
after its ``FinalizedEvent``; if the data plane's owner dies in between, the sample is
gone although its rollout was accepted. So the finalizer keeps a copy of every sample it
wrote, in memory and in a spool on its disk (written before the outcome is published),
until each owning consumer group (the trainer feed, the samples archive) has committed
past the sample's ``FinalizedEvent``, which a group does only once it has the sample
(the feed commits after ``ack``). When the finalizer re-attaches to a restarted data
plane, and whenever it starts, it puts every copy back.

Which offset a ``FinalizedEvent`` got is not known to the finalizer, only its
partition. So each held sample is marked, at the first check after it was published,
with its partition's end offset then (the event lies below it), and let go once every
owner's committed offset on that partition reaches the mark: at most one check later
than exact, never earlier. Memory and spool are bounded: over ``budget_bytes`` the
oldest samples are let go and counted (``over_budget``), the only ones a restart can
still lose.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from stages.ports import SAMPLES_PARTITION, DataPlane, read_samples
from topics.records import TrainingSample

log = logging.getLogger(__name__)

TRAINER_GROUP = "tokentrail-trainer"
"""The trainer feed's consumer group: the samples' owner unless the finalizer is told others."""
DEFAULT_BUDGET_BYTES = 256 * 2**20
CHECK_EVERY_S = 1.0
RECLAIM_CHUNK = 256
SAMPLE_OVERHEAD_BYTES = 1024
"""Identity, spans, hashes and object headers of a sample, beyond its token vectors."""


def sample_bytes(sample: TrainingSample) -> int:
    """What a sample costs to keep: an id, a mask entry, a logprob and a version a token."""
    return SAMPLE_OVERHEAD_BYTES + 24 * len(sample.token_ids)


@dataclass(frozen=True, slots=True)
class OwnerProgress:
    """One reading of the finalized topic: its end offsets, and how far every owner got."""

    ends: Mapping[int, int]
    """Partition → end offset (the next offset to be written) when read."""
    acknowledged: Mapping[int, int]
    """Partition → the lowest committed offset among the owners (absent: one never committed)."""


class SampleSpool(Protocol):
    """Where the copies outlive the finalizer's process: a file a batch, removed once none
    of its samples is needed."""

    def write(self, samples: Sequence[TrainingSample]) -> str:
        """Store a batch's samples; returns the id to remove them by."""
        ...

    def remove(self, spool_id: str) -> None: ...

    def load(self) -> list[tuple[str, list[TrainingSample]]]:
        """Every batch stored and not removed, oldest first."""
        ...


class SampleOwners(Protocol):
    """The consumer groups that own the finalizer's samples, as the broker sees them."""

    def partition_of(self, rollout_id: str) -> int:
        """The finalized topic's partition a rollout's ``FinalizedEvent`` goes to."""
        ...

    async def progress(self) -> OwnerProgress: ...

    async def unacknowledged(self) -> list[str]:
        """Keys of accepted samples whose outcome some owner has not committed past."""
        ...


@dataclass(frozen=True, slots=True)
class RetentionConfig:
    budget_bytes: int = DEFAULT_BUDGET_BYTES
    check_every_s: float = CHECK_EVERY_S

    def __post_init__(self) -> None:
        if self.budget_bytes < 0:
            raise ValueError(f"budget_bytes: must be >= 0, got {self.budget_bytes}")
        if self.check_every_s <= 0:
            raise ValueError(f"check_every_s: must be > 0, got {self.check_every_s}")


@dataclass(slots=True)
class RetentionStats:
    held: int = 0
    held_bytes: int = 0
    released: int = 0
    """Let go because every owner acknowledged them."""
    over_budget: int = 0
    """Let go unread, over the budget: a data-plane restart loses these."""
    restored: int = 0
    """Put back into a restarted data plane."""
    checks_failed: int = 0

    def as_dict(self) -> dict[str, int]:
        return {
            "held": self.held,
            "held_bytes": self.held_bytes,
            "released": self.released,
            "over_budget": self.over_budget,
            "restored": self.restored,
        }


@dataclass(slots=True)
class _Held:
    sample: TrainingSample
    partition: int
    size: int
    spool_id: str | None
    mark: int | None = None


@dataclass
class RetainedSamples:
    """Written samples by key, oldest first, until their owners have them; with a spool,
    also on disk, so that a restarted finalizer has them again."""

    owners: SampleOwners
    config: RetentionConfig = field(default_factory=RetentionConfig)
    spool: SampleSpool | None = None
    clock: Callable[[], float] = time.monotonic
    stats: RetentionStats = field(default_factory=RetentionStats)
    _held: OrderedDict[str, _Held] = field(default_factory=OrderedDict, init=False)
    _spooled: dict[str, int] = field(default_factory=dict, init=False)
    """Spool id → how many of its samples are still held; removed at 0."""
    _checked_at: float = field(default=float("-inf"), init=False)
    restores: int = field(default=0, init=False)
    """Restarted data planes seen: a batch that saw this change put its samples again."""

    def store(self, samples: Sequence[TrainingSample]) -> str | None:
        """Before their outcomes are published: the samples on disk (no-op without a spool).
        Returns the spool id to ``hold`` them with."""
        return self.spool.write(samples) if self.spool is not None and samples else None

    def hold(self, samples: Sequence[TrainingSample], spool_id: str | None = None) -> None:
        """Keep samples whose ``FinalizedEvent`` the broker has acknowledged."""
        if spool_id is not None:
            self._spooled[spool_id] = self._spooled.get(spool_id, 0) + len(samples)
        for sample in samples:
            if sample.key in self._held:  # written again: the latest copy is the one to keep
                self._drop(sample.key)
            held = _Held(sample, self.owners.partition_of(sample.rollout_id), sample_bytes(sample), spool_id)
            self._held[sample.key] = held
            self.stats.held_bytes += held.size
        while self._held and self.stats.held_bytes > self.config.budget_bytes:
            self._drop(next(iter(self._held)))
            self.stats.over_budget += 1
        self.stats.held = len(self._held)

    async def maybe_check(self) -> None:
        """Let go of acknowledged samples, at most every ``check_every_s``."""
        now = self.clock()
        if not self._held or now - self._checked_at < self.config.check_every_s:
            return
        self._checked_at = now
        await self.check()

    async def check(self) -> None:
        """Read the owners' progress once and let go of every sample they all have."""
        try:
            progress = await self.owners.progress()
        except Exception as exc:  # the broker is away: keep everything, try again later
            self.stats.checks_failed += 1
            log.warning("could not read the sample owners' progress: %s", exc)
            return
        for key in list(self._held):
            held = self._held[key]
            if held.mark is None:
                held.mark = progress.ends.get(held.partition)
            acknowledged = progress.acknowledged.get(held.partition)
            if held.mark is not None and acknowledged is not None and acknowledged >= held.mark:
                self._drop(key)
                self.stats.released += 1
        self.stats.held = len(self._held)

    async def restore(self, plane: DataPlane) -> None:
        """Put every sample an owner may still need into a restarted data plane."""
        self.restores += 1
        await self.check()
        samples = [held.sample for held in self._held.values()]
        if samples:
            await plane.put_samples(samples)
            self.stats.restored += len(samples)
            log.warning("put %d unacknowledged sample(s) back into the restarted data plane", len(samples))

    async def reclaim(self, plane: DataPlane) -> None:
        """On start: the copies a previous process left in the spool, put back into the data
        plane (it may have restarted meanwhile), then copies of any other unacknowledged
        sample the data plane still has (a spool lost with its disk)."""
        if self.spool is not None:
            for spool_id, samples in self.spool.load():
                self.hold(samples, spool_id)
        await self.restore(plane)
        stored = set(await plane.list_keys(SAMPLES_PARTITION)) - set(self._held)
        if stored:  # a fresh data plane has none: no need to read the topic
            keys = [key for key in await self.owners.unacknowledged() if key in stored]
            for start in range(0, len(keys), RECLAIM_CHUNK):
                found, _ = await read_samples(plane, keys[start : start + RECLAIM_CHUNK])
                self.hold(list(found.values()), self.store(list(found.values())))
        log.info("keeping copies of %d unacknowledged sample(s)", len(self))

    def __len__(self) -> int:
        return len(self._held)

    def _drop(self, key: str) -> None:
        held = self._held.pop(key)
        self.stats.held_bytes -= held.size
        if held.spool_id is None:
            return
        left = self._spooled[held.spool_id] - 1
        if left:
            self._spooled[held.spool_id] = left
            return
        del self._spooled[held.spool_id]
        assert self.spool is not None
        self.spool.remove(held.spool_id)
