"""Consumer lag per (group, topic, partition) = highwater − committed, exactly.

Watermarks come from ListOffsets as Kafka defines it: latest is the high watermark,
earliest the log start. Committed offsets come from the group coordinator (OffsetFetch
with explicit partitions).

A broker whose ListOffsets(latest) is not the high watermark
(``BrokerProfile.exact_list_offsets`` false: the embedded broker answers too small a
number once producers batch) is read through the high watermark and log start a Fetch
response carries instead:

1. ListOffsets(latest) gives ``L``, a lower bound there;
2. a Fetch at offset ``L`` (1 byte, 1 ms max wait: the embedded broker answers nothing
   at all with 0 ms) returns the partition's high watermark ``H`` and log start;
3. ``H >= L`` is checked (a watermark never moves backwards), and ``H`` is used.

Fetching at ``L`` keeps that probe cheap: at most one batch lies at or past ``L``.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from types import TracebackType
from typing import Any, Self

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import AIOKafkaClient
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.protocol.offset import OffsetRequest

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.kind import cluster_profile
from pipeline.kafka.profile import BrokerProfile

LATEST = -1
EARLIEST = -2
_NOT_LEADER = 6
_WAITS_MS = (1, 10, 100, 1000)


class LagError(RuntimeError):
    """The broker's offsets are missing or contradict each other."""


@dataclass(frozen=True, slots=True)
class Watermarks:
    """Where a partition's log starts and the offset the next record will get."""

    log_start: int
    highwater: int


@dataclass(frozen=True, slots=True)
class LostRange:
    """Offsets ``[first, end)`` of a partition that the log deleted (by retention) before
    a consumer group read them: the group will never see those records."""

    group: str
    topic: str
    partition: int
    first: int
    end: int

    @property
    def records(self) -> int:
        return self.end - self.first

    def __str__(self) -> str:
        return (
            f"group {self.group} lost {self.topic}[{self.partition}] offsets {self.first} to {self.end - 1} "
            f"({self.records} records): the log deleted them before the group read them"
        )


def lost_range(
    group: str, topic: str, partition: int, offset: int | None, log_start: int
) -> LostRange | None:
    """What a group that has read up to ``offset`` (its commit, or its position) can no
    longer read: the offsets below the partition's log start. A group that never
    committed (``None``) starts at the log start and loses nothing."""
    if offset is None or offset >= log_start:
        return None
    return LostRange(group, topic, partition, offset, log_start)


@dataclass(frozen=True, slots=True)
class PartitionLag:
    """Lag of one consumer group on one partition.

    ``committed`` is None when the group never committed there; it then starts at
    the log start, and that is what lag counts from. A commit below the log start is a lost range (``lost``), not lag.
    """

    group: str
    topic: str
    partition: int
    committed: int | None
    log_start: int
    highwater: int

    @property
    def lag(self) -> int:
        start = self.committed if self.committed is not None else self.log_start
        return max(self.highwater - max(start, self.log_start), 0)

    @property
    def lost(self) -> LostRange | None:
        return lost_range(self.group, self.topic, self.partition, self.committed, self.log_start)

    def as_dict(self) -> dict[str, Any]:
        lost = self.lost
        return {**asdict(self), "lag": self.lag, "lost_records": lost.records if lost is not None else 0}


def total_lag(rows: Iterable[PartitionLag]) -> int:
    return sum(row.lag for row in rows)


def lag_by_group(rows: Iterable[PartitionLag]) -> dict[str, int]:
    totals: dict[str, int] = defaultdict(int)
    for row in rows:
        totals[row.group] += row.lag
    return dict(totals)


