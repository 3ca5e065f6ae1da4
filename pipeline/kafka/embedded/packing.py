"""Packing: a partition's old record batches rewritten as a few large ones, so that
tansu's listing of it, and with it every fetch, stays short however long the log grows.

tansu's durable engine keeps each produced batch as an object named by its first offset
and lists all of a partition's objects to serve each fetch, so a fetch cost as much as
the partition held batches, and past a few thousand a reader at the end got nothing
within a 25 ms wait: the embedded broker stalled about two minutes into steady load
(DESIGN §3). The store packs: runs of consecutive small batches become one Kafka record
batch holding the same records at the same offsets, named by the first one's offset,
and the others go. A partition then holds one object per ``PACK_BYTES`` of its log, plus
the batches of the last ``PACK_AFTER_S``.

A fetch from an offset inside a pack is answered with the pack (the records before the
offset are the client's to skip, as in Kafka), so every reader, a consumer group resuming
at its commit or one outside any group, reads on as before
(``tests/integration/test_embedded_packing.py`` holds tansu to it). A batch is packed
once ``PACK_AFTER_S`` old, so a reader that follows the end of the log never asks for one
being rewritten (a fetch that lists a batch and then finds it gone fails and is tried
again). The newest batch is never packed (its end is where the next produce starts), nor
one already half a pack (so a full pack is written once). A pack is written before the
batches it replaces go, so a store killed in between leaves copies, never a gap; the store
drops them when it starts again (``drop_replaced``).
"""

from __future__ import annotations

import logging
import os
import struct
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import localbucket
from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from pipeline.kafka.embedded.listing import Listing
from pipeline.kafka.embedded.unwritten import StoredBatch, batch_end, stored_batches

PACK_BYTES = 4 * 1024 * 1024
"""The most a pack holds: a reader from the log start gets one per fetch."""
PACK_AFTER_S = 10.0
"""How old a batch is before it is packed: far behind any reader that follows the end."""
PACK_EVERY_S = 5.0
"""How often the store packs what has become packable."""
BASE_OFFSET = slice(0, 8)
"""Where a record batch keeps its first offset; the checksum does not cover it."""

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Packed:
    """One partition's batches rewritten as fewer."""

    topic: str
    partition: int
    batches: int
    """How many batch objects went into packs."""
    packs: int


class NotPackable(ValueError):
    """A batch that cannot go into a pack (a checksum that fails, a control batch)."""


def plan_packs(
    batches: Sequence[StoredBatch], written_before: float, pack_bytes: int = PACK_BYTES
) -> list[list[StoredBatch]]:
    """The runs of consecutive ``batches`` (in offset order) to rewrite as one pack each.

    A batch may go into a pack when it is not the newest, was written before
    ``written_before``, and is smaller than half of ``pack_bytes`` (one that large is left
    as it is, so a full pack is never rewritten). A run closes before a batch that may
    not, or that would take it past ``pack_bytes``; a run of one stays as it is."""
    runs: list[list[StoredBatch]] = []
    run: list[StoredBatch] = []
    run_bytes = 0
    for batch in batches[:-1]:
        packable = batch.written_at < written_before and batch.size < pack_bytes // 2
        if run and (not packable or run_bytes + batch.size > pack_bytes):
            runs.append(run)
            run, run_bytes = [], 0
        if packable:
            run.append(batch)
            run_bytes += batch.size
    runs.append(run)
    return [run for run in runs if len(run) > 1]


def packed_batch(batches: Iterable[tuple[int, bytes]]) -> bytes:
    """One record batch holding every record of ``batches`` (each its first offset and its
    bytes, consecutive) at the offset it had, with its timestamp, key, value and headers."""
    builder = DefaultRecordBatchBuilder(
        magic=2,
        compression_type=0,
        is_transactional=0,
        producer_id=-1,
        producer_epoch=-1,
        base_sequence=-1,
        batch_size=2**31 - 1,
    )
    first: int | None = None
    end = records = 0
    for base, data in batches:
        if first is None:
            first = base
        elif base != end:
            raise NotPackable(f"batch at offset {base} does not follow the one ending at {end}")
        batch = DefaultRecordBatch(struct.pack(">q", base) + data[BASE_OFFSET.stop :])
        if not batch.validate_crc():
            raise NotPackable(f"batch at offset {base}: its checksum does not match")
        if batch.is_control_batch or batch.is_transactional:
            raise NotPackable(f"batch at offset {base}: a control or transactional batch")
        for record in batch:
            records += 1
            builder.append(
                record.offset - first, record.timestamp, record.key, record.value, list(record.headers)
            )
        end = batch.next_offset
    if first is None:
        raise NotPackable("no batches to pack")
    # tansu takes a batch's end to be its first offset plus its records (so does the next
    # fetch), so a pack must hold a record at every offset it covers.
    if records != end - first:
        raise NotPackable(f"batches from offset {first} to {end} hold {records} records")
    built = builder.build()
    built[BASE_OFFSET] = struct.pack(">q", first)
    return bytes(built)


def pack(
    bucket_dir: Path, index: Listing, after_s: float = PACK_AFTER_S, now: float | None = None
) -> list[Packed]:
    """Pack, in every partition under ``bucket_dir``, the runs ``plan_packs`` names for
    batches written ``after_s`` before ``now``."""
    written_before = (time.time() if now is None else now) - after_s
    packed: list[Packed] = []
    for cluster_dir in sorted((bucket_dir / "clusters").glob("*")):
        for topic_dir in sorted((cluster_dir / "topics").glob("*")):
            for partition_dir in sorted((topic_dir / "partitions").glob("*")):
                runs = plan_packs(stored_batches(partition_dir / "records"), written_before)
                done = [run for run in runs if _pack_run(bucket_dir, run, index)]
                if done:
                    batches = sum(len(run) for run in done)
                    packed.append(Packed(topic_dir.name, int(partition_dir.name), batches, len(done)))
    return packed


def drop_replaced(root: Path) -> int:
    """Delete the batches a pack before them already holds, which a store killed between
    writing a pack and deleting what it replaced leaves behind (a reader would get their
    records twice); before the store serves. Returns how many went."""
    dropped = 0
    for records in root.glob("*/clusters/*/topics/*/partitions/*/records"):
        end: int | None = None
        for batch in stored_batches(records):
            if end is not None and batch.base < end:
                batch.path.unlink(missing_ok=True)
                dropped += 1
                continue
            end = batch_end(batch.path, batch.base)
    return dropped


def _pack_run(bucket_dir: Path, run: Sequence[StoredBatch], index: Listing) -> bool:
    """Rewrite ``run`` as one pack under its first batch's name; False if a batch of it
    cannot be packed (logged: it stays as it is)."""
    try:
        data = packed_batch((batch.base, batch.path.read_bytes()) for batch in run)
    except (NotPackable, FileNotFoundError) as exc:
        log.warning("packing %s: %s; left as it is", run[0].path.parent, exc)
        return False
    kept = run[0].path
    fd, temporary = tempfile.mkstemp(dir=kept.parent, prefix=localbucket.TEMP_PREFIX)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        newest = max(batch.written_at for batch in run)
        os.utime(temporary, (newest, newest))  # retention counts from its newest record

        def rewrite() -> None:
            os.replace(temporary, kept)  # first: a kill from here on leaves copies, never a gap
            for batch in run[1:]:
                batch.path.unlink(missing_ok=True)

        index.rewritten(bucket_dir, kept, [batch.path for batch in run[1:]], rewrite)
    finally:
        Path(temporary).unlink(missing_ok=True)
    return True
