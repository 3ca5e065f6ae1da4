"""Where a gateway's restart may begin reading the log: its bookmark, kept on the broker.

A restart used to read the admission and staged topics from the beginning, so it grew
with the log's length. A session's events all lie at or after the high watermarks read
before it opened (its admissions are published after, and its staged events after
those), so each session keeps that *floor*; the bookmark is, per partition, the lowest
floor of the open sessions whose rollouts lie there (a rollout's events all lie in one
partition number, ``pipeline.kafka.keys``), or the latest watermarks where none does. Sessions sealed
before it are never read again. It is committed every ``--checkpoint-every`` seconds as
the offsets of a consumer group named for the gateway (``tokentrail-gateway``, or
``tokentrail-gateway.REPLICA``), where ``tokentrail lag`` shows how much a restart would
read.

Sessions older than ``--max-open`` do not hold it back: the ledger closes such a rollout
``never_sealed`` at that age (its later calls are lost anyway), so the gateway drops it
at restart. A replica restarted under its name keeps its previous bookmark for one
``--max-open``, since the sessions it held then may be taken over by another replica
(``takeover``) and are protected by nothing else.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping

from aiokafka import TopicPartition

from pipeline.gateway.sessions import Sessions
from pipeline.kafka.commits import commit_offsets
from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.keys import partition_of
from pipeline.kafka.lag import LagReader, Watermarks

log = logging.getLogger(__name__)

GROUP = "tokentrail-gateway"

Offsets = dict[TopicPartition, int]


def group_of(replica: str | None) -> str:
    """The consumer group holding the bookmark of one gateway (or replica)."""
    return GROUP if replica is None else f"{GROUP}.{replica}"


def lowest(mark: Mapping[TopicPartition, int], floors: Iterable[Mapping[TopicPartition, int]]) -> Offsets:
    """Per partition of ``mark``, the lowest of ``mark`` and every floor that names it."""
    point = dict(mark)
    for floor in floors:
        for tp, offset in floor.items():
            if tp in point and offset < point[tp]:
                point[tp] = offset
    return point


class Bookmark:
    """The gateway's bookmark: read at start, advanced and committed while it serves."""

    def __init__(
        self, kafka: KafkaConfig, sessions: Sessions, *, replica: str | None, max_open_s: float
    ) -> None:
        if max_open_s <= 0:
            raise ValueError(f"max_open_s: must be > 0, got {max_open_s}")
        self.kafka = kafka
        self.sessions = sessions
        self.group = group_of(replica)
        self.max_open_s = max_open_s
        self.inherited: Offsets = {}
        """A restarted replica's previous bookmark, kept until ``inherited_until``."""
        self.inherited_until = 0.0
        self.previous: Offsets = {}
        """What this group had committed when ``start`` read it (where it had)."""

    @property
    def topics(self) -> list[str]:
        return [self.kafka.names.admission, self.kafka.names.staged]

    async def watermarks(self) -> dict[TopicPartition, Watermarks]:
        async with LagReader(self.kafka) as reader:
            return await reader.watermarks(await reader.partitions(self.topics))

    async def start(self) -> Offsets:
        """Where this gateway's restart reads from: its committed bookmark, the log start
        where it committed none. Also the first mark for sessions opened from now on."""
        marks = await self.watermarks()
        async with LagReader(self.kafka) as reader:
            committed = await reader.committed(self.group, sorted(marks))
        self.sessions.mark = {tp: mark.highwater for tp, mark in marks.items()}
        self.previous = {
            tp: max(marks[tp].log_start, offset) for tp, offset in committed.items() if offset is not None
        }
        return {tp: self.previous.get(tp, marks[tp].log_start) for tp in marks}

    def inherit(self) -> None:
        """Keep the bookmark ``start`` read for one ``max_open`` (replicas: see the module)."""
        self.inherited = dict(self.previous)
        self.inherited_until = self.sessions.clock() + self.max_open_s

    async def for_rollout(self, partition: int) -> Offsets:
        """Where to read one partition number from to take a rollout over: the lowest
        bookmark any gateway committed there, the log start where none did."""
        wanted = [TopicPartition(topic, partition) for topic in self.topics]
        async with LagReader(self.kafka) as reader:
            marks = await reader.watermarks(wanted)
            groups = [g for g in await reader.groups() if g == GROUP or g.startswith(GROUP + ".")]
            committed: Offsets = {}
            for group in groups:
                for tp, offset in (await reader.committed(group, wanted)).items():
                    if offset is not None and offset < committed.get(tp, offset + 1):
                        committed[tp] = offset
        return {tp: max(marks[tp].log_start, committed.get(tp, 0)) for tp in wanted}

    async def advance(self) -> Offsets:
        """Read new watermarks, commit the bookmark they allow, and make them the floor of
        sessions opened from now on. Never below the log start: what retention deleted is
        no one's to read (and would read as a lost range in ``tokentrail lag``)."""
        marks = await self.watermarks()
        mark = {tp: mark.highwater for tp, mark in marks.items()}
        partitions = self.kafka.names.partitions
        floors = []
        for rollout_id, floor in self.sessions.floors(self.max_open_s):
            own = partition_of(rollout_id, partitions)  # a rollout's events lie in one partition number
            floors.append({tp: offset for tp, offset in floor.items() if tp.partition == own})
        if self.inherited and self.sessions.clock() < self.inherited_until:
            floors.append(self.inherited)
        point = {tp: max(marks[tp].log_start, offset) for tp, offset in lowest(mark, floors).items()}
        await commit_offsets(self.kafka, self.group, point)
        self.sessions.mark = mark
        return point

    async def advance_forever(self, every_s: float) -> None:
        while True:
            await asyncio.sleep(every_s)
            try:
                await self.advance()
            except Exception:  # the broker away: the previous bookmark still holds
                log.exception("committing the gateway's bookmark failed")


__all__ = ["GROUP", "Bookmark", "group_of", "lowest"]