class LagReader:
    """Reads watermarks and committed offsets; one per process is plenty."""

    def __init__(self, config: KafkaConfig) -> None:
        self.config = config
        self._client: AIOKafkaClient | None = None
        self._admin: AIOKafkaAdminClient | None = None

    async def start(self) -> None:
        if self._client is not None:
            return
        kwargs = self.config.client_kwargs()
        client = AIOKafkaClient(**kwargs)
        admin = AIOKafkaAdminClient(**kwargs)
        try:
            await client.bootstrap()
            await admin.start()
            if self.config.broker is None:
                self.config = dataclasses.replace(self.config, broker=await cluster_profile(admin))
        except BaseException:
            await client.close()
            await admin.close()
            raise
        self._client, self._admin = client, admin

    async def stop(self) -> None:
        client, admin = self._client, self._admin
        self._client = self._admin = None
        if client is not None:
            await client.close()
        if admin is not None:
            await admin.close()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()

    # -- topology --------------------------------------------------------------

    async def partitions(self, topics: Iterable[str] | None = None) -> list[TopicPartition]:
        """Partitions of ``topics`` (default: every non-internal topic), sorted."""
        client = self._require_client()
        await client.force_metadata_update()
        cluster = client.cluster
        names = sorted(cluster.topics()) if topics is None else list(topics)
        found: list[TopicPartition] = []
        for topic in names:
            numbers = cluster.partitions_for_topic(topic)
            if numbers is None:
                raise LagError(f"unknown topic {topic!r}")
            found.extend(TopicPartition(topic, p) for p in sorted(numbers))
        return found

    async def cluster_id(self) -> str:
        """The cluster's id, as its metadata names it: which log a checkpoint was cut from."""
        described = await self._require_admin().describe_cluster()
        cluster = described.get("cluster_id")
        if not isinstance(cluster, str) or not cluster:
            raise LagError("the broker names no cluster id")
        return cluster

    async def groups(self) -> list[str]:
        """Every consumer group the cluster knows."""
        listed = await self._require_admin().list_consumer_groups()
        return sorted({entry[0] for entry in listed})

    # -- offsets ---------------------------------------------------------------

    async def committed(
        self, group: str, partitions: Sequence[TopicPartition]
    ) -> dict[TopicPartition, int | None]:
        """The group's committed offset per partition (None where it never committed)."""
        if not partitions:
            return {}
        answer = await self._require_admin().list_consumer_group_offsets(group, partitions=list(partitions))
        result: dict[TopicPartition, int | None] = {tp: None for tp in partitions}
        for tp, meta in answer.items():
            result[tp] = meta.offset if meta.offset >= 0 else None
        return result

    async def watermarks(self, partitions: Sequence[TopicPartition]) -> dict[TopicPartition, Watermarks]:
        """Exact log start and high watermark per partition (see the module docstring)."""
        if not partitions:
            return {}
        client = self._require_client()
        for attempt in range(2):
            try:
                ends = await self._list_offsets(partitions, LATEST)
                if self._require_broker().exact_list_offsets:
                    return await self._listed_watermarks(ends)
                return await self._fetch_watermarks(ends)
            except _Stale:
                if attempt:
                    raise LagError("partition leadership kept changing while reading offsets") from None
                await client.force_metadata_update()
        raise AssertionError("unreachable")

    async def _by_leader(self, partitions: Iterable[TopicPartition]) -> dict[int, list[TopicPartition]]:
        client = self._require_client()
        grouped: dict[int, list[TopicPartition]] = defaultdict(list)
        for tp in partitions:
            leader = client.cluster.leader_for_partition(tp)
            if leader is None or leader < 0:
                await client.force_metadata_update()
                leader = client.cluster.leader_for_partition(tp)
            if leader is None or leader < 0:
                raise LagError(f"no leader for {tp.topic}[{tp.partition}]")
            grouped[leader].append(tp)
        return grouped

    async def _list_offsets(
        self, partitions: Sequence[TopicPartition], which: int
    ) -> dict[TopicPartition, int]:
        client = self._require_client()
        result: dict[TopicPartition, int] = {}
        for node, tps in (await self._by_leader(partitions)).items():
            request = OffsetRequest(-1, 0, _topic_list(tps, lambda tp: (tp.partition, which)))
            response = await client.send(node, request)
            for topic, parts in response.topics:
                for partition, error, *info in parts:
                    tp = TopicPartition(topic, partition)
                    _check(error, tp, "ListOffsets")
                    if response.API_VERSION == 0:
                        result[tp] = info[0][0] if info[0] else 0
                    else:
                        result[tp] = info[1]
        missing = set(partitions) - set(result)
        if missing:
            raise LagError(f"ListOffsets did not answer for {sorted(missing)}")
        return result

    async def _listed_watermarks(
        self, ends: Mapping[TopicPartition, int]
    ) -> dict[TopicPartition, Watermarks]:
        """Kafka's watermarks: ListOffsets(earliest) for the log start beside ``ends``."""
        starts = await self._list_offsets(list(ends), EARLIEST)
        return {tp: Watermarks(log_start=starts[tp], highwater=end) for tp, end in ends.items()}

    async def _fetch_watermarks(self, ends: Mapping[TopicPartition, int]) -> dict[TopicPartition, Watermarks]:
        client = self._require_client()
        result: dict[TopicPartition, Watermarks] = {}
        need_log_start: list[TopicPartition] = []
        pending = dict(ends)
        for wait_ms in _WAITS_MS:
            for node, tps in (await self._by_leader(pending)).items():
                request = FetchRequest(
                    wait_ms, 0, 1, 0, _topic_list(tps, lambda tp: (tp.partition, max(pending[tp], 0), 1))
                )
                response = await client.send(node, request)
                for topic, parts in response.topics:
                    for partition, error, highwater, *rest in parts:
                        tp = TopicPartition(topic, partition)
                        if tp not in pending:
                            continue
                        _check(error, tp, "Fetch")
                        if highwater < pending[tp]:
                            raise LagError(
                                f"{topic}[{partition}]: fetch high watermark {highwater} is below "
                                f"the ListOffsets end {pending[tp]}"
                            )
                        if response.API_VERSION >= 5:
                            result[tp] = Watermarks(log_start=max(rest[1], 0), highwater=highwater)
                        else:
                            result[tp] = Watermarks(log_start=0, highwater=highwater)
                            need_log_start.append(tp)
                        del pending[tp]
            if not pending:
                break
        if pending:
            raise LagError(f"no high watermark in Fetch responses for {sorted(pending)}")
        if need_log_start:
            starts = await self._list_offsets(need_log_start, EARLIEST)
            for tp, start in starts.items():
                result[tp] = Watermarks(log_start=start, highwater=result[tp].highwater)
        return result

    # -- lag -------------------------------------------------------------------

    async def group_lag(self, group: str, topics: Iterable[str] | None = None) -> list[PartitionLag]:
        """Lag of one group on ``topics``, or on every topic where it has committed something."""
        explicit = topics is not None
        partitions = await self.partitions(topics)
        committed = await self.committed(group, partitions)
        if not explicit:
            active = {tp.topic for tp, offset in committed.items() if offset is not None}
            partitions = [tp for tp in partitions if tp.topic in active]
        marks = await self.watermarks(partitions)
        return [
            PartitionLag(
                group=group,
                topic=tp.topic,
                partition=tp.partition,
                committed=committed[tp],
                log_start=marks[tp].log_start,
                highwater=marks[tp].highwater,
            )
            for tp in partitions
        ]

    async def lag(
        self, groups: Iterable[str] | None = None, topics: Iterable[str] | None = None
    ) -> list[PartitionLag]:
        """Lag of ``groups`` (default: every group) on ``topics``, sorted by group, topic, partition."""
        chosen = sorted(groups) if groups is not None else await self.groups()
        topic_list = list(topics) if topics is not None else None
        rows: list[PartitionLag] = []
        for group in chosen:
            rows.extend(await self.group_lag(group, topic_list))
        return sorted(rows, key=lambda row: (row.group, row.topic, row.partition))

    # -- helpers ---------------------------------------------------------------

    def _require_client(self) -> AIOKafkaClient:
        if self._client is None:
            raise RuntimeError("LagReader is not started; use 'async with' or await start()")
        return self._client

    def _require_broker(self) -> BrokerProfile:
        if self.config.broker is None:
            raise RuntimeError("LagReader is not started; use 'async with' or await start()")
        return self.config.broker

    def _require_admin(self) -> AIOKafkaAdminClient:
        if self._admin is None:
            raise RuntimeError("LagReader is not started; use 'async with' or await start()")
        return self._admin


class _Stale(Exception):
    """Leadership moved; refresh metadata and try again."""


def _check(error: int, tp: TopicPartition, api: str) -> None:
    if error == _NOT_LEADER:
        raise _Stale()
    if error != 0:
        raise LagError(f"{api} for {tp.topic}[{tp.partition}] failed with error code {error}")


def _topic_list(tps: Iterable[TopicPartition], entry: Any) -> list[tuple[str, list[Any]]]:
    by_topic: dict[str, list[Any]] = defaultdict(list)
    for tp in tps:
        by_topic[tp.topic].append(entry(tp))
    return list(by_topic.items())
