"""The trainer feed: finalized rollouts in, acknowledged training batches out.

A ``TrainerFeed`` consumes ``tokentrail.finalized`` in a consumer group of its own
(``tokentrail-trainer``: its lag is in ``tokentrail lag``, and in
``tokentrail_consumer_lag`` on the feed's metrics registry). It assembles GRPO groups
(a group whose members do not all arrive within ``group_timeout_s`` is released
partial, and a member arriving after that comes alone, marked late), fetches the
accepted samples of ``groups_per_batch`` groups in one read, and yields them as a
``TrainBatch`` (``stages.trainer.batch``): rejected members stay in the batch's groups,
so the trainer sees each hole.

Acknowledge, then forget. Nothing is committed until the trainer calls ``ack(batch)``:
the batch's samples are deleted from the data plane first, then the group commits past
its events (the lowest offset still unacknowledged bounds each partition). A trainer
that dies before acknowledging gets those batches again; one that dies between the
delete and the commit finds the samples gone on redelivery and skips them (counted as
``missing``), so no sample trains twice and none stays in the data plane. Duplicate
events (a finalizer redelivery) are dropped by rollout id, remembered in bounded memory.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Self

from prometheus_client import Counter

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.consumer import DEFAULT_TUNING, ConsumerLoop, ConsumerTuning
from pipeline.kafka.producer import KafkaEventSink
from pipeline.stagehost.lag import DEFAULT_INTERVAL_S, poll_lag
from pipeline.stagehost.metrics import MeteredHandler, StageMetrics
from pipeline.trainer.shift import shift_behaviour_temperature
from stages.finalize.reader import FinalizedRollout, Group, GroupCollector
from stages.finalize.retain import TRAINER_GROUP
from stages.ports import Consumed, DataPlane, TopicPartition, read_samples
from stages.recent import DEFAULT_REMEMBER, RecentIds
from stages.trainer.batch import TrainBatch, build_batch
from stages.trainer.staleness import StalenessPolicy
from topics.records import FinalizedEvent, TrainingSample

log = logging.getLogger(__name__)

COMMIT_WAIT_S = 30.0


@dataclass(frozen=True, slots=True)
class FeedSettings:
    group_size: int
    """Rollouts per GRPO group (the driver's ``--group-size``)."""
    groups_per_batch: int = 1
    group_timeout_s: float = 300.0
    """A group still missing members this long after its first arrived is released partial."""
    batch_wait_s: float | None = None
    """Yield a smaller batch once a group has waited this long for others (None: wait)."""
    staleness: StalenessPolicy = field(default_factory=StalenessPolicy)
    remember: int = DEFAULT_REMEMBER
    """Rollout ids remembered to drop duplicate deliveries."""
    group: str = TRAINER_GROUP
    tuning: ConsumerTuning = DEFAULT_TUNING
    shift_behaviour_temperature: float | None = None
    """Benchmark only (``pipeline.trainer.shift``): every fed sample's calls claim this
    temperature, so the trainer replays a distribution that did not sample. None: as captured."""

    def __post_init__(self) -> None:
        if self.groups_per_batch < 1:
            raise ValueError(f"groups_per_batch: must be >= 1, got {self.groups_per_batch}")
        if self.group_timeout_s <= 0:
            raise ValueError(f"group_timeout_s: must be > 0, got {self.group_timeout_s}")
        if self.shift_behaviour_temperature is not None and not self.shift_behaviour_temperature > 0:
            raise ValueError(
                f"shift_behaviour_temperature: must be > 0, got {self.shift_behaviour_temperature}"
            )


class FeedMetrics:
    """What the feed adds to a stage's metrics: groups, samples and acknowledgements."""

    def __init__(self, stage: StageMetrics) -> None:
        self.stage = stage
        self.groups = Counter(
            "tokentrail_trainer_groups_total",
            "Groups handed to the trainer: complete, partial (released after the timeout) or late",
            ["kind"],
            registry=stage.registry,
        )
        self.samples = Counter(
            "tokentrail_trainer_samples_total",
            "Samples by what became of them: fed, stale_dropped, stale_downweighted, missing",
            ["outcome"],
            registry=stage.registry,
        )
        self.acked = Counter(
            "tokentrail_trainer_batches_acked_total",
            "Batches the trainer acknowledged",
            registry=stage.registry,
        )
        self.paced = Counter(
            "tokentrail_trainer_paced_waits_total",
            "Rollouts held back before they started, because the policy version was too far behind",
            registry=stage.registry,
        )
        self.duplicates = Counter(
            "tokentrail_trainer_duplicates_total",
            "Finalized events dropped as already delivered",
            registry=stage.registry,
        )


class TrainerFeed:
    """``async with TrainerFeed(...) as feed``: ``await feed.next_batch()``, train, ``await feed.ack(batch)``.

    ``policy_version`` is the weight version the trainer holds; set it after every
    update, since staleness is measured against it.
    """

    def __init__(
        self,
        config: KafkaConfig,
        data_plane: DataPlane,
        settings: FeedSettings,
        *,
        metrics: StageMetrics | None = None,
        lag_interval_s: float = DEFAULT_INTERVAL_S,
        only: Callable[[FinalizedEvent], bool] | None = None,
    ) -> None:
        """``only``: the rollouts this trainer wants (say, one run's); the group reads past the others."""
        self.config = config
        self._only = only
        self.data_plane = data_plane
        self.settings = settings
        self.policy_version = 0
        self.stage_metrics = metrics or StageMetrics("trainer", process=False)
        self.metrics = FeedMetrics(self.stage_metrics)
        self._collector = GroupCollector(settings.group_size, timeout_s=settings.group_timeout_s)
        self._seen = RecentIds(settings.remember)
        self._ready: list[Group] = []
        """Released groups a batch has not taken yet."""
        self._wake = asyncio.Event()
        self._outstanding: dict[TopicPartition, set[int]] = defaultdict(set)
        self._where: dict[str, tuple[TopicPartition, int]] = {}
        """Where each rollout not yet acknowledged came from."""
        self._lag_interval_s = lag_interval_s
        self._loop: ConsumerLoop | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sink: KafkaEventSink | None = None

    # -- lifecycle ---------------------------------------------------------------

    async def __aenter__(self) -> Self:
        self._sink = await KafkaEventSink(self.config).__aenter__()
        topics = [self.config.names.finalized]
        self._loop = ConsumerLoop(
            self.config,
            group_id=self.settings.group,
            topics=topics,
            handler=MeteredHandler(_Inbox(self), self.stage_metrics),
            dead_letters=self._sink,
            stage="trainer",
            tuning=self.settings.tuning,
        )
        self.stage_metrics.watch_loop(self.settings.group, self._loop.stats)
        lag = poll_lag(
            self.config,
            self.stage_metrics,
            group=self.settings.group,
            topics=topics,
            interval_s=self._lag_interval_s,
        )
        self._tasks = [
            asyncio.create_task(self._consume(), name="trainer-feed"),
            asyncio.create_task(lag, name="trainer-feed-lag"),
        ]
        return self

    async def _consume(self) -> None:
        assert self._loop is not None
        try:
            await self._loop.run()
        finally:
            self._wake.set()  # a waiting next_batch sees the loop is gone

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._loop is not None:
            self._loop.request_stop()
        for task in self._tasks:
            if task.get_name() != "trainer-feed":
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._sink is not None:
            await self._sink.__aexit__(exc_type, exc, tb)

    # -- the trainer's side ------------------------------------------------------

    async def batches(self) -> AsyncIterator[TrainBatch]:
        while True:
            yield await self.next_batch()

    async def next_batch(self, groups: Collection[str] | None = None) -> TrainBatch:
        """The next ``groups_per_batch`` groups (fewer after ``batch_wait_s``), as tensors.

        ``groups``: exactly these groups (by id) instead, in the order they were released:
        a trainer that takes its batches in admission order names each step's groups, and
        the others wait for their own step.
        """
        first_ready: float | None = None
        wanted = self.settings.groups_per_batch if groups is None else len(groups)
        wait = self.settings.batch_wait_s
        while True:
            self._check_running()
            self._release(self._collector.expired())
            ready = self._ready if groups is None else [g for g in self._ready if g.group_id in groups]
            if ready and first_ready is None:
                first_ready = time.monotonic()
            waited = first_ready is not None and wait is not None and time.monotonic() - first_ready >= wait
            if len(ready) >= wanted or (ready and waited):
                break
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self._poll_s())
        chosen = ready[:wanted]
        taken = {id(group) for group in chosen}
        self._ready = [group for group in self._ready if id(group) not in taken]
        return await self._batch(chosen)

    async def ack(self, batch: TrainBatch) -> None:
        """Forget the batch: delete its samples (the stale ones too), then commit past its events."""
        members = [member for group in batch.groups for member in group.members]
        keys = [sample.key for member in members for sample in member.samples]
        await self.data_plane.delete_samples(keys)
        wanted: dict[TopicPartition, int] = {}
        for member in members:
            where = self._where.pop(member.event.rollout_id, None)
            if where is None:
                continue  # its partition was revoked: the new owner delivers it again
            partition, offset = where
            self._outstanding[partition].discard(offset)
            wanted[partition] = max(wanted.get(partition, -1), offset + 1)
        self.metrics.acked.inc()
        await self._committed(wanted)

    # -- internals ---------------------------------------------------------------

    def _check_running(self) -> None:
        consume = self._tasks[0] if self._tasks else None
        if consume is None:
            raise RuntimeError("TrainerFeed is not started; use 'async with'")
        if consume.done():
            error = None if consume.cancelled() else consume.exception()
            raise RuntimeError(f"the trainer feed's consumer stopped: {error!r}")

    def _poll_s(self) -> float:
        return min(1.0, self.settings.group_timeout_s, self.settings.batch_wait_s or 1.0)

    def _release(self, groups: list[Group]) -> None:
        for group in groups:
            self.metrics.groups.labels(
                "late" if group.late else "partial" if group.partial else "complete"
            ).inc()
        self._ready += groups

    async def _batch(self, groups: list[Group]) -> TrainBatch:
        keys = [key for group in groups for member in group.members for key in member.event.sample_keys]
        fetched = await self._fetch(keys)
        filled = [
            Group(
                group.group_id,
                [
                    FinalizedRollout(m.event, tuple(fetched[k] for k in m.event.sample_keys if k in fetched))
                    for m in group.members
                ],
                partial=group.partial,
                late=group.late,
            )
            for group in groups
        ]
        batch = build_batch(filled, policy_version=self.policy_version, staleness=self.settings.staleness)
        downweighted = int((batch.sample_weights < 1.0).sum()) if len(batch) else 0
        self.metrics.samples.labels("fed").inc(len(batch))
        self.metrics.samples.labels("stale_dropped").inc(len(batch.stale))
        self.metrics.samples.labels("stale_downweighted").inc(downweighted)
        return batch

    async def _fetch(self, keys: list[str]) -> dict[str, TrainingSample]:
        """Every sample that is still there; one that is not was consumed before a crash
        (or lost with the data plane), and is skipped."""
        found, gone = await read_samples(self.data_plane, keys)
        if gone:
            log.warning("trainer feed: %d sample(s) no longer in the data plane, skipped", len(gone))
            self.metrics.samples.labels("missing").inc(len(gone))
        shift = self.settings.shift_behaviour_temperature
        if shift is None:
            return found
        return {key: shift_behaviour_temperature(sample, shift) for key, sample in found.items()}

    async def _committed(self, wanted: Mapping[TopicPartition, int]) -> None:
        """Wait until the group committed past the acknowledged events it still owns."""
        loop = self._loop
        assert loop is not None
        deadline = time.monotonic() + COMMIT_WAIT_S
        while time.monotonic() < deadline:
            owned = {(tp.topic, tp.partition) for tp in loop.assignment}
            committed = {(tp.topic, tp.partition): offset for tp, offset in loop.committed.items()}
            if all(committed.get(tp, -1) >= offset for tp, offset in wanted.items() if tp in owned):
                return
            await asyncio.sleep(0.05)
        log.warning(
            "trainer feed: offsets not committed within %.0fs (the group is rebalancing?)", COMMIT_WAIT_S
        )

    # -- called by the consumer loop (through _Inbox) ------------------------------

    def _arrive(self, item: Consumed) -> None:
        event = item.event.payload
        if not isinstance(event, FinalizedEvent) or (self._only is not None and not self._only(event)):
            return
        if event.rollout_id in self._seen:
            self.metrics.duplicates.inc()
            return
        self._seen.add(event.rollout_id)
        partition = (item.topic, item.partition)
        self._outstanding[partition].add(item.offset)
        self._where[event.rollout_id] = (partition, item.offset)
        group = self._collector.add(FinalizedRollout(event))  # a group's clock starts at arrival
        if group is not None:
            self._release([group])
            self._wake.set()

    def _committable(self, positions: Mapping[TopicPartition, int]) -> Mapping[TopicPartition, int]:
        return {
            tp: min(self._outstanding[tp]) if self._outstanding.get(tp) else position
            for tp, position in positions.items()
        }

    def _revoked(self, partitions: Sequence[TopicPartition]) -> None:
        """Whoever owns these partitions now delivers their unacknowledged events again."""
        lost = set(partitions)
        for partition in lost:
            self._outstanding.pop(partition, None)
        gone = {rollout for rollout, (partition, _) in self._where.items() if partition in lost}
        for rollout in gone:
            del self._where[rollout]
            self._seen.discard(rollout)
        self._collector.discard(gone)
        for group in self._ready:
            group.members = [m for m in group.members if m.event.rollout_id not in gone]
        self._ready = [group for group in self._ready if group.members]


class _Inbox:
    """The feed as the consumer loop's handler: arrivals in, commits held to acknowledgements."""

    def __init__(self, feed: TrainerFeed) -> None:
        self.feed = feed

    async def handle(self, batch: Sequence[Consumed]) -> None:
        for item in batch:
            self.feed._arrive(item)

    async def tick(self, now: float) -> None:
        del now

    def committable(self, positions: Mapping[TopicPartition, int]) -> Mapping[TopicPartition, int]:
        return self.feed._committable(positions)

    def on_revoked(self, partitions: Sequence[TopicPartition]) -> None:
        self.feed._revoked(partitions)
