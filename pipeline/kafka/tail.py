"""Which rollouts a stage already answered: read from the tail of its own output topic.

A stage remembers, in memory, the rollouts it has closed (the ledger) or finalized
(the finalizer) so that duplicated or replayed input does not produce a second,
different outcome. That memory dies with the process and does not follow a partition
to another group member; whenever partitions are assigned, the member rebuilds it for
them from the last events of the same partitions of the topic it publishes to (a
rollout's events share a partition number on every topic). Only keys and the type header are
read (no payload is decoded), so warming is cheap even for a long tail.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from pipeline.kafka.config import KafkaConfig
from pipeline.kafka.lag import LagReader
from pipeline.kafka.reader import assigned_reader
from topics.codec import HEADER_TYPE
from topics.events import EventType

FETCH_TIMEOUT_MS = 500
STALL_WARNING_S = 30.0
"""A partition behind its high watermark that gives nothing this long is named in a
warning: the stage is not ready until its recall ends (a read held by the broker, or
offsets that never came to exist, DESIGN §3)."""

log = logging.getLogger(__name__)


async def recent_keys(
    config: KafkaConfig,
    topic: str,
    event_type: EventType,
    *,
    per_partition: int,
    partitions: Iterable[int] | None = None,
    stall_warning_s: float = STALL_WARNING_S,
) -> list[str]:
    """Keys of the ``event_type`` events among the last ``per_partition`` events of each
    partition of ``topic`` (or of the given partition numbers), oldest first within a
    partition."""
    if per_partition < 0:
        raise ValueError(f"per_partition: must be >= 0, got {per_partition}")
    if per_partition == 0:
        return []
    async with LagReader(config) as reader:
        every = await reader.partitions([topic])
        wanted_numbers = None if partitions is None else set(partitions)
        chosen = [tp for tp in every if wanted_numbers is None or tp.partition in wanted_numbers]
        marks = await reader.watermarks(chosen)
    starts = {tp: max(m.log_start, m.highwater - per_partition) for tp, m in marks.items()}
    pending = {tp for tp, m in marks.items() if m.highwater > starts[tp]}
    if not pending:
        return []
    wanted = event_type.value.encode()
    keys: list[str] = []
    progressed = dict.fromkeys(pending, time.monotonic())
    async with assigned_reader(config, {tp: starts[tp] for tp in sorted(pending)}) as consumer:
        while pending:
            fetched = await consumer.getmany(*pending, timeout_ms=FETCH_TIMEOUT_MS)
            now = time.monotonic()
            for tp, records in fetched.items():
                for record in records:
                    if record.key is not None and (HEADER_TYPE, wanted) in list(record.headers):
                        keys.append(record.key.decode(errors="replace"))
                if records:
                    progressed[tp] = now
                if records and records[-1].offset + 1 >= marks[tp].highwater:
                    pending.discard(tp)
            for tp in pending:
                if now - progressed[tp] >= stall_warning_s:
                    progressed[tp] = now  # said again only after as long again
                    log.warning(
                        "reading %s[%d] up to its high watermark %d: no record at offset %d for %.0f s",
                        tp.topic, tp.partition, marks[tp].highwater, await consumer.position(tp), stall_warning_s,
                    )  # fmt: skip
    return keys
