"""Merging input partitions in log-time order, the same way live and in a replay (DESIGN §7.2).

A stateful stage whose decisions depend on time (the ledger's seal grace) must see the
same sequence of events whatever the fetch schedule, or a replay of the log would decide
differently from the live loop. Fetched records wait here until the merge order is
known: the next record out is the head with the lowest timestamp (ties by topic and
partition), and only once every other partition either has a head of its own or is known
to hold nothing earlier (its *bound*: ``math.inf`` when it is finished, the log time up to
which it was read when it is caught up, ``-math.inf`` while records are still to be
fetched). Within a partition records keep their log order, so timestamps that go back
(several producers on one partition) are merged as Kafka Streams does: by heads.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from stages.ports import TopicPartition

Item = TypeVar("Item")

Bound = Callable[[TopicPartition], float]
"""For a partition with nothing buffered: the log time (seconds) before which it holds
no record still to come."""


@dataclass(frozen=True, slots=True)
class Released(Generic[Item]):
    """What one ``release`` let out, in merge order, and how far log time has provably got."""

    items: list[Item]
    frontier: float
    """No record still to be released has a timestamp below this (``-inf`` while some
    partition must be fetched first)."""


class LogTimeMerge(Generic[Item]):
    """Per-partition buffers of ``(timestamp_s, item)`` released in merge order.

    ``ties``: topics in the order their records go when timestamps are equal (topics
    not named go last, by name). Timestamps have millisecond resolution, so ties are
    common and their order must be a rule, not chance.
    """

    def __init__(self, ties: Sequence[str] = ()) -> None:
        self._buffers: dict[TopicPartition, deque[tuple[float, Item]]] = {}
        self._rank = {topic: rank for rank, topic in enumerate(ties)}

    def _key(self, stamp: float, tp: TopicPartition) -> tuple[float, int, TopicPartition]:
        return (stamp, self._rank.get(tp[0], len(self._rank)), tp)

    def add(self, tp: TopicPartition, entries: Iterable[tuple[float, Item]]) -> None:
        """Append records fetched from ``tp``, in their log order."""
        self._buffers.setdefault(tp, deque()).extend(entries)

    def drop(self, partitions: Iterable[TopicPartition]) -> None:
        """Forget what is buffered for partitions given up or sought elsewhere."""
        for tp in partitions:
            self._buffers.pop(tp, None)

    def held(self) -> int:
        return sum(len(buffer) for buffer in self._buffers.values())

    def empty(self, tp: TopicPartition) -> bool:
        return not self._buffers.get(tp)

    def earliest(self) -> float | None:
        """The lowest timestamp among the partitions' heads; None when nothing is buffered."""
        return min((buffer[0][0] for buffer in self._buffers.values() if buffer), default=None)

    def release(self, partitions: Iterable[TopicPartition], bound: Bound) -> Released[Item]:
        """Everything that can leave now, across ``partitions``, in merge order."""
        limit = math.inf
        heads: list[tuple[float, int, TopicPartition]] = []
        for tp in partitions:
            buffer = self._buffers.get(tp)
            if buffer:
                heads.append(self._key(buffer[0][0], tp))
            else:
                limit = min(limit, bound(tp))
        heapq.heapify(heads)
        out: list[Item] = []
        while heads and heads[0][0] <= limit:
            _, _, tp = heads[0]
            buffer = self._buffers[tp]
            out.append(buffer.popleft()[1])
            if buffer:  # the partition's next record takes its place: one sift, not two
                heapq.heapreplace(heads, self._key(buffer[0][0], tp))
            else:
                heapq.heappop(heads)
                limit = min(limit, bound(tp))
        frontier = min(limit, heads[0][0]) if heads else limit
        return Released(out, frontier)

    def release_all(self) -> list[Item]:
        """Everything buffered, partition by partition (for stages that need no order)."""
        out = [item for buffer in self._buffers.values() for _, item in buffer]
        self._buffers.clear()
        return out
